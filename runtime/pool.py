"""A pool of spawned ranks that runs many functions on one process group.

Spawning a rank costs about 2 s (mostly `import torch`), so tests and benchmarks start a world
once and submit work to it: `pool.run(fn, *args)` calls `fn(rank, world_size, *args)` on every
rank and returns the ranks' results in rank order. `fn` must be importable by name (a
module-level function). Processes are started with spawn (torch's OpenMP runtime hangs
forked children) and use one thread each. A rank that raises, dies or exceeds the timeout
fails the call with the failing rank named, and the pool is torn down (a later `run` on it
raises); no process outlives `close()`.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class PoolError(RuntimeError):
    """A rank of the pool failed; the message names it."""


def _worker(rank: int, world: int, init: str, backend: str, timeout_s: float, path: list[str],
            tasks: Any, results: Any) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # report every failure to the parent, keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="hetsynth-pool-")
        init = f"file://{os.path.join(self._dir, 'store')}"
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, init, backend, timeout_s, list(sys.path),
                                         self._tasks[r], self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.broken: str | None = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        if self.broken:
            raise PoolError(f"pool is unusable after an earlier failure: {self.broken}")
        for q in self._tasks:
            q.put((fn, args))
        return self._collect(timeout_s or self.timeout_s * 4)

    def _collect(self, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(out) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or left <= 0:
                    why = f"rank(s) {dead} died" if dead else f"no answer from ranks {sorted(set(range(self.world_size)) - set(out))} within {timeout_s:.0f} s"
                    self._fail(why)
                continue
            if not ok:
                self._fail(self._failures(rank, value))
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def _failures(self, rank: int, trace: str) -> str:
        """Every rank's error within a second of the first (the root cause is often not the
        first to arrive: peers of a failed rank report broken connections)."""
        failures = {rank: trace}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=1.0)
        while datetime.datetime.now() < deadline:
            try:
                r, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            if not ok:
                failures[r] = value
        return "\n".join(f"rank {r} raised:\n{t}" for r, t in sorted(failures.items()))

    def _fail(self, why: str) -> None:
        self.broken = why
        self.close()
        raise PoolError(why)

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
