"""Wall time of every instruction of a training step, for traces (`hetsynth run --trace`).

The runtime records raw times only; naming, merging and the comparison with the plan's
prediction are hetsynth.trace's work. A traced step runs a second GraphModule built from the
rank's program (same parameters, buffers and collective modules, so training is unchanged)
with a stamp after the last fx node of every instruction (RankProgram.ends), and just before
the node that does the work of an instruction a peephole merged away (RankProgram.merged):

- forward: instruction k runs from the end of the previous stamp to the start of its own
  (only get_attr nodes, which cost nothing, lie between two instructions);
- backward: the stamp also finds the autograd nodes instruction k created (reachable from its
  outputs' grad_fn, with a sequence number above every node seen before; AccumulateGrad
  excluded) and hooks them: a pre-hook and a post-hook record when each runs. The backward of
  k is the sum of its nodes' intervals, so unrelated nodes that the engine runs in between
  are not charged to k;
- the step's phases (data, forward, backward, gradient_sync, update, loss) from
  runtime.train's own marks.

Untraced steps run the plain program: the cost of tracing falls on the traced steps alone (a
perf_counter call per instruction, two Python hooks per autograd node).

Every rank of a traced step starts after a barrier, and its times are relative to that start,
so ranks on different machines need no common clock. Only synchronous execution is timed
correctly: on CPU (gloo) every op and collective has finished when the next stamp is taken.
For asynchronous work (CUDA kernels, collectives posted now and waited on later, the
overlapped collective+matmul of CommFuse) the stamps would become CUDA events recorded on the
stream (resolved after the step) and an asynchronous collective two slices: its post and its
wait, on the communication lane.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from hetsynth.runtime.codegen import RankProgram

_ACCUMULATE = "AccumulateGrad"


@dataclass
class Recorder:
    """Raw times of one traced step on this rank (perf_counter seconds)."""

    start: float = 0.0
    forward: list[tuple[int, float, float]] = field(default_factory=list)  # (instruction, end, next start)
    backward: list[list[Any]] = field(default_factory=list)           # [instruction, start, end]
    last_seq: int = -1

    def stamp(self, index: int, out: Any) -> Any:
        """Instruction `index` ended now; hook its autograd nodes; the next one starts when
        this returns (the hooking is nobody's time)."""
        end = time.perf_counter()
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        fresh = self._new_nodes([t.grad_fn for t in tensors if t.grad_fn is not None])
        for fn in fresh:
            self._hook(fn, index)
        self.forward.append((index, end, time.perf_counter()))
        return out

    def _new_nodes(self, roots: list[Any]) -> list[Any]:
        """Autograd nodes created since the previous instruction, reachable from `roots`."""
        floor, seen, todo, out = self.last_seq, set(), list(roots), []
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen or type(fn).__name__ == _ACCUMULATE or fn._sequence_nr() <= floor:
                continue
            seen.add(id(fn))
            out.append(fn)
            self.last_seq = max(self.last_seq, fn._sequence_nr())
            todo += [next_fn for next_fn, _ in fn.next_functions]
        return out

    def _hook(self, fn: Any, index: int) -> None:
        entry = [index, 0.0, 0.0]
        self.backward.append(entry)

        def before(*_: Any) -> None:
            entry[1] = time.perf_counter()

        def after(*_: Any) -> None:
            entry[2] = time.perf_counter()

        fn.register_prehook(before)
        fn.register_hook(after)


def _stamp(recorder: Recorder, index: int, out: Any) -> Any:
    return recorder.stamp(index, out)


def timed_module(program: RankProgram, recorder: Recorder) -> fx.GraphModule:
    """The program's GraphModule with a stamp after every instruction (module docstring)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ends = dict((name, index) for index, name in program.ends)
    merged: dict[str, list[int]] = {}
    for index, name in program.merged:
        merged.setdefault(name, []).append(index)
    holder = None
    for node in program.module.graph.nodes:
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            continue
        if node.op != "placeholder" and holder is None:
            holder = graph.get_attr("_hetsynth_recorder")
        for index in merged.get(node.name, ()):  # merged into this node: stamped just before it
            graph.call_function(_stamp, (holder, index, None))
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.name in ends:
            graph.call_function(_stamp, (holder, ends[node.name], env[node]))
    root = program.module
    root._hetsynth_recorder = recorder  # GraphModule copies what get_attr names from its root
    try:
        return fx.GraphModule(root, graph, class_name=type(root).__name__ + "Timed")
    finally:
        del root._hetsynth_recorder


def traced_program(program: RankProgram, recorder: Recorder) -> RankProgram:
    return replace(program, module=timed_module(program, recorder))


def step_record(step: int, recorder: Recorder, seconds: float, phases: dict[str, float]) -> dict[str, Any]:
    """One traced step as JSON data, times in seconds from the step's start."""
    t0, at = recorder.start, recorder.start
    spans = []
    for name, length in phases.items():  # runtime.train's marks are consecutive
        spans.append([name, at - t0, at - t0 + length])
        at += length
    return {"step": step + 1, "seconds": seconds, "phases": spans,  # 1-based, as `run` prints steps
            "forward": [[k, end - t0, resume - t0] for k, end, resume in recorder.forward],
            "backward": [[k, s - t0, e - t0] for k, s, e in recorder.backward if e >= s > 0]}


class StepTracer:
    """Runs traced steps of a trainer (runtime.train.Trainer): its timed program is built
    once, outside any step; every traced step starts after a barrier."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.recorder = trainer, Recorder()
        self.plain = trainer.program
        self.timed = traced_program(self.plain, self.recorder)
        self.steps: list[dict[str, Any]] = []

    def step(self, step: int, inputs: list[torch.Tensor] | None = None) -> Any:
        """hetsynth.runtime.train.train_step with every instruction timed; returns its StepLog."""
        from hetsynth.runtime.train import train_step

        self.recorder.forward.clear()
        self.recorder.backward.clear()
        self.recorder.last_seq = -1
        self.trainer.program = self.timed
        try:
            dist.barrier(group=self.trainer.groups.group("all"))
            self.recorder.start = time.perf_counter()
            log = train_step(self.trainer, step, inputs)
        finally:
            self.trainer.program = self.plain
        self.steps.append(step_record(step, self.recorder, log.seconds, log.phases))
        return log

    def record(self) -> dict[str, Any]:
        """This rank's raw record of every traced step (hetsynth.trace merges them)."""
        groups = self.trainer.groups
        return {"rank": groups.rank, "world_size": dist.get_world_size(), "model": self.trainer.plan.model.ref,
                "graph": self.trainer.plan.model.fingerprint, "steps": self.steps}
