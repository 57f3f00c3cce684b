"""Contractions in index notation: linear, addmm, mm, bmm, matmul, einsum.

Write the op as `out[O] = sum over contracted letters of prod_j in_j[I_j] (+ bias[Bi])`.
Its rules:

- all R -> R;
- a letter `c` kept in the output: every operand holding `c` is sharded on it, the others
  are R, the output is sharded on `c` (batch split, column-parallel linear, head-parallel
  projections, expert-parallel einsum); a bias holding `c` is sharded too;
- a contracted letter `c`: every operand holding `c` is sharded on it and the output is
  Partial (row-parallel linear, K-split); a bias is R and added once (`once:<i>`);
- multilinearity: one operand P and the others R gives P (bias once).

Linear is `x[...k], W[nk], b[n] -> out[...n]`; addmm is `bias, m1[mk], m2[kn] -> out[mn]`.
"""

from __future__ import annotations

import string

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, register


def contraction_rules(ops: list[str], out: str, sizes: dict[str, int],
                      bias: str | None = None) -> list[Rule]:
    """Rules with inputs ordered (ops..., bias) for the index strings given."""
    n = len(ops)
    tail = [R] if bias is not None else []
    once = f"once:{n}" if bias is not None else ""
    rules = [Rule((R,) * (n + len(tail)), R)]
    for c in sorted(set("".join(ops))):
        if sizes[c] <= 1:
            continue
        lay = [S(op.index(c)) if c in op else R for op in ops]
        if c in out:
            b = [S(bias.index(c)) if c in bias else R] if bias is not None else []
            rules.append(Rule(tuple(lay + b), S(out.index(c))))
        else:
            rules.append(Rule(tuple(lay + tail), P, once))
    for j in range(n):
        rules.append(Rule(tuple(P if i == j else R for i in range(n)) + tuple(tail), P, once))
    return rules


def _letters(n: int, skip: str = "") -> str:
    return "".join(c for c in string.ascii_lowercase if c not in skip)[:n]


def _sizes(ops: list[str], metas: tuple[TensorMeta, ...]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for op, m in zip(ops, metas):
        for c, s in zip(op, m.shape):
            sizes[c] = max(sizes.get(c, 1), s)
    return sizes


def _linear(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    nd = len(metas[0].shape)
    batch = _letters(nd - 1, "kn")
    ops = [batch + "k", "nk"]
    bias = "n" if len(metas) == 3 else None
    return contraction_rules(ops, batch + "n", _sizes(ops, metas), bias)


def _addmm(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    ops = ["mk", "kn"]
    bias = "mn"[2 - len(metas[0].shape):]
    rules = contraction_rules(ops, "mn", _sizes(ops, metas[1:]), bias)
    # registered inputs are (bias, m1, m2): move the bias layout first, fix `once` index
    return [Rule((r.inputs[2],) + r.inputs[:2], r.output, "once:0" if r.local else "")
            for r in rules]


def _mm(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    ops = ["mk", "kn"] if node.target == "aten.mm.default" else ["bmk", "bkn"]
    return contraction_rules(ops, ops[0][:-1] + "n", _sizes(ops, metas))


def _matmul(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    a, b = (len(m.shape) for m in metas)
    if a >= 2 and b == 2:
        batch = _letters(a - 2, "mkn")
        ops = [batch + "mk", "kn"]
    elif a == b >= 3 and metas[0].shape[:-2] == metas[1].shape[:-2]:
        batch = _letters(a - 2, "mkn")
        ops = [batch + "mk", batch + "kn"]
    else:
        return [Rule((R, R), R)]
    return contraction_rules(ops, batch + "mn", _sizes(ops, metas))


def parse_einsum(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """'gsec,gsm->egcm' -> (['gsec', 'gsm'], 'egcm'); expands '...' and implicit outputs."""
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    ops = lhs.split(",")
    used = set(lhs) - set(",.")
    spare = [c for c in string.ascii_letters if c not in used]
    width = max((nd - len(op.replace("...", "")) for op, nd in zip(ops, ndims) if "..." in op),
                default=0)
    ell = "".join(spare[:width])
    ops = [op.replace("...", ell[width - (nd - len(op.replace("...", ""))):])
           for op, nd in zip(ops, ndims)]
    if "->" not in equation:
        counts = {c: "".join(ops).count(c) for c in set("".join(ops))}
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return ops, rhs.replace("...", ell)


def _einsum(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    ops, out = parse_einsum(arg(node, 0, "equation"), [len(m.shape) for m in metas])
    if any(len(set(op)) != len(op) for op in ops):  # repeated letter in one operand (a trace)
        return [Rule((R,) * len(metas), R)]
    return contraction_rules(ops, out, _sizes(ops, metas))


register(["aten.linear.default"], _linear)
register(["aten.addmm.default"], _addmm)
register(["aten.mm.default", "aten.bmm.default"], _mm)
register(["aten.matmul.default"], _matmul)
register(["aten.einsum.default"], _einsum)
