"""A graph captured at micro-batch size b, rebuilt on the full batch's nodes by what each computes.

torch.export's graphs of one model at batch sizes B and b < B can differ in more than shapes:
an op that is the identity at one size is left out (HuggingFace's `position_ids.expand(batch,
-1)` at batch 1), ops come in another order, and nodes are numbered otherwise. The pipeline
needs the graphs node for node (stage cuts are call indices, boundary tensors and statistics
are node names), so `aligned(full, small, B, b)` rebuilds the small capture on the full graph's
nodes. Node X of the full graph, in graph order, takes the node Y of the small graph that
computes the same thing:

- Y has X's target, its tensor inputs are the matches of X's inputs, in argument order, and
  its outputs have X's dtypes and shapes up to the batch (each dim equal, or x * b == y * B);
- its other arguments equal X's except integers that scale with the batch (x * b == y * B: an
  expand's size, a view's shape, an arange's end; not a getitem's index) and floats (a constant
  such as BatchNorm's n/(n-1), which planner.microbatch.classify reports as a coupling);
- of several such Y: the one with the fewest differing arguments, unused before used (a
  duplicated op may share one), the first in graph order;
- none, and X is a copy (clone: `.contiguous()` of a tensor that is contiguous at b only) or a
  shape op (expand, view, reshape) whose input's match already has X's shape at b: that input;
  the op is the identity at b and the capture left it out. X stays that op (a shape op to the
  input's shape).

A copy, or a shape op whose output has its input's shape, of the small graph stands for its
input, so that consumers match whether or not one capture kept it. X takes Y's arguments
(references renamed to the full graph's), outputs, FLOPs, saved tensors and measured time; its
name, module path and source stay the full graph's. Each rebuilt node computes what its match
computes in the small capture, so the rebuilt loss is the small capture's loss exactly. Graph
inputs (parameters, buffers, data) match by name. A full-graph node without a match raises
`MicroGraphMismatch` naming it and the small graph's ops on the same inputs.
"""

from __future__ import annotations

from typing import Any

from hetsynth.instruction_set.graph import Node, ReferenceGraph

SHAPE_OPS = frozenset({"aten.expand.default", "aten.view.default", "aten.reshape.default",
                       "aten._unsafe_view.default"})  # (tensor, shape): identity when shapes agree
COPIES = frozenset({"aten.clone.default", "aten.alias.default"})  # always the identity (values and gradients)


class MicroGraphMismatch(ValueError):
    """The graph at a micro-batch size computes something the full batch's does not."""


def _scales(x: int, y: int, full: int, micro: int) -> bool:
    return x == y or x * micro == y * full


def _arg_diffs(x: Any, y: Any, full: int, micro: int, strict_ints: bool) -> int | None:
    """How many leaves of Y's encoded argument differ from X's (module docstring); None when
    they cannot be the same op's."""
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return None
        total = 0
        for a, b in zip(x, y):
            d = _arg_diffs(a, b, full, micro, strict_ints)
            if d is None:
                return None
            total += d
        return total
    if isinstance(x, dict) and isinstance(y, dict) and "ref" in x and "ref" in y:
        return 0  # tensor inputs are compared by their matches
    if type(x) is not type(y):
        return None
    if isinstance(x, int) and not isinstance(x, bool):
        if x == y:
            return 0
        return None if strict_ints or not _scales(x, y, full, micro) else 1
    if isinstance(x, float):
        return int(x != y)
    return 0 if x == y else None


def _shape_fits(x: tuple[int, ...], y: tuple[int, ...], full: int, micro: int) -> bool:
    return len(x) == len(y) and all(_scales(a, b, full, micro) for a, b in zip(x, y))


def _outputs_fit(x: Node, y: Node, full: int, micro: int) -> bool:
    return len(x.outputs) == len(y.outputs) and all(
        a.dtype == b.dtype and _shape_fits(a.shape, b.shape, full, micro) for a, b in zip(x.outputs, y.outputs))


def _node_diffs(x: Node, y: Node, full: int, micro: int) -> int | None:
    if not _outputs_fit(x, y, full, micro) or sorted(x.kwargs) != sorted(y.kwargs):
        return None
    strict = x.target == "getitem"
    return _arg_diffs([list(x.args), [x.kwargs[k] for k in sorted(x.kwargs)]],
                      [list(y.args), [y.kwargs[k] for k in sorted(y.kwargs)]], full, micro, strict)


def _is_identity(graph: ReferenceGraph, node: Node) -> bool:
    return node.target in COPIES or (node.target in SHAPE_OPS and len(node.outputs) == 1
                                     and graph.node(node.inputs[0]).outputs[0].shape == node.out.shape)


