"""Capture by block: the reference graph of a model of N identical blocks, assembled from the
graphs of the same model cut to 2 and 3 blocks (checked against 4), instead of tracing all N.

Blocks. `repeated_list(model)` finds the `ModuleList` / `Sequential` whose N >= MIN_BLOCKS
children are all of one class with the same parameter and buffer names, shapes, dtypes and
requires_grad (the largest such list). `truncated(lst, k)` hides all but its first k children
while the model is traced, so that a forward that loops over the list (`for block in
self.blocks`, HuggingFace's `self.layers[:num_hidden_layers]`) runs k blocks.

Layout. In the graph G_k of k blocks, a node belongs to block j when its parameter's fqn or
its op's module path lies under `<list>.<j>`, else it is outer. Reading the nodes in order,
the graph must be `O_0 S_1 O_1 ... S_m O_m`: outer runs O_i (possibly empty) and sweeps S_i,
each the runs of blocks 0, 1, ..., k-1 in that order, of one length per sweep (the block's
parameters, then later its ops). G_2 and G_3 must have the same outer runs and sweep lengths.

Assembly of G_N. Node (sweep s, block j, position p) is a copy of G_3's node (s, t, p), with
t = 0 for the first block, 2 for the last and 1 for every other: its FLOPs, shapes, arguments
and source line as traced; references to block t + d become block j + d, to outer nodes stay;
fqn and module path say `<list>.<j>`, and what it saves for backward (cost_models.saved_tensors)
is the template's. Outer nodes are G_3's, their references to the first and last block kept
there. Names follow torch.fx's counters: a call node is `base` or `base_i`, and the counter
of a role is affine in (j, k), i = a + b*j + c*k (every naming pass visits the blocks in order
and each block adds the same names), learned from G_2 and G_3; a parameter's name is its
fqn's, with the block index replaced.

Soundness. The method is checked, not assumed: G_4 is assembled the same way and must equal
the traced G_4 node for node (names, arguments, shapes, FLOPs, saved tensors, fqns, module
paths); any difference, any layout that does not fit, or any trace that fails raises
NotReplicable and the caller captures the whole model. What the check cannot see is a forward
whose behaviour changes only beyond four blocks (a branch on `len(self.blocks) > 4`); such a
model is outside what this covers. Only the list's first 2, 3 and 4 blocks are traced; models
with fewer than MIN_BLOCKS blocks are captured whole.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch import nn

from hetsynth.instruction_set.graph import Node, ReferenceGraph

# Three traces cost 3 o + 9 b against o + N b for the whole model (o: an export's fixed cost,
# b: a block's); on the Llama-8B shape o ~ 0.6 s and b ~ 0.25 s of CPU, so it pays from N ~ 14.
MIN_BLOCKS = 16
TRACED = (2, 3, 4)  # learned from the first two, checked on the third


class NotReplicable(ValueError):
    """The model's graph cannot be assembled from its blocks; the message says why."""


def _signature(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return type(module), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors)


