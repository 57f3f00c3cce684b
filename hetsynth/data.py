"""Each rank's rows of every global batch: `hetsynth.data.loader(dataset, plan)`.

Under a plan with global batch size B, rank r reads, of forward input i, the rows R_i(r) of
each global batch (runtime.input_rows: uneven shares, possibly none, whole batches of
replicated inputs), and of the dataset only the items of those rows:

    for tokens, targets in hetsynth.data.loader(dataset, plan, shuffle=True, seed=0):
        loss = module(tokens, targets)          # module = hetsynth.parallelize(model, plan)

The global batches are those of `DataLoader(dataset, batch_size=B, shuffle=shuffle,
drop_last=True, generator=torch.Generator().manual_seed(seed))` on its first pass; after
`loader.set_epoch(e)` those of `manual_seed(seed + e)` (as DistributedSampler, the order
changes only with set_epoch; epoch 0 is the plain DataLoader's). Each batch is a list of
tensors, one per forward input in forward order, input i holding the rows R_i(r) in
increasing order (0 rows for an input the rank does not read). Semantics and checks:
runtime.data_loader.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from hetsynth.instruction_set.plan import Plan
from hetsynth.runtime.data_loader import Collate, RankLoader, input_specs, rank_loader
from hetsynth.runtime.input_rows import input_rows


def loader(dataset: Dataset, plan: Plan, *, shuffle: bool = False, seed: int = 0, collate_fn: Collate | None = None,
           num_workers: int = 0, rank: int | None = None, pin_memory: bool = False) -> RankLoader:
    """A torch DataLoader yielding rank `rank`'s rows of each global batch of `plan` (module
    docstring), reading only those items of the map-style `dataset`. `collate_fn` (default
    `default_collate`) must turn a list of items into the forward's inputs: a tuple or list of
    tensors, one per input, or one tensor for a one-input plan; rows beyond dim 0 and dtypes
    must be the plan's. `rank` defaults to $RANK, else the process group's rank, else 0.
    len(loader) is the number of global batches, len(dataset) // B."""
    rank = default_rank() if rank is None else rank
    world = plan.cluster.num_devices
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank}: the plan has {world} ranks (0..{world - 1})")
    return rank_loader(dataset, plan.model.batch_size, input_rows(plan, rank), input_specs(plan),
                       shuffle=shuffle, seed=seed, collate_fn=collate_fn or default_collate,
                       num_workers=num_workers, pin_memory=pin_memory)


def default_rank() -> int:
    """$RANK, else the default process group's rank when one is initialised, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = ["loader", "default_rank"]
