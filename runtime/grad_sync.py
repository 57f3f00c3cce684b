"""Gradient synchronisation overlapped with the backward pass: the plan's buckets on one rank.

The plan records the buckets (instruction_set.sync: reverse order of first use, a cap).
Here each bucket gets one flat buffer per dtype, and its parameters' `.grad` are views into
it (torch DDP's gradient_as_bucket_view), so autograd accumulates straight into the buffer
and no flatten or copy-back pass is needed. A post-accumulate-grad hook on every parameter
counts down its bucket; once a bucket's last expected gradient has arrived and every bucket
before it has been launched, its all-reduce is issued asynchronously (gloo runs it on its own
threads while the backward goes on). `finish()` launches what is left, in order, and waits for
every bucket: that wait is the step's exposed gradient synchronisation. Under a precision
policy that reduces gradients in bfloat16 (runtime.mixed_precision.gradient_wire), a bucket's
stages run on a bfloat16 cast of its buffer made at launch, and the result is cast back into
the buffer when the last stage completes (a ZeRO-2 bucket: into this rank's rows).

All-reduce variants are chains of asynchronous collectives, "stages":

    ring          all_reduce over the bucket's axis
    hierarchical  reduce-scatter in the node, all-reduce of each rank's part across nodes,
                  all-gather in the node (BlueConnect; runtime.collectives.allreduce)

The in-node reduce-scatter is an all-to-all of the parts, summed when the next stage is
issued (runtime.collectives.allreduce.scatter_parts): gloo's reduce_scatter work has no
future and reports completion only once waited, so no hook or callback ever saw it done and
every hierarchical bucket's cross-node stage waited for finish(), after the backward (BERT on
the emulated cluster: the first bucket, launched 160 ms before the backward ended, completed
120 ms after its launch where a ring bucket of the same bytes took 70 ms).

A stage of a bucket is issued as soon as the bucket's previous stage has completed: the
completion of a stage's work runs a callback (its future's `then`, on gloo's thread) that
issues what has become ready, and the gradient hooks and finish() do the same. (Issuing a
stage only at the next gradient hook left each stage of a hierarchical bucket waiting for
the slowest rank's next hook: on the emulated cluster its first bucket took 150 ms for
0.85 MiB where a ring took 90 ms, against a wire time of 35 ms.) One lock guards the buckets'
state, so a hook and a callback never issue at once. gloo wants the collectives of a process
group in the same order on every rank, but completions arrive in a rank-dependent order; so
every (variant, axis, stage) "lane" has process groups of its own, used by nothing else, and a
lane issues its stage for the buckets strictly in index order. Each group thus sees one fixed
sequence of calls on every rank. (An earlier version ran the buckets on a Python side thread
fed by a queue; each hand-off between threads cost ~9 ms under a 0.25-CPU quota: 26 small
buckets waited 340 ms after the backward, against 120 ms for one unoverlapped bucket. DDP's
Reducer, too, issues async work from the hooks; a callback runs on the thread that completed
the work, with no hand-off.)

ZeRO-2 buckets (kind reduce_scatter, instruction_set.sync) reduce-scatter their parameters'
gradients onto every rank's state rows (the plan's `state_shards.rows`, uneven, zero rows
legal) instead of all-reducing them. Their parameters' `.grad` is no view: a gradient hook
copies the whole gradient autograd made into the bucket's copy-in buffer (allocated at the
bucket's first gradient, rank-major: [rank 0: p1 rows | p2 rows | ...][rank 1: ...], each
rank's segment padded to the largest for the padded variant) and drops it (`p.grad = None`),
so a whole gradient lives only from the backward op that makes it to its hook. The bucket is
one asynchronous reduce_scatter_single (padded) or one asynchronous reduce per rank to that
rank (grouped), issued like an all-reduce bucket's stage; when it completes, this rank's
segment is kept (its rows of every parameter, `row_grad`) and the copy-in buffer freed.
(ring, a chain of point-to-point steps, is not issued here: SCATTER_VARIANTS.)

Expected gradients: a parameter that a rank's program does not use (the addend another rank
keeps, `once:` local rewrites) gets no gradient there; its view stays zero, a zero summand.
Which parameters fire is learnt in the first step: until then, and whenever a parameter
expected does not fire, the bucket is launched by `finish()` (counted as late).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hetsynth.instruction_set.mesh import Mesh, MeshAxis
from hetsynth.instruction_set.sync import GradBucket
from hetsynth.runtime.collectives.allreduce import scatter_parts
from hetsynth.runtime.grad_rows import SCATTER_STAGES, RowsLayout, row_layouts
from hetsynth.runtime.groups import Groups, group_timeout


class GradientSyncError(RuntimeError):
    """A bucket's collective failed; the message names the bucket and the rank."""


