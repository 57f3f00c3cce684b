"""A rank's rows of every global batch, read from a map-style dataset (behind hetsynth.data).

Global batches. For a dataset of N items, global batch size B (the plan's) and epoch e, the
order of the items is

    pi_e = identity                          without shuffle
    pi_e = torch.randperm(N, generator=g_e)  with shuffle, g_e = Generator().manual_seed(seed + e)
                                             after one int64 draw from g_e (see below)

and global batch b in [0, N // B) holds the items pi_e[b B + j] for j in [0, B): exactly the
batches of `DataLoader(dataset, batch_size=B, shuffle=shuffle, drop_last=True,
generator=Generator().manual_seed(seed + e))` on its first pass. (torch's DataLoader draws its
workers' base seed from its generator, `_BaseDataLoaderIter.__init__`, before the sampler's
randperm; `shuffled_order` makes the same draw.) As torch's DistributedSampler does, the order
changes only with `set_epoch`: two passes of one epoch read the same batches.

A rank's rows. Rank r reads, of forward input x_i, the rows R_i(r) of each global batch
(runtime.input_rows), and of the dataset only the items of the union U(r) = union_i R_i(r),
in increasing row order: U(r) = u_0 < u_1 < ... . The batch sampler yields, for batch b, the
indices [pi_e[b B + u_k] for k]; the collate turns those items into one batch with the user's
collate_fn (default `default_collate`), which must give the forward's n inputs: a list or tuple
of n tensors, or one tensor when n = 1. Input i is then cut to its rows: the positions k with
u_k in R_i(r), so the rank gets, for each input, a tensor of |R_i(r)| rows in increasing global
row order (0 rows, with the plan's trailing shape and dtype, for an input it does not read).
Every batch is checked against the plan: rows beyond dim 0 of the plan's shape and its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from hetsynth.instruction_set.plan import Plan
from hetsynth.runtime.input_rows import local_rows

Collate = Callable[[list[Any]], Any]
Pick = slice | torch.Tensor


@dataclass(frozen=True)
class InputSpec:
    """One forward input as the plan has it: its global shape (dim 0 = B) and dtype."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])


def input_specs(plan: Plan) -> list[InputSpec]:
    """The plan's forward inputs (the graph's `input` nodes), in forward order."""
    return [InputSpec(n.name, tuple(n.out.shape), getattr(torch, n.out.dtype))
            for n in plan.graph.nodes if n.op == "input"]


def shuffled_order(num_items: int, seed: int) -> list[int]:
    """The permutation torch's DataLoader(shuffle=True, generator=manual_seed(seed)) reads on
    its first pass: its iterator draws one int64 (the workers' base seed), then RandomSampler
    draws randperm(num_items) from the same generator."""
    generator = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return torch.randperm(num_items, generator=generator).tolist()


class RankBatchSampler(Sampler[list[int]]):
    """For each global batch b, the dataset indices of the rank's rows U (module docstring)."""

    def __init__(self, num_items: int, batch: int, union: Sequence[int], *, shuffle: bool, seed: int) -> None:
        self.num_items, self.batch, self.union = num_items, batch, list(union)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle as DistributedSampler does: epoch e draws from manual_seed(seed + e)."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """pi_e: the dataset's items in the order the global batches take them."""
        if not self.shuffle:
            return list(range(self.num_items))
        return shuffled_order(self.num_items, self.seed + self.epoch)

    def __len__(self) -> int:
        return self.num_items // self.batch

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for b in range(len(self)):
            yield [order[b * self.batch + u] for u in self.union]


def positions(union: Sequence[int], rows: Sequence[int]) -> Pick:
    """Where the global rows `rows` (sorted) sit in the rank's sorted `union`."""
    if not rows or rows[-1] - rows[0] == len(rows) - 1:
        picked = local_rows(union, range(rows[0], rows[-1] + 1) if rows else range(0))
    else:
        at = {r: k for k, r in enumerate(union)}
        picked = [at[r] for r in rows]
    return picked if isinstance(picked, slice) else torch.tensor(picked, dtype=torch.long)