def repeated_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, list) of the list of >= MIN_BLOCKS identical blocks with the most parameters
    (blocks without parameters are not worth it), or None."""
    best: tuple[int, str, nn.Module] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_BLOCKS or not path:
            continue
        children = list(module.children())
        if len(children) != len(module) or len({_signature(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, path, module)
    return (best[1], best[2]) if best else None


@contextmanager
def truncated(blocks: nn.Module, k: int) -> Iterator[None]:
    """`blocks` holds only its first k children inside the block."""
    kept = blocks._modules
    blocks._modules = OrderedDict(list(kept.items())[:k])
    try:
        yield
    finally:
        blocks._modules = kept


Role = tuple  # ("outer", s, p) or ("block", s, j, p)


def _block_of(node: Node, path: str, k: int) -> int | None:
    where = node.fqn if node.op != "call" else node.module_path
    for j in range(k):
        head = f"{path}.{j}"
        if where == head or where.startswith(head + "."):
            return j
    return None


def _layout(graph: ReferenceGraph, path: str, k: int) -> tuple[list[Role], list[tuple[int, ...]]]:
    """Each node's role, and the layout: per sweep (outer run before it, block length), then
    (outer run after the last sweep,)."""
    roles: list[Role] = []
    runs: list[int] = [0]  # outer run lengths
    sizes: list[dict[int, int]] = []  # per sweep: block -> nodes
    j = -1  # the block being read, -1 between sweeps
    for node in graph.nodes:
        b = _block_of(node, path, k)
        if b is None and 0 <= j < k - 1 or b is not None and b not in (j, j + 1) and not (b == 0 and j == k - 1):
            raise NotReplicable(f"{node.name} ({'outside ' + path if b is None else f'block {b}'}) follows "
                                f"block {j} of {k}: the blocks are not consecutive")
        if b is None:
            roles.append(("outer", len(sizes), runs[-1]))
            runs[-1] += 1
            j = -1
            continue
        if b == 0 and j != 0:
            sizes.append({})
            runs.append(0)
        j = b
        roles.append(("block", len(sizes), b, sizes[-1].get(b, 0)))
        sizes[-1][b] = sizes[-1].get(b, 0) + 1
    for s, sweep in enumerate(sizes, 1):
        if sorted(sweep) != list(range(k)) or len(set(sweep.values())) != 1:
            raise NotReplicable(f"sweep {s} over {path} has blocks of unequal sizes {sweep} (of {k} blocks)")
    layout = [(runs[s], sizes[s][0]) for s in range(len(sizes))] + [(runs[-1],)]
    return roles, layout


_COUNTER = re.compile(r"^(.*)_(\d+)$")


def _split(name: str) -> tuple[str, int]:
    """'view_8' -> ('view', 8); 'view' -> ('view', 0); 'inputs_0' -> ('inputs', 0)."""
    m = _COUNTER.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _join(base: str, index: int, bare_zero: bool) -> str:
    """torch.fx's name for counter `index` of `base`: the first is `base` itself, unless the
    role was only ever seen with an explicit counter (an argument named `inputs_0`)."""
    return base if index == 0 and bare_zero else f"{base}_{index}"


@dataclass(frozen=True)
class _Trace:
    graph: ReferenceGraph
    k: int
    roles: list[Role]

    def named(self) -> dict[Role, Node]:
        return dict(zip(self.roles, self.graph.nodes))


def _key(role: Role) -> Role:
    """A role without its block index: the same node of every block."""
    return (role[1], role[3]) if role[0] == "block" else ("outer", role[1], role[2])


def _namer(t2: _Trace, t3: _Trace, path: str) -> Callable[[Role, int, Node], str]:
    """name(role, N, template node): the node's name in G_N (module docstring)."""
    n2, n3 = t2.named(), t3.named()
    coeffs: dict[Role, tuple[str, int, int, int, bool]] = {}
    for role, node in n2.items():
        if role[0] == "outer":
            seen = (node.name, n3[role].name)
            (b2, i2), (b3, i3) = map(_split, seen)
            if b2 != b3:
                raise NotReplicable(f"outer node {node.name} is {n3[role].name} with 3 blocks")
            coeffs[_key(role)] = (b2, i2 - 2 * (i3 - i2), 0, i3 - i2, any(_split(n)[0] == n for n in seen))
        elif role[2] == 0 and node.op == "call":
            seen = (node.name, n2[("block", role[1], 1, role[3])].name, n3[role].name)
            (b0, i0), (b1, i1), (b3, i3) = map(_split, seen)
            if not b0 == b1 == b3:
                raise NotReplicable(f"block node {node.name} has other names in other blocks")
            coeffs[_key(role)] = (b0, i0 - 2 * (i3 - i0), i1 - i0, i3 - i0, any(_split(n)[0] == n for n in seen))
    us = path.replace(".", "_")

    def name(role: Role, num: int, template: Node) -> str:
        if role[0] == "block" and template.op != "call":
            old = f"_{us}_{_block_of(template, path, 4)}_"
            if template.name.count(old) != 1:
                raise NotReplicable(f"parameter node {template.name} does not name its block as {old!r}")
            return template.name.replace(old, f"_{us}_{role[2]}_")
        base, a, b, c, bare_zero = coeffs[_key(role)]
        return _join(base, a + b * (role[2] if role[0] == "block" else 0) + c * num, bare_zero)

    return name


