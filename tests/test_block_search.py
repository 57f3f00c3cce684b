"""The search of a run of repeated blocks (planner.periodic, planner.synthesis._by_blocks):
found where the blocks are equal, not where they differ; reusing one block's search for
another is exact; and against the whole search the program is as cheap in the search's
cost and predicts the same step on these models."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import pytest
import torch
from torch import nn

from hetsynth.api import capture_model, load_cluster
from hetsynth.instruction_set.blocks import block_of
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.planner import baselines, periodic, synthesis
from hetsynth.planner.facts import FactTable
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Problem
from hetsynth.planner.signature import Signatures

HF = importlib.util.find_spec("transformers") is not None
# the starts of these models' blocks repeat after two to four blocks
REPEATING = [("gpt:tiny,num_layers=10", "local-emulated"), ("vit:tiny,num_layers=10", "slow-link-emulated")]
if HF:
    REPEATING.append(("hf:llama,num_layers=10", "hap-paper"))
# BERT's do not (four states lose 2.7e-6 s a block to the best, never enough to be dropped): searched block by block
CASES = REPEATING + [("bert:tiny,num_layers=10", "a100-t4")]


@lru_cache(maxsize=None)
def _graph(ref: str) -> ReferenceGraph:
    return capture_model(ref)


def _problem(ref: str, cluster: str, restrictions=None) -> Problem:
    spec = load_cluster(f"configs/clusters/{cluster}.toml")
    return Problem(_graph(ref), spec, baselines.proportional(spec), restrictions)


def _run(pb: Problem) -> periodic.Run | None:
    return periodic.find_run(pb, Signatures(pb, FactTable(pb).dead_after))


def test_a_run_of_equal_blocks_is_found() -> None:
    pb = _problem("gpt:tiny,num_layers=10", "local-emulated")
    run = _run(pb)
    assert run is not None
    assert run.blocks == 10 and run.end <= len(pb.order)
    assert pb.order[run.first].module_path.startswith("blocks.0")
    assert pb.order[run.end - 1].module_path.startswith("blocks.9")
    tau = run.maps[3]
    for i in range(run.length):  # block 3's node i maps to block 0's node i, its parameters to block 0's
        node, template = pb.order[run.start(3) + i], pb.order[run.first + i]
        assert tau[node.name] == template.name
        assert [tau[t] for t in node.inputs] == list(template.inputs)
    assert run.inverse[3][pb.order[run.first].name] == pb.order[run.start(3)].name


def test_too_few_or_unequal_blocks_are_searched_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(_problem("gpt:tiny,num_layers=6", "local-emulated")) is None  # 6 equal blocks < MIN_RUN
    monkeypatch.setattr(periodic, "MIN_RUN", 4)
    assert _run(_problem("gpt:tiny,num_layers=6", "local-emulated")).blocks == 6
    pb = _problem("gpt:tiny,num_layers=10", "local-emulated")
    sig = Signatures(pb, FactTable(pb).dead_after)
    run = periodic.find_run(pb, sig)
    original = sig.of
    odd = run.start(5) + 2  # block 5 differs from the others in one node's structure: the run ends before it
    monkeypatch.setattr(sig, "of", lambda k: ("changed", k) if k == odd else original(k))
    assert periodic.find_run(pb, sig).blocks == 5


@pytest.mark.parametrize("ref,cluster", REPEATING)
@pytest.mark.slow
def test_reusing_a_block_search_is_exact(ref: str, cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for restrictions in (None, baselines.DP):
        pb = _problem(ref, cluster, restrictions)
        reused = synthesis.synthesize(pb, progress=False)
        monkeypatch.setattr(synthesis, "REUSE", False)
        every = synthesis.synthesize(pb, progress=False)
        monkeypatch.setattr(synthesis, "REUSE", True)
        assert reused.instructions == every.instructions
        assert reused.cost_s == pytest.approx(every.cost_s, rel=1e-12)
        assert reused.states_expanded < every.states_expanded


@pytest.mark.parametrize("ref,cluster", CASES)
@pytest.mark.slow
def test_blocks_against_the_whole_search(ref: str, cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Search cost at the first ratios no higher than the whole search's (to 0.1%), and the
    plan's predicted step equal after the ratio LP."""
    pb = _problem(ref, cluster)
    spec = load_cluster(f"configs/clusters/{cluster}.toml")
    blocks = synthesis.synthesize(pb, progress=False)
    plan = make_plan(_graph(ref), spec, progress=False, with_baselines=False, keep_unfit=True)
    monkeypatch.setattr(periodic, "MIN_RUN", 10**9)
    whole = synthesis.synthesize(pb, progress=False)
    whole_plan = make_plan(_graph(ref), spec, progress=False, with_baselines=False, keep_unfit=True)
    assert blocks.cost_s <= whole.cost_s * 1.001
    assert blocks.states_expanded < whole.states_expanded
    assert plan.predicted.step_time_s == pytest.approx(whole_plan.predicted.step_time_s, rel=1e-9)