def as_inputs(batch: Any, specs: Sequence[InputSpec]) -> list[torch.Tensor]:
    """The collated batch as the forward's inputs: a list/tuple of n tensors, or one tensor
    when the plan has one input."""
    names = ", ".join(s.name for s in specs)
    tensors = [batch] if isinstance(batch, torch.Tensor) else batch
    if not isinstance(tensors, (list, tuple)):
        raise ValueError(f"items collate to a {type(batch).__name__}; the plan's forward takes {len(specs)} "
                         f"input(s) ({names}): items must collate to a tensor per input (a tuple or list)")
    if len(tensors) != len(specs):
        raise ValueError(f"items collate to {len(tensors)} tensor(s), but the plan's forward takes "
                         f"{len(specs)} input(s) ({names})")
    for spec, t in zip(specs, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"input {spec.name!r}: items collate to a {type(t).__name__}, not a tensor")
    return list(tensors)


def check_inputs(tensors: Sequence[torch.Tensor], specs: Sequence[InputSpec], num_rows: int) -> None:
    """Each input has `num_rows` rows of the plan's row shape and its dtype."""
    for spec, t in zip(specs, tensors):
        want = (num_rows, *spec.row_shape)
        if tuple(t.shape) != want:
            raise ValueError(f"input {spec.name!r}: a batch of {num_rows} item(s) has shape {tuple(t.shape)}, "
                             f"but the plan's input has shape {spec.shape} (global batch of {spec.shape[0]} "
                             f"rows): expected {want}, each item one row of shape {spec.row_shape}")
        if t.dtype != spec.dtype:
            raise ValueError(f"input {spec.name!r}: dtype {t.dtype}, but the plan's input is {spec.dtype} "
                             f"(shape {spec.shape})")


class RankCollate:
    """Items of the rank's union U -> the forward's inputs, input i cut to its rows R_i."""

    def __init__(self, rows: Sequence[Sequence[int]], specs: Sequence[InputSpec], collate_fn: Collate) -> None:
        assert len(rows) == len(specs), f"{len(rows)} row lists for {len(specs)} inputs"
        self.union = sorted({r for rs in rows for r in rs})
        self.specs, self.collate_fn = list(specs), collate_fn
        self.picks = [positions(self.union, rs) for rs in rows]

    def inputs(self, items: list[Any]) -> list[torch.Tensor]:
        """The items collated and checked, not yet cut: every input with len(items) rows."""
        if not items:
            return [torch.empty((0, *s.row_shape), dtype=s.dtype) for s in self.specs]
        tensors = as_inputs(self.collate_fn(items), self.specs)
        check_inputs(tensors, self.specs, len(items))
        return tensors

    def __call__(self, items: list[Any]) -> list[torch.Tensor]:
        assert len(items) == len(self.union), f"{len(items)} items for {len(self.union)} rows"
        return [t[pick] for t, pick in zip(self.inputs(items), self.picks)]


class RankLoader(DataLoader):
    """A torch DataLoader over the rank's rows of each global batch, with `set_epoch`."""

    def set_epoch(self, epoch: int) -> None:
        """Epoch e reads the global batches of manual_seed(seed + e) (module docstring)."""
        assert isinstance(self.batch_sampler, RankBatchSampler)
        self.batch_sampler.set_epoch(epoch)


def rank_loader(dataset: Dataset, batch: int, rows: Sequence[Sequence[int]], specs: Sequence[InputSpec], *,
                shuffle: bool, seed: int, collate_fn: Collate, **loader_kwargs: Any) -> RankLoader:
    """The loader of the module docstring for a rank reading `rows` (one list per input) of
    each global batch of `batch` rows. `loader_kwargs` go to torch's DataLoader."""
    num_items = dataset_length(dataset, batch)
    collate = RankCollate(rows, specs, collate_fn)
    sampler = RankBatchSampler(num_items, batch, collate.union, shuffle=shuffle, seed=seed)
    if collate.union:
        collate.inputs([dataset[sampler.order()[collate.union[0]]]])  # an item of the rank's first batch
    return RankLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)


def dataset_length(dataset: Dataset, batch: int) -> int:
    """len(dataset), which must hold at least one global batch."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"a {type(dataset).__name__} is not a map-style dataset: the loader reads a rank's rows "
                         "by index and needs __getitem__ and __len__")
    num_items = len(dataset)
    if num_items < batch:
        raise ValueError(f"dataset of {num_items} items holds no global batch of {batch} rows; the plan's batch "
                         f"size is {batch}: use at least {batch} items (incomplete batches are dropped)")
    return num_items


__all__ = ["InputSpec", "RankBatchSampler", "RankCollate", "RankLoader", "as_inputs", "check_inputs",
           "dataset_length", "input_specs", "positions", "rank_loader", "shuffled_order"]