def _merged(x: Any, y: Any) -> Any:
    """Y's encoded argument with X's references (the full graph's names)."""
    if isinstance(x, dict) and "ref" in x:
        return x
    if isinstance(x, list):
        return [_merged(a, b) for a, b in zip(x, y, strict=True)]
    return y


def _describe(node: Node) -> str:
    args = str(list(node.args))
    args = args if len(args) <= 100 else args[:96] + " ...]"
    return f"{node.name} = {node.target}{args} at {node.module_path or '<top>'}"


class _Matcher:
    """Matches the full graph's nodes, in order, to the small graph's (module docstring)."""

    def __init__(self, full: ReferenceGraph, small: ReferenceGraph, batch: int, micro: int) -> None:
        self.full, self.small, self.batch, self.micro = full, small, batch, micro
        self.order = {n.name: k for k, n in enumerate(small.nodes)}
        self.canon: dict[str, str] = {}  # small node -> the small node whose value it is
        self.buckets: dict[tuple[str, tuple[str, ...]], list[Node]] = {}
        for n in small.nodes:
            ins = tuple(self.canon[i] for i in n.inputs)
            self.canon[n.name] = ins[0] if n.op == "call" and _is_identity(small, n) else n.name
            if n.op == "call":
                self.buckets.setdefault((n.target, ins), []).append(n)
        self.value: dict[str, str] = {}  # full node -> the small node holding its value
        self.used: set[str] = set()
        self.timed = any(n.measured_s is not None for n in small.calls)

    def node(self, x: Node) -> Node:
        """X rebuilt at the micro-batch size."""
        if x.op != "call":
            return self._placeholder(x)
        ins = tuple(self.value[i] for i in x.inputs)
        scored = [(d, y.name in self.used, self.order[y.name], y) for y in self.buckets.get((x.target, ins), [])
                  if (d := _node_diffs(x, y, self.batch, self.micro)) is not None]
        if scored:
            y = min(scored, key=lambda s: s[:3])[3]
            self.used.add(y.name)
            self.value[x.name] = self.canon[y.name]
            return x.model_copy(update={
                "args": tuple(_merged(list(x.args), list(y.args))),
                "kwargs": {k: _merged(v, y.kwargs[k]) for k, v in x.kwargs.items()}, "outputs": y.outputs,
                "flops_fwd": y.flops_fwd, "flops_bwd": y.flops_bwd, "saved": y.saved,
                "measured_s": y.measured_s, "fallback": y.fallback, "multi_output": y.multi_output})
        if x.target in SHAPE_OPS | COPIES and _outputs_fit(x, self.small.node(ins[0]), self.batch, self.micro):
            return self._identity(x, ins[0])
        raise self._mismatch(x, ins)

    def _placeholder(self, x: Node) -> Node:
        name = x.name
        if name not in self.order or self.small.node(name).op != x.op:
            raise MicroGraphMismatch(f"the graph at micro-batch size {self.micro} has no {x.op} {name!r} "
                                     f"(the full batch's {self.batch} has)")
        self.value[name] = name
        return self.small.node(name)

    def _identity(self, x: Node, source: str) -> Node:
        """X as the identity shape op on `source` (the capture at b left it out)."""
        meta = self.small.node(source).outputs
        self.value[x.name] = source
        args = (x.args[0], list(meta[0].shape)) if x.target in SHAPE_OPS else x.args
        return x.model_copy(update={
            "args": args, "outputs": meta, "flops_fwd": 0.0,
            "flops_bwd": 0.0, "saved": () if x.saved is not None else None,
            "measured_s": 0.0 if self.timed else None})

    def _mismatch(self, x: Node, ins: tuple[str, ...]) -> MicroGraphMismatch:
        near = [_describe(y) for (t, i), ys in self.buckets.items() if i == ins for y in ys][:4]
        return MicroGraphMismatch(
            f"the graph at micro-batch size {self.micro} computes no counterpart of the full batch's "
            f"({self.batch}) {_describe(x)}; there, ops on the same inputs: {near or 'none'}")


def aligned(full: ReferenceGraph, small: ReferenceGraph, batch: int, micro: int) -> ReferenceGraph:
    """`small` (captured at `micro` samples) rebuilt on `full`'s nodes (captured at `batch`),
    module docstring; raises MicroGraphMismatch naming the first node without a match."""
    match = _Matcher(full, small, batch, micro)
    nodes = tuple(match.node(x) for x in full.nodes)
    if match.value[full.loss] != match.canon[small.loss]:
        raise MicroGraphMismatch(f"the graph at micro-batch size {micro} computes its loss {small.loss!r} "
                                 f"otherwise than the full batch's ({batch}) {full.loss!r}")
    return small.model_copy(update={"nodes": nodes, "loss": full.loss})