def _retarget(role: Role, src: Role, num: int, k: int) -> Role:
    """The G_N role that node `role`'s reference to G_k's `src` names."""
    if src[0] == "outer":
        return src
    if role[0] == "block":
        t = _template_block(role[2], num)
        j = role[2] + src[2] - t
    elif src[2] in (0, k - 1):
        j = 0 if src[2] == 0 else num - 1
    else:
        raise NotReplicable(f"an outer node reads block {src[2]} of {k}, neither the first nor the last")
    if not 0 <= j < num:
        raise NotReplicable(f"block {role} reads block {j} of {num}")
    return ("block", src[1], j, src[3])


def _template_block(j: int, num: int) -> int:
    return 0 if j == 0 else (2 if j == num - 1 else 1)


def _roles(layout: list[tuple[int, ...]], num: int) -> list[Role]:
    out: list[Role] = []
    for s, sweep in enumerate(layout):
        out += [("outer", s, p) for p in range(sweep[0])]
        if len(sweep) == 2:
            out += [("block", s + 1, j, p) for j in range(num) for p in range(sweep[1])]
    return out


def _rename_refs(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: (names[v] if k == "ref" else _rename_refs(v, names)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rename_refs(v, names) for v in value)
    return value


def assemble(t2: _Trace, t3: _Trace, layout: list[tuple[int, ...]], path: str, num: int) -> ReferenceGraph:
    """G_N from the traces of 2 and 3 blocks (module docstring)."""
    name = _namer(t2, t3, path)
    n3 = t3.named()
    role_of3 = {node.name: role for role, node in n3.items()}
    nodes = []
    for role in _roles(layout, num):
        src = n3[role if role[0] == "outer" else ("block", role[1], _template_block(role[2], num), role[3])]
        names = {}
        for ref in src.inputs + tuple(_refs(src.args) + _refs(src.kwargs)):
            target = _retarget(role, role_of3[ref], num, 3)
            names[ref] = name(target, num, n3[_source_role(target, num)])
        nodes.append(_moved(src, name(role, num, src), names, path, role, num))
    loss_role = _retarget(("outer", 0, 0), role_of3[t3.graph.loss], num, 3)
    loss = name(loss_role, num, n3[_source_role(loss_role, num)])
    return t3.graph.model_copy(update={"nodes": tuple(nodes), "loss": loss})


def _source_role(role: Role, num: int) -> Role:
    return role if role[0] == "outer" else ("block", role[1], _template_block(role[2], num), role[3])


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [value["ref"]] if "ref" in value else [r for v in value.values() for r in _refs(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    return []


def _moved(src: Node, new_name: str, names: dict[str, str], path: str, role: Role, num: int) -> Node:
    update: dict[str, Any] = {"name": new_name,
                              "inputs": tuple(names[i] for i in src.inputs),
                              "args": _rename_refs(src.args, names), "kwargs": _rename_refs(src.kwargs, names)}
    if role[0] == "block":
        old, new = f"{path}.{_template_block(role[2], num)}", f"{path}.{role[2]}"
        for field in ("fqn", "module_path"):
            value = getattr(src, field)
            if value == old or value.startswith(old + "."):
                update[field] = new + value[len(old):]
    return src.model_copy(update=update)


def by_blocks(trace: Callable[[int], ReferenceGraph], path: str, num: int) -> ReferenceGraph:
    """The graph of `num` blocks from `trace(k)`, the graph of the model cut to k blocks
    (module docstring); NotReplicable when the check on 4 blocks fails."""
    traces = []
    for k in TRACED:
        graph = trace(k)
        roles, layout = _layout(graph, path, k)
        traces.append((_Trace(graph, k, roles), layout))
    (t2, l2), (t3, l3), (t4, l4) = traces
    if not l2 == l3 == l4:
        raise NotReplicable(f"the layout of {path} changes with the number of blocks: {l2} / {l3} / {l4}")
    try:
        check = assemble(t2, t3, l3, path, 4)
    except KeyError as err:  # a reference or a name role that the layout does not give
        raise NotReplicable(f"{path}: no role for {err} when assembling 4 blocks") from None
    if check.model_dump() != t4.graph.model_dump():
        first = next((a.name for a, b in zip(check.nodes, t4.graph.nodes) if a != b), "the graph's fields")
        raise NotReplicable(f"4 blocks of {path} assembled from 2 and 3 differ from the traced ones at {first}")
    return assemble(t2, t3, l3, path, num)


__all__ = ["MIN_BLOCKS", "NotReplicable", "assemble", "by_blocks", "repeated_list", "truncated"]
