"""Convolutions and the ops that act per (sample, channel) plane: pooling, upsampling,
padding, grid sampling, FFTs.

convolution(x[N, C, *S], w, b[O], stride, padding, dilation, transposed, output_padding,
groups), w[O, C/g, *k] (transposed: w[C, O/g, *k]):
  batch split         x S0, w R, b R -> S0
  linear in x         x P, w R, b R -> P, bias added once
  output channels     groups == 1: w S0 (transposed: S1), b S0, x R -> S1
                      depthwise (C == groups, not transposed): x S1, w S0, b S0 -> S1 (every
                      input channel is a group, so a shard holds whole groups; the rank-local
                      convolution takes groups = its channels, instruction_set.local)
  input channels      groups == 1: x S1, w S1 (transposed: S0), b R -> P, bias added once
Plane ops (max / average / adaptive pooling, upsampling, reflection and replication padding)
act on the trailing spatial dims: every leading dim shards; the linear ones (average pools,
upsampling, padding by copying) keep P. grid_sampler_2d: input and grid split by batch, or
input split by channel with the grid R; linear in the input. FFTs shard the dims they do not
transform and are linear.
"""

from __future__ import annotations

from hetsynth.instruction_set.graph import Node, TensorMeta
from hetsynth.instruction_set.layouts import P, R, S
from hetsynth.instruction_set.rules.registry import Rule, arg, register


def _conv(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    has_bias = len(metas) == 3
    once = "once:2" if has_bias else ""
    b = (lambda lay: (lay,) if has_bias else ())
    x, w = metas[0], metas[1]
    transposed, groups = bool(arg(node, 6, "transposed", False)), arg(node, 8, "groups", 1)
    rules = [Rule((R, R) + b(R), R), Rule((P, R) + b(R), P, once)]
    if x.shape[0] > 1:
        rules.append(Rule((S(0), R) + b(R), S(0)))
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    if groups == 1 and w.shape[out_dim] > 1:
        rules.append(Rule((R, S(out_dim)) + b(S(0)), S(1)))
    if groups == 1 and w.shape[in_dim] > 1:
        rules.append(Rule((S(1), S(in_dim)) + b(R), P, once))
    if groups > 1 and not transposed and x.shape[1] == groups:
        rules.append(Rule((S(1), S(0)) + b(S(0)), S(1)))
    return rules


def _plane(spatial_of, linear: bool):
    """Rules of an op acting on the last `spatial_of(node)` dims of its first input."""

    def rules(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
        shape = metas[0].shape
        lead = len(shape) - spatial_of(node)
        rest = (R,) * (len(metas) - 1)
        out = [Rule((R,) + rest, R)] + [Rule((S(d),) + rest, S(d)) for d in range(lead) if shape[d] > 1]
        return out + ([Rule((P,) + rest, P)] if linear else [])

    return rules


def _spatial(count: int):
    return lambda node: count


def _pad_spatial(node: Node) -> int:
    return len(arg(node, 1, "padding")) // 2


def _grid_sample(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    x, grid = metas
    rules = [Rule((R, R), R), Rule((P, R), P)]
    if x.shape[0] > 1:
        rules.append(Rule((S(0), S(0)), S(0)))
    if x.shape[1] > 1:
        rules.append(Rule((S(1), R), S(1)))
    return rules


def _fft(node: Node, metas: tuple[TensorMeta, ...]) -> list[Rule]:
    shape = metas[0].shape
    dims = {d % len(shape) for d in arg(node, 1, "dim")}
    rules = [Rule((R,), R), Rule((P,), P)]
    return rules + [Rule((S(d),), S(d)) for d, s in enumerate(shape) if d not in dims and s > 1]


PLANE_OPS: list[str] = []
register(["aten.convolution.default"], _conv)
for _n, _linear, _ops in [
    (1, False, ["aten.max_pool1d.default"]),
    (2, False, ["aten.max_pool2d.default", "aten.max_pool2d_with_indices.default"]),
    (3, False, ["aten.max_pool3d_with_indices.default"]),
    (1, True, ["aten.avg_pool1d.default", "aten.adaptive_avg_pool1d.default"]),
    (2, True, ["aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default",
               "aten._adaptive_avg_pool2d.default", "aten.upsample_nearest2d.vec",
               "aten.upsample_bilinear2d.vec"]),
    (3, True, ["aten.avg_pool3d.default", "aten._adaptive_avg_pool3d.default"]),
]:
    register(_ops, _plane(_spatial(_n), _linear))
    PLANE_OPS += _ops
_PADS = ["aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default",
         "aten.replication_pad1d.default", "aten.replication_pad2d.default", "aten.replication_pad3d.default"]
register(_PADS, _plane(_pad_spatial, linear=True))
PLANE_OPS += _PADS
register(["aten.grid_sampler_2d.default"], _grid_sample)
register(["aten._fft_r2c.default", "aten._fft_c2r.default", "aten._fft_c2c.default"], _fft)
