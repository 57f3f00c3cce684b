"""Convolutions and pooling over [N, C, H, W] tensors.

conv2d(x[N,C,H,W], w[O,C/g,kh,kw], b[O]):
  batch split    x S0, w R,  b R  -> S0
  channel-parallel (output channels, groups == 1)  x R, w S0, b S0 -> S1
  input-channel split (groups == 1)  x S1, w S1, b R -> P, bias added once
  x P, w R, b R -> P, bias added once (conv is linear in x)
Pooling acts per (sample, channel) plane: S0 and S1 pass through; average pools are linear (P).
"""

from __future__ import annotations

from instruction_set.graph import Node, TensorMeta
from instruction_set.layouts import P, R, S
from instruction_set.rules import Rule, arg, register


def _conv(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    has_bias = len(metas) == 3
    once = "once:2" if has_bias else ""
    b = (lambda lay: (lay,) if has_bias else ())
    rules = [Rule((R, R) + b(R), R), Rule((P, R) + b(R), P, once)]
    if metas[0].shape[0] > 1:
        rules.append(Rule((S(0), R) + b(R), S(0)))
    if arg(node, 6, "groups", 1) == 1:
        if metas[1].shape[0] > 1:
            rules.append(Rule((R, S(0)) + b(S(0)), S(1)))
        if metas[1].shape[1] > 1:
            rules.append(Rule((S(1), S(1)) + b(R), P, once))
    return rules


def _pool(linear: bool):
    def rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
        out = [Rule((R,), R)] + [Rule((S(d),), S(d)) for d in (0, 1) if metas[0].shape[d] > 1]
        return out + ([Rule((P,), P)] if linear else [])

    return rules


register(["aten.conv2d.default", "aten.conv1d.default"], _conv)
register(["aten.max_pool2d.default"], _pool(linear=False))
register(["aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default"], _pool(linear=True))
