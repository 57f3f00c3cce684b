"""Decompose a functional exported graph node by node, for speed.

`ExportedProgram.run_decompositions` retraces the whole program (functionalisation, proxy and
fake tensors for every op): 2.7 s of the 5.1 s that capturing gpt:xl (48 layers) took, where
most nodes are on the op surface already and the rest repeat once per layer. For a graph that
is already functional (no op mutates anything, the forward updates no buffer, no higher-order
op: the zoo's transformers and VGG, HF Llama), decomposing each node on its own gives the
same graph: every node the retrace would replace (its op in the table, or a
CompositeImplicitAutograd op not kept) is traced by `make_fx` on its export-time FakeTensors
(same shapes, strides, dtypes) in the retrace's dispatch state (the table split as
run_decompositions splits it, its CompositeImplicitAutograd overrides, the Python dispatcher,
below autograd), once per distinct signature (op, argument values, tensor metadata), and
the traced ops are spliced in its place with its module path and source line.

The dispatch state uses torch's private export helpers (torch is pinned, 2.13.0).
`decompose_locally` returns False and leaves the graph untouched when the graph or a trace is
not functional; planner.lower then runs `run_decompositions`. tests/test_capture.py checks
that both give the same nodes (ops, arguments, shapes, places, FLOPs) for GPT, VGG, MoE and
HF Llama, and that ResNet (BatchNorm's buffer updates) takes the retrace.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.export._trace import _ignore_backend_decomps
from torch.export.exported_program import (_override_composite_implicit_decomp,
                                           _split_decomp_table_to_cia_and_python_decomp)
from torch._export.utils import _special_op_to_preserve_cia
from torch.utils import _pytree as pytree

_COPIED_META = ("custom", "nn_module_stack", "stack_trace")


class Tables:
    """The decomposition table split as run_decompositions splits it: CompositeImplicitAutograd
    ops with their decomposition or a marker to preserve them (`cia`), the others (`python`)."""

    def __init__(self, table: dict) -> None:
        full = table.materialize() if hasattr(table, "materialize") else dict(table)
        self.cia, self.python = _split_decomp_table_to_cia_and_python_decomp(dict(full))

    def decomposes(self, target: Any) -> bool:
        """Whether the retrace would replace a node of `target` by other ops."""
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if target in self.cia:
            return self.cia[target] is not _special_op_to_preserve_cia
        return target in self.python or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), torch._C.DispatchKey.CompositeImplicitAutograd)

    def context(self, fake_mode: Any) -> contextlib.ExitStack:
        """The dispatch state of run_decompositions' retrace."""
        stack = contextlib.ExitStack()
        stack.enter_context(_ignore_backend_decomps())
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(_override_composite_implicit_decomp(self.cia))
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(torch.no_grad())  # below autograd, as the retrace: no saved-tensor detaches
        return stack


def _is_functional(graph: fx.Graph) -> bool:
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return False
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            return False
    return True


def _signature(node: fx.Node) -> tuple[list[Any], Any, list[int], str]:
    """(flat arguments, their tree spec, positions of the tensor arguments, a cache key)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]
    described = list(leaves)
    for i in tensors:
        v = leaves[i].meta["val"]
        described[i] = ("tensor", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device), v.requires_grad)
    return leaves, spec, tensors, repr((node.target, described, spec))


def _trace(node: fx.Node, python: dict, leaves: list[Any], spec: Any, tensors: list[int]) -> fx.GraphModule:
    def call(*xs: torch.Tensor) -> Any:
        flat = list(leaves)
        for i, x in zip(tensors, xs):
            flat[i] = x
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return node.target(*args, **kwargs)

    return make_fx(call, decomposition_table=python)(*(leaves[i].meta["val"] for i in tensors))


def _splice(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, args: list[fx.Node]) -> None:
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(node):
        out = gm.graph.graph_copy(sub.graph, dict(zip(placeholders, args)))
    _copy_place(node, out)
    if isinstance(out, (tuple, list)):
        for user in list(node.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(out[user.args[1]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _copy_place(node: fx.Node, out: Any) -> None:
    """The decomposed node's place (module path, source line) on every node it became."""
    seen: set[fx.Node] = set()
    stack = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, fx.Node)]
    while stack:
        new = stack.pop()
        if new in seen or new is node or new.op == "placeholder" or new in node.all_input_nodes:
            continue
        seen.add(new)
        new.meta.update({k: node.meta[k] for k in _COPIED_META if k in node.meta})
        stack.extend(new.all_input_nodes)


def _fill_values(gm: fx.GraphModule) -> None:
    """meta["val"] for nodes added after export (planner.decompose's cross-entropy), from
    their inputs' values, under the export's fake mode."""
    value = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            args, kwargs = pytree.tree_map(value, (node.args, node.kwargs))
            node.meta["val"] = node.target(*args, **kwargs)


def decompose_locally(gm: fx.GraphModule, table: dict) -> bool:
    """Decompose every node of a functional `gm` that the retrace would decompose, one
    signature at a time; False (graph untouched) when the whole-program retrace is needed."""
    if not _is_functional(gm.graph):
        return False
    tables = Tables(table)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    traced: dict[str, fx.GraphModule] = {}
    work: list[tuple[fx.Node, str]] = []
    with tables.context(fake_mode):
        _fill_values(gm)
        for node in gm.graph.nodes:
            if node.op != "call_function" or not tables.decomposes(node.target):
                continue
            leaves, spec, tensors, key = _signature(node)
            if key not in traced:
                traced[key] = _trace(node, tables.python, leaves, spec, tensors)
                if not _is_functional(traced[key].graph):
                    return False
            work.append((node, key))
    for node, key in work:  # the arguments as they are now: earlier splices replaced some
        leaves = pytree.tree_leaves((node.args, node.kwargs))
        _splice(gm, node, traced[key], [a for a in leaves if isinstance(a, fx.Node)])
    gm.recompile()
    return True


__all__ = ["Tables", "decompose_locally"]
