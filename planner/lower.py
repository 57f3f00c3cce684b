"""Lower an exported program to hetsynth's op surface.

`torch.export` (non-strict, training IR) keeps composite ops, in-place ops and higher-order
ops. `lower` turns its graph into a bounded, documented op set that every sharding rule is
written against (instruction_set.rules):

1. **Higher-order ops.** A `wrap_with_set_grad_enabled(enabled, body, *args)` region (a
   `torch.no_grad()` block, such as a rotary embedding's) is inlined with its body's own
   nodes; when gradients were disabled its outputs go through `aten.detach`, so they do not
   require grad, as in the eager model. Other higher-order ops are left to
   `run_decompositions` (which inlines the ones it can, such as autocast regions).
2. **Where every node comes from.** Each node's module path and source line are kept in
   `node.meta["custom"]`, which torch's retrace copies to the nodes it decomposes a node
   into; a higher-order op's place is the first place found in its body.
3. **Cross-entropy** is decomposed into primitives (planner.decompose) before the retrace,
   so that its other forms (class weights, label smoothing) are lowered by torch instead.
4. **Decompositions.** `ExportedProgram.run_decompositions(TABLE)` with `TABLE` = torch's
   core ATen decompositions (`torch.export.default_decompositions()`) minus `KEEP`, the
   composites that have a sharding rule and an exact FLOP count whole. The retrace is
   functional: in-place ops become out-of-place ops, and the new value of a buffer the
   forward mutates (BatchNorm statistics, counters) becomes a BUFFER_MUTATION output.
   A graph that is functional already is decomposed node by node instead, with the same
   result in a fraction of the time (planner.decompose_local).
5. **Normalisations** that torch keeps as fused ops (batch norm's functional form, group norm)
   are decomposed into primitives (planner.decompose_norm), so that a batch-split batch norm
   reduces its statistics across the batch group like SyncBatchNorm, as collectives the
   planner chooses and costs.
6. **Constants.** A tensor the forward makes from Python values (`x[..., [-2]]`) is a
   CONSTANT_TENSOR input; planner.capture keeps its value in the graph.
7. **Buffer updates.** Every BUFFER_MUTATION output becomes a node `aten.copy_(buffer, new)`
   placed right after the new value is computed (and after the last read of the old one).
   A forward that mutates its inputs or parameters is refused.

The result is the op surface: the core ATen opset (ops tagged `torch.Tag.core`), `KEEP`,
`aten.detach` and the buffer update `aten.copy_`; `instruction_set.rules.surface` lists how
each is sharded or why it is replicated-only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
import torch
from torch import fx

from hetsynth.planner.decompose import decompose_cross_entropy, strip_noops
from hetsynth.planner.decompose_local import decompose_locally
from hetsynth.planner.decompose_norm import decompose_norms

aten = torch.ops.aten
HOP = torch._ops.HigherOrderOperator

# Composites kept whole: each has a sharding rule and FlopCounterMode counts it exactly.
KEEP = {
    aten.linear.default: "contraction rule (column/row parallel); matmul FLOPs",
    aten.layer_norm.default: "normalised dims stay local, leading dims shard",
    aten.rms_norm.default: "as layer_norm",
    aten.scaled_dot_product_attention.default: "batch and (grouped) head parallel; attention FLOPs",
    aten.einsum.default: "contraction in index notation: expert- and head-parallel forms stay one op",
    aten.cross_entropy_loss.default: "decomposed by planner.decompose when its form allows",
    aten.detach.default: "marks values without gradient (no_grad regions, detach())",
}

BUFFER_UPDATE = aten.copy_.default
_CUSTOM_KEY = "hetsynth_place"
_TORCH_DIR = str(Path(torch.__file__).parent)


class LoweringError(ValueError):
    """The exported program cannot be lowered (a mutated input or parameter)."""


@dataclass
class Lowered:
    graph_module: fx.GraphModule
    kinds: dict[str, tuple[str, str]]  # placeholder name -> (param | buffer | input | const, fqn)
    constants: dict[str, torch.Tensor]  # const placeholder name -> its value
    outputs: list[str]  # names of the forward's user outputs (one scalar loss, checked by capture)


def decomposition_table() -> dict:
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    return table


# -- where nodes come from ----------------------------------------------------------------------

def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def source_line(node: fx.Node) -> str:
    """'file.py:12  code' of the innermost frame outside torch (and outside generated code,
    '<eval_with_key>') in the node's stack trace."""
    lines = (node.meta.get("stack_trace") or "").rstrip().split("\n")
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "') and not line[6:].startswith((_TORCH_DIR, "<")):
            path, _, rest = line[6:].partition('", line ')
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{path}:{rest.split(',')[0]}  {code}"
    return ""


def place(node: fx.Node) -> tuple[str, str]:
    """(module path, source line) of a node, as stashed before the retrace."""
    stashed = (node.meta.get("custom") or {}).get(_CUSTOM_KEY)
    return tuple(stashed) if stashed else (module_path(node), source_line(node))  # type: ignore[return-value]


