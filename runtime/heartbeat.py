"""Rank status files: how the launcher tells a stuck rank from the ranks waiting for it.

Every rank that the launcher starts (HETSYNTH_STATUS=<dir> in its environment) keeps
`<dir>/rank<N>.json` up to date:

    {"rank": N, "pid": ..., "start": its start time (runtime.runstate.start_ticks), "state": "running" | "failed" | "done", "since": unix time of its
     first beat, "beat": of its last, "error": "<Type>: <message>" (when failed), "at": unix
     time of the final state}

A daemon thread rewrites it every BEAT_S seconds while the rank runs (write, then rename: a
reader never sees half a file); the main thread writes the final state. The thread keeps
beating while the main thread waits in a collective (gloo and NCCL release the GIL), so the
ranks waiting for a peer stay fresh, and a rank that is stopped (SIGSTOP, a frozen machine)
or killed stops beating.

The launcher (runtime.launch) reads the files while the run goes on and, once it fails,
names one rank (`diagnose`), in this order:

1. stalled: alive, still `running`, and its last beat older than STALE_S (at most half the
   timeout) when the run was found failing; or never started beating while the others have
   beaten that long. The others' collective timeouts are the consequence: they waited for it.
2. died: its process went away while `running`, by a signal other than SIGTERM (SIGKILL, a
   hard crash); the agents' failure records (runtime.agent) say which. SIGTERM is how an
   agent stops its other ranks after one failed: those are consequences.
3. failed: the earliest error a rank reported itself (its own clock), with its message.

Why not torch.distributed.elastic.timer (the agent kills a worker whose deadline passed): in
a stuck collective every rank's deadline passes, the stuck rank's and those of the ranks
waiting for it alike, so it cannot tell which rank is stuck; a heartbeat from a thread can.
A rank stuck in a busy loop keeps beating: then the first rank whose collective timed out is
named (a limit of every rank-level heartbeat; counting collectives would lift it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hetsynth.runtime.names import STATUS_ENV, process_state, start_ticks
from hetsynth.runtime.runstate import write_replacing

ENV = STATUS_ENV
BEAT_S = 0.5
STALE_S = 3.0


def _write(path: Path, data: dict) -> None:
    write_replacing(path, json.dumps(data), mode=0o644)


class Heartbeat:
    """This rank's status file (see the module docstring); a no-op without HETSYNTH_STATUS."""

    def __init__(self, rank: int, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(ENV)
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.data = {"rank": rank, "pid": os.getpid(), "start": start_ticks(os.getpid()), "state": "running",
                     "since": time.time()}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="hetsynth-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        if self.path is not None:
            self._beat()
            self._thread.start()
        return self

    def _beat(self) -> None:
        with self._lock:
            if self.data["state"] == "running":
                _write(self.path, self.data | {"beat": time.time()})

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()

    def finish(self, state: str, error: str | None = None) -> None:
        """The final state: "done", or "failed" with the rank's own error message."""
        self._stop.set()
        if self.path is None:
            return
        with self._lock:
            now = time.time()
            self.data = self.data | {"state": state, "beat": now, "at": now, "error": error}
            _write(self.path, self.data)


@dataclass(frozen=True)
class RankStatus:
    rank: int
    pid: int
    start: int | None
    state: str
    since: float
    beat: float
    error: str | None = None
    at: float | None = None


def read_status(directory: str | Path) -> dict[int, RankStatus]:
    """Every rank's last status in `directory` (ranks that have not started yet are absent)."""
    out = {}
    for path in Path(directory).glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced while reading: the next poll sees it
            continue
        out[data["rank"]] = RankStatus(data["rank"], data["pid"], data.get("start"), data["state"], data["since"], data["beat"],
                                       data.get("error"), data.get("at"))
    return out


STATE_WORDS = {"T": "stopped, e.g. by SIGSTOP", "t": "stopped by a debugger", "D": "in uninterruptible I/O"}


@dataclass(frozen=True)
class Diagnosis:
    rank: int
    kind: str   # stalled | died | failed
    why: str


def stalled(statuses: dict[int, RankStatus], now: float, stale_s: float) -> list[Diagnosis]:
    """Ranks alive and `running` whose last beat is at least `stale_s` old, oldest first."""
    out = []
    for s in sorted(statuses.values(), key=lambda s: s.beat):
        state = process_state(s.pid, s.start) if s.state == "running" else None
        if state is not None and now - s.beat >= stale_s:
            what = STATE_WORDS.get(state, "still running")
            out.append(Diagnosis(s.rank, "stalled", f"stopped making progress: no heartbeat for "
                                                    f"{now - s.beat:.1f} s (its process is {what})"))
    return out


def run_ranks(needle: str) -> dict[int, RankStatus]:
    """The rank statuses of the run whose launched processes (agents, ranks) have `needle` (a
    plan's path, say) in their command line, found through the status directory in their
    environment: the pid of rank N of a run, for a test or a benchmark that stops or kills it.
    Empty when no such run is found."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found = [e[len(ENV) + 1:] for e in env if e.startswith(f"{ENV}=".encode())]
        if needle.encode() in cmd and found:
            return read_status(found[0].decode())
    return {}


def missing(statuses: dict[int, RankStatus], world_size: int, now: float, stale_s: float) -> list[Diagnosis]:
    """Ranks that never beat although the others started at least `stale_s` ago."""
    if not statuses or now - min(s.since for s in statuses.values()) < stale_s:
        return []
    return [Diagnosis(r, "stalled", f"never started: no heartbeat {now - min(s.since for s in statuses.values()):.1f} s "
                                    f"after the first rank's") for r in range(world_size) if r not in statuses]


def died(statuses: dict[int, RankStatus], signals: dict[int, str]) -> list[Diagnosis]:
    """Ranks whose process went away while `running`, by one of `signals` (rank -> the
    signal that ended it, from the agents' failure records)."""
    return [Diagnosis(s.rank, "died", f"killed by {signals[s.rank]}")
            for s in sorted(statuses.values(), key=lambda s: s.beat)
            if s.rank in signals and s.state == "running" and process_state(s.pid, s.start) is None]


def failed(statuses: dict[int, RankStatus]) -> list[Diagnosis]:
    """Ranks that reported their own error, earliest first."""
    reported = sorted((s for s in statuses.values() if s.state == "failed"), key=lambda s: s.at or s.beat)
    return [Diagnosis(s.rank, "failed", s.error or "failed") for s in reported]


def diagnose(statuses: dict[int, RankStatus], found_at: float, *, world_size: int, timeout_s: float,
             signals: dict[int, str] | None = None) -> Diagnosis | None:
    """The rank to name for a run found failing at `found_at` (see the module docstring);
    `signals`: rank -> signal name of the ranks the agents saw end by a signal."""
    stale = min(STALE_S, timeout_s / 2)
    deaths = {r: s for r, s in (signals or {}).items() if s != "SIGTERM"}
    for found in (stalled(statuses, found_at, stale), missing(statuses, world_size, found_at, stale),
                  died(statuses, deaths), failed(statuses)):
        if found:
            return found[0]
    return None