@pytest.mark.skipif(not HF, reason="transformers is not installed")
def test_blocks_reading_shared_tables_end_before_the_last_reader() -> None:
    """Llama's blocks read one rotary table and mask; the last block reads them last, so its
    liveness differs and the run stops before it."""
    pb = _problem("hf:llama,num_layers=10", "hap-paper")
    run = _run(pb)
    assert run.blocks == 9
    shared = [t for t in pb.order[run.first].inputs if t in run.maps[4] and run.maps[4][t] == t]
    assert all(run.maps[4].get(t) == t for t in shared)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class _FromTheFirstNode(nn.Module):
    """Heads that all read the input, added up after: the first op is block 0's, so the run
    starts at node 0."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outs = [block(x) for block in self.blocks]  # all blocks first, then the sum: the blocks are adjacent
        return ((torch.stack(outs).sum(0) - y) ** 2).mean()


class _EveryOutputInTheLoss(_FromTheFirstNode):
    """The loss reads the embedding and every block's output: block 1 reads block 0's output
    where block 0 reads the embedding, which the state still holds (periodic.translate must
    not merge the two tensors' facts)."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__(width, depth)
        self.embed = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = e = self.embed(x)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        return ((e + sum(outs) - y) ** 2).mean()


@pytest.mark.parametrize("module", [_FromTheFirstNode, _EveryOutputInTheLoss])
def test_runs_at_the_first_node_and_outputs_read_later(module: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(periodic, "MIN_RUN", 4)
    torch.manual_seed(0)
    graph = capture_model(module(), (torch.randn(32, 16), torch.randn(32, 16)))
    spec = load_cluster("configs/clusters/local-emulated.toml")
    pb = Problem(graph, spec, baselines.proportional(spec))
    run = _run(pb)
    assert run is not None and run.blocks >= 4
    assert (run.first == 0) == (module is _FromTheFirstNode)
    blocks = synthesis.synthesize(pb, progress=False)
    monkeypatch.setattr(periodic, "MIN_RUN", 10**9)
    whole = synthesis.synthesize(pb, progress=False)
    assert blocks.cost_s <= whole.cost_s * 1.001
    _reads_what_was_made(pb, blocks.instructions)


def _reads_what_was_made(pb: Problem, program) -> None:
    """Every op computes from layouts of its inputs that earlier instructions made."""
    made: set[tuple[str, str]] = set()
    for ins in program:
        if ins.kind == "compute":
            node = pb.graph.node(ins.node)
            for tensor, layout in zip(node.inputs, ins.inputs):
                assert (tensor, str(layout)) in made, (ins.node, tensor, str(layout))
        made.add((ins.tensor, str(ins.layout)))


@pytest.mark.slow
def test_blocks_with_nodes_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE family adds each block's auxiliary loss up between blocks, outside them: a
    block's period takes those nodes in, and reusing a block's search stays exact."""
    pb = _problem("moe:tiny,num_layers=10", "local-emulated", baselines.DP)
    run = _run(pb)
    assert run is not None and run.blocks >= 8
    own = [k for k in range(run.first, run.start(1)) if block_of(pb.order[k]) is not None]
    assert len(own) < run.length  # the block, then the nodes of no block up to the next
    assert all(block_of(pb.order[k]) is None for k in range(run.first + len(own), run.start(1)))
    reused = synthesis.synthesize(pb, progress=False)
    monkeypatch.setattr(synthesis, "REUSE", False)
    every = synthesis.synthesize(pb, progress=False)
    assert reused.instructions == every.instructions and reused.states_expanded < every.states_expanded