def _bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    return [getattr(gm, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
            and isinstance(getattr(gm, a.target, None), fx.GraphModule)]


def _stash_places(gm: fx.GraphModule) -> tuple[str, str]:
    """Stash every node's place (recursively in bodies); returns the first place found."""
    first = ("", "")
    for node in gm.graph.nodes:
        mine = (module_path(node), source_line(node))
        if isinstance(node.target, HOP):
            inner = [_stash_places(body) for body in _bodies(gm, node)]
            found = next((p for p in inner if p[1]), ("", ""))
            mine = (mine[0] or found[0], mine[1] or found[1])
        if node.op == "call_function":
            node.meta.setdefault("custom", {})[_CUSTOM_KEY] = list(mine)
            first = first if first[1] else mine
    return first


# -- no_grad regions ----------------------------------------------------------------------------

def _inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline every wrap_with_set_grad_enabled region; detach a no-grad region's outputs."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled:
            continue
        enabled, body_attr, *args = node.args
        body = getattr(gm, body_attr.target)
        _inline_grad_regions(body)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(node):
            outs = gm.graph.graph_copy(body.graph, dict(zip(placeholders, args)))
            outs = [outs] if not isinstance(outs, (tuple, list)) else list(outs)
            if not enabled:
                outs = [gm.graph.call_function(aten.detach.default, (o,)) if isinstance(o, fx.Node) else o
                        for o in outs]
        for user in list(node.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not body_attr.users:
            gm.graph.erase_node(body_attr)
    gm.recompile()


# -- mutations ------------------------------------------------------------------------------------

def _placeholder_kinds(ep: torch.export.ExportedProgram) -> dict[str, tuple[str, str]]:
    kinds = {"PARAMETER": "param", "BUFFER": "buffer", "USER_INPUT": "input", "CONSTANT_TENSOR": "const"}
    out = {}
    for spec in ep.graph_signature.input_specs:
        kind = kinds.get(spec.kind.name)
        if kind is None:
            raise LoweringError(
                f"graph input {spec.arg.name!r} is a {spec.kind.name.lower()} ({spec.target}); "
                "create tensors in __init__ and register them as buffers instead of in forward")
        out[spec.arg.name] = (kind, spec.target or "")
    return out


def _merge_tied(ep: torch.export.ExportedProgram, gm: fx.GraphModule, kinds: dict[str, tuple[str, str]]) -> None:
    """One placeholder per tensor: export lifts a tied weight (an embedding shared with the
    output projection) once per name, which would train two copies."""
    first: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        kind, fqn = kinds.get(node.name, ("", ""))
        value = ep.state_dict.get(fqn) if kind in ("param", "buffer") else None
        if value is None:
            continue
        keep = first.setdefault(id(value), node)
        if keep is not node:
            node.replace_all_uses_with(keep)
            gm.graph.erase_node(node)
            del kinds[node.name]


def _buffer_updates(ep: torch.export.ExportedProgram) -> tuple[dict[fx.Node, str], list[str]]:
    """({new value node: buffer fqn}, user output names) from the output specs, matched by
    position with the output node's values (graph rewrites may have replaced them)."""
    output = next(n for n in reversed(ep.graph_module.graph.nodes) if n.op == "output")
    updates, losses = {}, []
    for spec, value in zip(ep.graph_signature.output_specs, output.args[0], strict=True):
        kind = spec.kind.name
        if kind == "BUFFER_MUTATION":
            updates[value] = spec.target
        elif kind == "USER_OUTPUT":
            losses.append(value.name if isinstance(value, fx.Node) else str(value))
        else:
            raise LoweringError(f"the forward mutates {spec.target or spec.arg.name!r} in place "
                                f"({kind.lower()}); only buffers may be updated by the forward, "
                                "copy the tensor before changing it")
    return updates, losses


def _insert_updates(gm: fx.GraphModule, updates: dict[fx.Node, str], kinds: dict[str, tuple[str, str]]) -> None:
    """`copy_(buffer, new)` after the new value and after the last read of the buffer."""
    by_name = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    buffers = {fqn: by_name[name] for name, (kind, fqn) in kinds.items() if kind == "buffer"}
    for value, fqn in updates.items():
        buffer = buffers[fqn]
        after = max([value, *buffer.users], key=order.__getitem__)
        with gm.graph.inserting_after(after):
            update = gm.graph.call_function(BUFFER_UPDATE, (buffer, value))
        update.meta.update({k: value.meta[k] for k in ("custom", "nn_module_stack", "stack_trace")
                            if k in value.meta})
        order[update] = order[after] + 0.5


def lower(ep: torch.export.ExportedProgram, *, table: dict | None = None) -> Lowered:
    """The exported program lowered to the op surface (see the module docstring)."""
    gm = ep.graph_module
    _stash_places(gm)
    _inline_grad_regions(gm)
    strip_noops(gm)
    decompose_cross_entropy(gm)
    gm.recompile()
    table = decomposition_table() if table is None else table
    functional = all(spec.kind.name == "USER_OUTPUT" for spec in ep.graph_signature.output_specs)
    if not (functional and decompose_locally(gm, table)):
        ep = ep.run_decompositions(table)
        gm = ep.graph_module
    strip_noops(gm, dead_code=True)
    decompose_norms(gm)
    kinds = _placeholder_kinds(ep)
    _merge_tied(ep, gm, kinds)
    updates, outputs = _buffer_updates(ep)
    _insert_updates(gm, updates, kinds)
    gm.graph.lint()
    constants = {name: ep.constants[fqn] for name, (kind, fqn) in kinds.items() if kind == "const"}
    return Lowered(gm, kinds, constants=constants, outputs=outputs)


__all__ = ["BUFFER_UPDATE", "KEEP", "Lowered", "LoweringError", "decomposition_table", "lower",
           "module_path", "place", "source_line"]