@dataclass(frozen=True)
class BucketTiming:
    index: int
    nbytes: int
    launched_s: float   # from the start of the step's forward pass
    done_s: float       # when its last stage was seen complete (at a hook, or in finish())
    late: bool          # launched by finish(), not by a gradient hook


class Pending:
    """A stage's work seen through its future where the backend gives one (where it does
    not, as gloo's reduce_scatter, it is only polled, by the hooks and finish(), and waited
    exactly once, whichever thread asks first)."""

    def __init__(self, work: Any) -> None:
        self.work, self.lock = work, threading.Lock()
        self.waited, self.error = False, None
        try:
            self.future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            self.future = None

    def done(self) -> bool:
        """Finished (a work without a future may report itself complete only once waited)."""
        if self.future is not None:
            return self.future.done()
        return self.waited or self.work.is_completed()

    def wait(self) -> None:
        """The result (raises the work's error). A completion callback runs before gloo marks
        the work itself complete, so it must not call Work.wait(): that would wait for itself."""
        if self.future is not None:
            self.future.wait()
            return
        with self.lock:
            if not self.waited:
                try:
                    self.work.wait()
                except Exception as err:  # noqa: BLE001 - kept, raised to every caller
                    self.error = err
                self.waited = True
        if self.error is not None:
            raise self.error

    def then(self, callback: Callable[[Any], None]) -> None:
        if self.future is not None:
            self.future.then(callback)


@dataclass
class BucketRun:
    spec: GradBucket
    params: list[nn.Parameter]
    buffers: list[torch.Tensor]           # one flat buffer per dtype
    expected: set[int]                    # positions in `params` whose hook will fire
    pending: int = 0
    fired: set[int] = field(default_factory=set)
    stage: int = 0                        # next stage to issue
    works: list["Pending"] = field(default_factory=list)    # outstanding work of the current stage
    issued: bool = False                  # the current stage is issued and not yet completed
    state: list[Any] = field(default_factory=list)    # per buffer: what the next stage needs
    launched_s: float = 0.0
    done_s: float = 0.0
    late: bool = False
    layouts: list[RowsLayout] = field(default_factory=list)   # reduce_scatter: one per dtype (buffers lazily)
    wire: list[torch.Tensor] = field(default_factory=list)    # what the stages reduce: the buffers, or their casts
    row_grads: dict[int, torch.Tensor] = field(default_factory=dict)   # reduce_scatter: id(param) -> my rows

    @property
    def nbytes(self) -> int:
        if self.layouts:
            return sum(l.size * p.element_size() for l, p in zip(self.layouts, self._firsts()))
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _firsts(self) -> list[nn.Parameter]:
        return [next(p for p in self.params if p.dtype == d) for d in dict.fromkeys(p.dtype for p in self.params)]

    def dtype_index(self, i: int) -> tuple[int, int]:
        """(buffer, position in it) of parameter i (buffers by dtype, in first-seen order)."""
        dtypes = list(dict.fromkeys(p.dtype for p in self.params))
        d = dtypes.index(self.params[i].dtype)
        return d, sum(1 for p in self.params[:i] if p.dtype == self.params[i].dtype)

    def copy_in(self, i: int) -> None:
        """A reduce-scatter bucket: parameter i's whole gradient into the copy-in buffer, dropped."""
        p = self.params[i]
        if p.grad is None:
            return
        d, k = self.dtype_index(i)
        if self.buffers[d] is None:
            self.buffers[d] = p.grad.new_zeros(self.layouts[d].size)
        self.layouts[d].place(self.buffers[d], k, p.grad)
        p.grad = None


# -- the stages of each variant: (axis of the lane's group, issue(buffer, previous state, group) -> (work, state))

def _ring(flat: torch.Tensor, _: Any, group: Any) -> tuple[Any, Any]:
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat


def _scatter(flat: torch.Tensor, _: Any, group: Any) -> tuple[Any, Any]:
    return scatter_parts(flat, group, async_op=True)


