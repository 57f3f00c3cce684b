"""Collectives of the distributed instruction set, as autograd functions with adjoint
backward passes, for uneven and zero-length shards, on explicit process groups.
One module per family: gather (all-gather), scatter (reduce-scatter), allreduce, alltoall,
local (slice, partial)."""

from hetsynth.runtime.collectives.adjoint import all_gather, reduce_scatter
from hetsynth.runtime.collectives.allreduce import all_reduce, all_reduce_max
from hetsynth.runtime.collectives.alltoall import all_to_all
from hetsynth.runtime.collectives.local import partial, slice_rows
from hetsynth.runtime.collectives.registry import COLLECTIVE_VARIANTS
from hetsynth.runtime.collectives.span import Span

__all__ = ["COLLECTIVE_VARIANTS", "Span", "all_gather", "all_reduce", "all_reduce_max", "all_to_all", "partial",
           "reduce_scatter", "slice_rows"]
