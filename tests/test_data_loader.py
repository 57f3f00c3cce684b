"""hetsynth.data.loader: each rank reads exactly its rows of the plain DataLoader's global batches.

Real GPT plans (tests/test_parity.make, float64) with uneven ratios and a zero ratio, a
data-parallel one (DP_SEED), one with both inputs forced to Shard(0) (ranks read disjoint rows
of the dataset) and a 2-stage pipeline (the second stage never reads the tokens). No process
group: every rank's loader is built here with `rank=`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from hetsynth import capture_model
from hetsynth.data import loader
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.pipeline import block_starts, make_pipeline_plan
from hetsynth.planner.planner import DP_SEED, make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.data_loader import InputSpec, rank_loader
from hetsynth.runtime.input_rows import input_rows
from test_parity import CLUSTER, make

REF = "gpt:tiny,dtype=float64"
NUM_ITEMS = 27  # 3 global batches of 8 and 3 items dropped


@functools.cache
def plan_of(kind: str) -> Plan:
    if kind == "zero-ratio":
        return make(REF, [0.5, 0.5, 0.0])
    if kind == "data-parallel":
        return make(REF, [0.5, 0.3, 0.2, 0.0], DP_SEED)
    if kind == "sharded":
        return make(REF, [0.6, 0.4], Restrictions(force={"tokens": "S0", "targets": "S0"}))
    assert kind == "pipeline"
    graph, cluster = capture_model(REF), load_cluster(CLUSTER).first(3)
    spmd = make_plan(graph, cluster, ratios=[1.0] * 3, width=8, progress=False, with_baselines=False)
    cut, n = block_starts(graph)[1], len(graph.calls)
    return make_pipeline_plan(spmd, parse_model_ref(REF), [(range(0, 1), (0, cut)), (range(1, 3), (cut, n))],
                              num_micro=3, ratios=[[1.0], [0.7, 0.3]], width=8)


def token_rows(num_items: int = NUM_ITEMS, length: int = 16, dtype: torch.dtype = torch.int64) -> TensorDataset:
    """Distinct rows: item k's tokens are k*length.., its targets the same plus 10**6."""
    tokens = torch.arange(num_items * length, dtype=dtype).reshape(num_items, length)
    return TensorDataset(tokens, tokens + 10**6)


class Recording(Dataset):
    """A dataset that records the indices read."""

    def __init__(self, base: Dataset) -> None:
        self.base, self.read = base, []

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.read.append(index)
        return self.base[index]


