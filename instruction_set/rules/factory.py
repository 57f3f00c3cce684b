"""Ops computed replicated only: tensor factories (arange, zeros, full, new_*) and advanced
indexing. They build small constants (positions, masks) that every rank computes in full;
their consumers shard them where needed (expand may shard a broadcast dim, slice takes a
shard of a replicated tensor for free).
"""

from __future__ import annotations

from instruction_set.rules import register, replicated

FACTORIES_SHAPE0 = ["aten.zeros.default", "aten.ones.default", "aten.empty.memory_format",
                    "aten.full.default"]
FACTORIES_SHAPE1 = ["aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default",
                    "aten.new_full.default"]
OTHERS = ["aten.arange.default", "aten.arange.start", "aten.arange.start_step",
          "aten.scalar_tensor.default", "aten.index.Tensor", "aten.tril.default",
          "aten.triu.default", "aten.masked_select.default", "aten.diff.default",
          "aten.all.default", "aten.any.default", "aten.item.default"]

register(FACTORIES_SHAPE0 + FACTORIES_SHAPE1 + OTHERS, replicated)
