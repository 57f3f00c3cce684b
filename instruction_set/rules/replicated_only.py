"""Ops computed replicated only, each with the reason.

Every rank computes these in full on replicated inputs; their consumers shard the result
where needed (expand may shard a broadcast dim, a slice takes a shard of a replicated tensor
for free). They are part of the op surface (instruction_set.rules.surface), so a model using
them plans without `--allow-replicate-fallback`.
"""

from __future__ import annotations

from hetsynth.instruction_set.rules.registry import register, replicated

_FACTORY = "a tensor factory: it builds a (small) constant, the same on every rank"
_RANDOM = ("draws random values: drawn whole on every rank from the same generator state, "
           "so the ranks agree (they do not reproduce a single device's stream)")
_DATA_DEPENDENT = "positions depend on the values of an index or mask tensor"

REASONS: dict[str, str] = {
    "aten.zeros.default": _FACTORY, "aten.ones.default": _FACTORY,
    "aten.empty.memory_format": _FACTORY, "aten.empty_strided.default": _FACTORY,
    "aten.full.default": _FACTORY, "aten.new_zeros.default": _FACTORY,
    "aten.new_ones.default": _FACTORY, "aten.new_empty.default": _FACTORY,
    "aten.new_full.default": _FACTORY, "aten.arange.default": _FACTORY,
    "aten.arange.start": _FACTORY, "aten.arange.start_step": _FACTORY,
    "aten.scalar_tensor.default": _FACTORY, "aten.tril.default": _FACTORY,
    "aten.triu.default": _FACTORY,
    "aten.rand.default": _RANDOM, "aten.randn.default": _RANDOM, "aten.randperm.default": _RANDOM,
    "aten.index_put.default": _DATA_DEPENDENT, "aten.masked_scatter.default": _DATA_DEPENDENT,
    "aten.masked_select.default": _DATA_DEPENDENT + " (and the output's length too)",
    "aten.nonzero.default": _DATA_DEPENDENT + " (and the output's length too)",
    "aten._embedding_bag.default": _DATA_DEPENDENT + " (bags given by offsets)",
    "aten.item.default": "a Python scalar read from a tensor",
    "aten._local_scalar_dense.default": "a Python scalar read from a tensor",
    "aten.all.default": "a whole-tensor boolean reduction of a small mask",
    "aten.any.default": "a whole-tensor boolean reduction of a small mask",
    "aten.diff.default": "differences of neighbours along a dim (position bookkeeping)",
    "aten.as_strided.default": "an arbitrary strided view: no dim maps to a dim of its input",
    "aten.diagonal.default": "a strided view mixing two dims",
    "aten.col2im.default": "folds overlapping patches: an output element sums several inputs",
    "aten._cdist_forward.default": "all pairwise distances (rare in training graphs)",
    "aten._pdist_forward.default": "all pairwise distances (rare in training graphs)",
}

register(REASONS, replicated)