def _across(_: torch.Tensor, parts: torch.Tensor, group: Any) -> tuple[Any, Any]:
    part = parts.sum(0)   # my part of the node's sum (the members' copies of it, received)
    return dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group, async_op=True), part


def _gather(flat: torch.Tensor, part: torch.Tensor, group: Any) -> tuple[Any, Any]:
    whole = flat.new_empty(part.numel() * dist.get_world_size(group))
    return dist.all_gather_single(whole, part, group=group, async_op=True), whole


Stage = tuple[str | None, Callable[[torch.Tensor, Any, Any], tuple[Any, Any]]]
STAGES: dict[str, tuple[Stage, ...]] = {
    "ring": ((None, _ring),),             # None: the bucket's own axis
    "hierarchical": (("inner", _scatter), ("outer", _across), ("inner", _gather)),
}


def _stages(kind: str, variant: str) -> tuple[Stage, ...]:
    table = SCATTER_STAGES if kind == "reduce_scatter" else STAGES
    if variant not in table:
        raise ValueError(f"gradient bucket {kind} variant {variant!r}: the runtime has {sorted(table)}")
    return table[variant]


def _flat_views(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """One zeroed buffer per dtype; every parameter's grad becomes a view into its buffer."""
    buffers = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        members = [p for p in params if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=members[0].device)
        offset = 0
        for p in members:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        buffers.append(flat)
    return buffers


# (world group, mesh, lane) -> this rank's process group of the lane. gloo groups hold threads
# and sockets until the process ends (torch frees them only with the default group), so a
# process makes each lane's groups once and every trainer in it (runtime.compare's entries, a
# test pool's tests) reuses them: safe, because a trainer finishes its buckets' work before
# its step returns, so two trainers' collectives never interleave on a lane.
_LANES: dict[tuple[int, Mesh, tuple[str, str, str, int]], Any] = {}


def _axis_group(mesh: Mesh, rank: int, axis: str, timeout: Any) -> Any:
    """New groups along `axis` (every group of the axis, in one order on every rank); mine."""
    if axis == MeshAxis.ALL:
        sets = [mesh.ranks]
    elif axis == MeshAxis.INNER:
        sets = [mesh.node_ranks(n) for n in range(mesh.num_nodes)]
    else:
        sets = [mesh.cross_ranks(local) for local in range(mesh.per_node)]
    mine = None
    for members in sets:
        group = dist.new_group(list(members), timeout=timeout)
        mine = group if rank in members else mine
    return mine


Lane = tuple[str, str, str, int]   # (kind, variant, axis, stage)


def lane_groups(buckets: list[GradBucket], groups: Groups) -> dict[Lane, Any]:
    """One process group per (kind, variant, axis, stage) lane the buckets use, for that lane
    alone (collective: every rank calls it with the same buckets)."""
    lanes = list(dict.fromkeys((b.kind, b.variant, b.axis, s) for b in buckets
                               for s in range(len(_stages(b.kind, b.variant)))))
    world = groups.group("all")
    out = {}
    for lane in lanes:
        key = (id(world), groups.mesh, lane)
        if key not in _LANES:
            axis = _stages(lane[0], lane[1])[lane[3]][0] or lane[2]
            _LANES[key] = _axis_group(groups.mesh, groups.rank, axis, group_timeout(world))
        out[lane] = _LANES[key]
    return out


class GradientSync:
    """The buckets of one rank (module docstring)."""

    def __init__(self, buckets: list[BucketRun], lanes: dict[Lane, Any], rank: int,
                 wire: torch.dtype | None = None) -> None:
        self.buckets, self.lanes, self.rank = buckets, lanes, rank
        self.wire = wire   # the dtype gradients are reduced in (runtime.mixed_precision.gradient_wire); None: their own
        self.next = 0            # next bucket to launch
        self.start_s = 0.0
        self.learnt = False
        self.lock = threading.RLock()   # the buckets' state: hooks, callbacks and finish()
        self.driving = self.again = False
        self.error: BaseException | None = None   # raised by a completion callback
        self.enabled = True   # False: the hooks do nothing (accumulation micro-steps, runtime.parallel)
        for k, run in enumerate(buckets):
            for i, p in enumerate(run.params):
                p.register_post_accumulate_grad_hook(lambda _p, k=k, i=i: self.on_grad(k, i))

    @staticmethod
    def build(module: nn.Module, specs: tuple[GradBucket, ...], groups: Groups,
              rows: dict[str, tuple[int, ...]] | None = None, wire: torch.dtype | None = None) -> "GradientSync":
        """`rows`: every ZeRO-2 parameter's rows per rank (the plan's state_shards.rows); `wire`:
        the dtype the buckets are reduced in (None: the gradients' own)."""
        runs = []
        for spec in specs:
            names = [n for n in spec.params if getattr(module, n).requires_grad]
            params = [getattr(module, n) for n in names]
            if not params:
                continue
            if spec.kind == "reduce_scatter":
                missing = [n for n in names if n not in (rows or {})]
                assert not missing and spec.axis == MeshAxis.ALL, f"reduce-scatter bucket without rows: {missing}"
                layouts = row_layouts(params, [rows[n] for n in names], groups.span("all"), spec.variant)  # type: ignore[index]
                runs.append(BucketRun(spec, params, [None] * len(layouts), set(range(len(params))), layouts=layouts))
            else:
                runs.append(BucketRun(spec, params, _flat_views(params), set(range(len(params)))))
        return GradientSync(runs, lane_groups([r.spec for r in runs], groups), groups.rank, wire)

    def row_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """A ZeRO-2 parameter's gradient on this rank's rows, once its bucket completed."""
        for run in self.buckets:
            if id(param) in run.row_grads:
                return run.row_grads[id(param)]
        return None

    @property
    def params(self) -> set[int]:
        return {id(p) for run in self.buckets for p in run.params}

    def begin_step(self) -> None:
        """Zero the buffers (the grads stay views) and arm every bucket."""
        self.error = None
        for run in self.buckets:
            if run.layouts:  # reduce-scatter: whole gradients land in a fresh copy-in buffer
                run.buffers, run.row_grads = [None] * len(run.layouts), {}
                for p in run.params:
                    p.grad = None
            for b in run.buffers:
                if b is not None:
                    b.zero_()
            run.pending, run.fired, run.stage, run.works, run.late = len(run.expected), set(), 0, [], False
            run.issued = False
        self.next = 0
        self.start_s = time.perf_counter()

    def repoint(self) -> None:
        """Every all-reduce bucket's parameters' `.grad` a view of its (zeroed) flat buffer again
        (a user's `optimizer.zero_grad()` sets them to None)."""
        for run in self.buckets:
            if run.layouts:
                continue
            for d, dtype in enumerate(dict.fromkeys(p.dtype for p in run.params)):
                offset = 0
                for p in (p for p in run.params if p.dtype == dtype):
                    view = run.buffers[d][offset:offset + p.numel()].view_as(p)
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                    offset += p.numel()

    def on_grad(self, k: int, i: int) -> None:
        if not self.enabled:  # gradients accumulate where they are (a bucket view, or a whole .grad)
            return
        with self.lock:
            run = self.buckets[k]
            if run.layouts:
                run.copy_in(i)
            run.fired.add(i)
            if i in run.expected:
                run.pending -= 1
            while self.next < len(self.buckets) and self.buckets[self.next].pending <= 0:
                self._launch(self.buckets[self.next])
            self._drive()

    def _drive(self) -> None:
        """_advance until nothing more is ready (lock held). A completion callback that runs
        inline, inside an _advance of this thread (its work was already done when chained),
        only asks for another round."""
        if self.driving:
            self.again = True
            return
        self.driving = self.again = True
        try:
            while self.again:
                self.again = False
                self._advance()
        finally:
            self.driving = False

    def _on_stage_done(self, _: Any) -> None:
        """A stage's work completed (gloo's thread, or inline): issue what is ready now."""
        try:
            with self.lock:
                self._drive()
        except BaseException as err:  # a callback must not raise into gloo; finish() does
            self.error = self.error or err

    def _launch(self, run: BucketRun) -> None:
        """Issue the bucket's first stage (its lane's earlier buckets all have: launch order)."""
        run.launched_s = time.perf_counter() - self.start_s
        run.state = [None] * len(run.buffers)
        if run.layouts:  # a bucket none of whose gradients came on this rank: zero summands
            run.buffers = [b if b is not None else run.params[0].new_zeros(l.size, dtype=p.dtype)
                           for b, l, p in zip(run.buffers, run.layouts, run._firsts())]
            run.state = list(run.layouts)
        run.wire = [b.to(self.wire) if self.wire is not None and b.is_floating_point() else b for b in run.buffers]
        self.next += 1
        self._issue(run)

    def _issue(self, run: BucketRun) -> None:
        stages = _stages(run.spec.kind, run.spec.variant)
        _, issue = stages[run.stage]
        group = self.lanes[(run.spec.kind, run.spec.variant, run.spec.axis, run.stage)]
        pairs = [issue(flat, state, group) for flat, state in zip(run.wire, run.state)]
        run.works = [Pending(w) for work, _ in pairs for w in (work if isinstance(work, list) else [work])]
        run.state, run.issued = [s for _, s in pairs], True
        if run.stage + 1 < len(stages):  # a later stage waits for this one
            for p in run.works:
                p.then(self._on_stage_done)

    def _advance(self) -> None:
        """Complete the stages whose work is done and issue each bucket's next stage, a lane's
        buckets strictly in index order (a bucket waits while an earlier one of its lane has
        not issued that stage yet)."""
        waiting: set[Lane] = set()   # lanes where an earlier bucket is behind
        for run in self.buckets[:self.next]:
            if run.issued and all(f.done() for f in run.works):
                self._complete(run)
            kind, variant, axis = run.spec.kind, run.spec.variant, run.spec.axis
            n = len(_stages(kind, variant))
            if not run.issued and run.stage < n and (kind, variant, axis, run.stage) not in waiting:
                self._issue(run)
            issued = run.stage if run.issued else run.stage - 1
            waiting |= {(kind, variant, axis, s) for s in range(issued + 1, n)}

    def _complete(self, run: BucketRun) -> None:
        """Take a finished stage."""
        for p in run.works:
            try:
                p.wait()
            except Exception as err:
                spec = run.spec
                raise GradientSyncError(
                    f"gradient sync of bucket {spec.index} ({spec.variant} {spec.kind} over {spec.axis}, "
                    f"{run.nbytes / 2**20:.2f} MiB, stage {run.stage}) failed on rank {self.rank}: "
                    f"{type(err).__name__}: {err}") from err
        run.works, run.issued = [], False
        run.stage += 1
        if run.stage < len(_stages(run.spec.kind, run.spec.variant)):
            return
        if run.layouts:  # this rank's rows, exactly (no padding), and the copy-in buffer freed
            for d, (layout, out) in enumerate(run.state):
                dtype = run._firsts()[d].dtype
                mine = out[:layout.lengths[layout.span.index]].to(dtype, copy=True)
                members = [p for p in run.params if p.dtype == dtype]
                run.row_grads.update({id(p): v for p, v in zip(members, layout.views(mine))})
            run.buffers, run.state, run.wire = [None] * len(run.layouts), [], []
        else:
            for flat, result in zip(run.buffers, run.state):
                if result is not flat:  # a stage's own tensor, or the bucket's cast (copy_ casts back)
                    flat.copy_(result[:flat.numel()])
            run.wire = []
        run.done_s = time.perf_counter() - self.start_s

    def finish(self) -> list[BucketTiming]:
        """Launch the buckets left (late), in order; complete every stage; timings."""
        with self.lock:
            while self.next < len(self.buckets):
                self.buckets[self.next].late = True
                self._launch(self.buckets[self.next])
            self._drive()
        for run in self.buckets:
            self._wait(run)
        if not self.learnt:  # from now on expect exactly the gradients this step produced
            for run in self.buckets:
                run.expected = set(run.fired)
            self.learnt = True
        return [BucketTiming(r.spec.index, r.nbytes, r.launched_s, r.done_s, r.late) for r in self.buckets]

    def _wait(self, run: BucketRun) -> None:
        """Block until every stage of `run` has completed (a stage's work is waited outside
        the lock, then its completion taken under it, by whichever thread gets there first)."""
        while True:
            with self.lock:
                if self.error is not None:
                    raise self.error
                self._drive()
                if run.stage == len(_stages(run.spec.kind, run.spec.variant)):
                    return
                pending = list(run.works)
            for p in pending:
                try:
                    p.wait()
                except Exception:  # noqa: BLE001 - _complete names the bucket when it waits the work
                    pass


__all__ = ["BucketRun", "BucketTiming", "GradientSync", "GradientSyncError", "STAGES",
           "lane_groups"]