def plain_batches(dataset: Dataset, batch: int, shuffle: bool, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return list(DataLoader(dataset, batch_size=batch, shuffle=shuffle, generator=gen, drop_last=True))


def assert_combines_to(plan: Plan, per_rank: list[list], plain: list) -> None:
    """Every rank's input i is the plain batch's rows R_i(r); the ranks together read every row
    of every input, each as many times (by one rank, by all of them, or, in a pipeline, by the
    ranks of the stages that read the input whole)."""
    batch, world = plan.model.batch_size, plan.cluster.num_devices
    rows = [input_rows(plan, r) for r in range(world)]
    for b, whole in enumerate(plain):
        for i, tensor in enumerate(whole):
            for r in range(world):
                assert torch.equal(per_rank[r][b][i], tensor[rows[r][i]]), f"batch {b} input {i} rank {r}"
            read = sorted(row for r in range(world) for row in rows[r][i])
            copies = len(read) // batch  # 1 (split), the world (replicated), or the ranks of some stages
            assert read == sorted(list(range(batch)) * copies) and copies >= 1, read


@pytest.mark.parametrize("kind", ["zero-ratio", "data-parallel", "sharded", "pipeline"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.slow
def test_ranks_combine_to_the_plain_batches(kind: str, shuffle: bool) -> None:
    plan, data = plan_of(kind), token_rows()
    batch, world = plan.model.batch_size, plan.cluster.num_devices
    loaders = [loader(data, plan, shuffle=shuffle, seed=5, rank=r) for r in range(world)]
    for epoch in (0, 3):
        for it in loaders:
            it.set_epoch(epoch)
            assert len(it) == NUM_ITEMS // batch
        plain = plain_batches(data, batch, shuffle, seed=5 + epoch)
        assert_combines_to(plan, [list(it) for it in loaders], plain)


def test_epochs_reshuffle_and_passes_repeat() -> None:
    plan, data = plan_of("data-parallel"), token_rows()
    it = loader(data, plan, shuffle=True, seed=0, rank=1)
    first, again = list(it), list(it)
    it.set_epoch(1)
    other = list(it)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))


@pytest.mark.slow
def test_shapes_of_a_rank_that_reads_no_rows() -> None:
    plan = plan_of("pipeline")
    rows = input_rows(plan, 1)
    assert rows[0] == [] and rows[1] == list(range(8))
    tokens, targets = next(iter(loader(token_rows(), plan, rank=1)))
    assert tokens.shape == (0, 16) and tokens.dtype == torch.int64 and targets.shape == (8, 16)


@pytest.mark.parametrize("shuffle", [False, True])
def test_only_the_ranks_rows_are_read(shuffle: bool) -> None:
    plan = plan_of("sharded")
    data = Recording(token_rows())
    it = loader(data, plan, shuffle=shuffle, seed=2, rank=1)
    rows = input_rows(plan, 1)
    assert rows == [[5, 6, 7], [5, 6, 7]]
    order = torch.arange(NUM_ITEMS) if not shuffle else torch.cat([b[0][:, 0] // 16 for b in
                                                                   plain_batches(token_rows(), 8, True, seed=2)])
    expected = [int(order[b * 8 + r]) for b in range(NUM_ITEMS // 8) for r in rows[0]]
    assert data.read == expected[:1]  # the constructor checks one item of the rank's first batch
    data.read.clear()
    batches = list(it)
    assert data.read == expected
    assert [int(row[0]) // 16 for tokens, _ in batches for row in tokens] == expected


def test_a_rank_without_rows_reads_nothing() -> None:
    specs = [InputSpec("x", (8, 4), torch.float32), InputSpec("y", (8,), torch.int64)]
    data = Recording(TensorDataset(torch.randn(20, 4), torch.arange(20)))
    it = rank_loader(data, 8, [[], []], specs, shuffle=True, seed=0, collate_fn=torch.utils.data.default_collate)
    batches = list(it)
    assert len(batches) == len(it) == 2 and data.read == []
    assert [(t.shape, t.dtype) for t in batches[0]] == [((0, 4), torch.float32), ((0,), torch.int64)]


def test_rows_that_are_not_contiguous() -> None:
    specs = [InputSpec("x", (8, 2), torch.float32), InputSpec("y", (8,), torch.int64)]
    data = TensorDataset(torch.arange(32.0).reshape(16, 2), torch.arange(16))
    batches = list(rank_loader(data, 8, [[1, 3, 6], [3, 4]], specs, shuffle=False, seed=0,
                               collate_fn=torch.utils.data.default_collate))
    assert batches[1][0][:, 0].tolist() == [18.0, 22.0, 28.0] and batches[1][1].tolist() == [11, 12]


def test_rank_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_of("sharded")
    monkeypatch.setenv("RANK", "1")
    tokens, _ = next(iter(loader(token_rows(), plan)))
    assert tokens[:, 0].tolist() == [5 * 16, 6 * 16, 7 * 16]


def test_workers() -> None:
    plan, data = plan_of("data-parallel"), token_rows()
    serial, parallel = (loader(data, plan, shuffle=True, seed=1, rank=2, num_workers=n) for n in (0, 2))
    for epoch in (0, 2):
        serial.set_epoch(epoch)
        parallel.set_epoch(epoch)
        one, two = list(serial), list(parallel)
        assert len(one) == len(two) == 3
        assert all(torch.equal(a, b) for s, p in zip(one, two) for a, b in zip(s, p))


def padded(items: list) -> list[torch.Tensor]:
    """Pads each batch to its longest item (as NLP collates do)."""
    return [pad_sequence([item[k] for item in items], batch_first=True) for k in range(2)]


class Ragged(Dataset):
    """Token rows of 16, but item 3 of 20."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.arange(20 if index == 3 else 16)
        return row, row


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(token_rows())


def errors() -> list[tuple[str, Any, dict]]:
    dicts = [{"tokens": t, "targets": y} for t, y in token_rows()]
    return [
        ("dataset of 5 items holds no global batch of 8 rows", token_rows(5), {}),
        ("items collate to 1 tensor(s), but the plan's forward takes 2 input(s) (tokens, targets)",
         TensorDataset(token_rows().tensors[0]), {}),
        ("input 'tokens': a batch of 1 item(s) has shape (1, 12), but the plan's input has shape (8, 16)",
         token_rows(length=12), {}),
        ("input 'tokens': dtype torch.int32, but the plan's input is torch.int64", token_rows(dtype=torch.int32), {}),
        ("items collate to a dict; the plan's forward takes 2 input(s) (tokens, targets)", dicts, {}),
        ("rank 2: the plan has 2 ranks (0..1)", token_rows(), {"rank": 2}),
        ("a Stream is not a map-style dataset", Stream(), {}),
    ]


@pytest.mark.parametrize("message,data,kwargs", errors())
def test_errors(message: str, data: Any, kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        loader(data, plan_of("sharded"), **({"rank": 0} | kwargs))
    assert message in str(info.value)


def test_a_batch_of_another_shape_is_an_error() -> None:
    it = loader(Ragged(), plan_of("sharded"), collate_fn=padded, rank=0)  # item 0 is of the plan's shape
    with pytest.raises(ValueError) as info:
        list(it)
    assert "input 'tokens': a batch of 5 item(s) has shape (5, 20), but the plan's input has shape (8, 16)" \
        in str(info.value)
