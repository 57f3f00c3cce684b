"""The memory model against a run (runtime.memory_report): on every rank of gloo runs at
uneven ratios, the plan's predicted parameters + gradients + optimizer state are within 15%
of the bytes the rank holds, and its predicted saved activations within 25% of the peak
bytes autograd saved; the saved-tensor probe of capture equals autograd's own on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetsynth import capture_model
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.instruction_set.interpret import graph_inputs, run_graph
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.instruction_set.plan import Plan
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import Restrictions
from hetsynth.runtime.config import TrainConfig
from hetsynth.report import plan_summary_text
from hetsynth.runtime.memory_report import SavedTensorMeter, format_report, relative_error

GIB = 2**30
CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml"


def memory_worker(rank: int, world: int, plan: Plan, config: TrainConfig):
    import torch.distributed as dist
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.memory_report import measure_step
    from hetsynth.runtime.train import setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    train_step(trainer, 0)
    return measure_step(trainer, lambda: train_step(trainer, 1))


def _tensor_parallel(graph) -> dict[str, str]:
    """Column- then row-parallel MLP linears, head-parallel attention."""
    force = {}
    for n in graph.calls:
        if n.target == "aten.linear.default" and "ffn.fc" in n.module_path:
            force[n.name] = "S2" if "fc1" in n.module_path else "P"
        if n.target == "aten.scaled_dot_product_attention.default":
            force[n.name] = "S1"
    return force


def _plan(ref: str, ratios: list[float], tensor_parallel: bool) -> Plan:
    cluster = load_cluster(CLUSTER).first(len(ratios))
    graph = capture_model(ref)
    restrictions = Restrictions(force=_tensor_parallel(graph)) if tensor_parallel else None
    return make_plan(graph, cluster, ratios=ratios, progress=False, restrictions=restrictions,
                     with_baselines=False)


@pytest.mark.parametrize("ref, ratios, tensor_parallel, optimizer", [
    ("gpt:tiny", [0.7, 0.3], False, "adamw"),       # whatever the search picks for gpt at these ratios
    ("gpt:tiny", [0.6, 0.4], True, "adamw"),        # sharded weights, replicated and split activations
    ("vgg:tiny", [0.25, 0.75], False, "sgd"),       # convolutions, pooling; SGD keeps no state
])
def test_report_agrees_with_the_model(pools, ref: str, ratios: list[float], tensor_parallel: bool,
                                      optimizer: str) -> None:
    plan = _plan(ref, ratios, tensor_parallel)
    config = TrainConfig(steps=2, optimizer=optimizer)
    rows = pools.get(len(ratios)).run(memory_worker, plan, config, timeout_s=300)
    print(format_report(plan, rows, optimizer))
    for r in rows:
        assert r.params > 0 and r.grads > 0 and r.saved_peak > 0
        assert (r.optimizer > 0) == (optimizer == "adamw")
        assert abs(relative_error(r.predicted_state, r.state)) <= 0.15, (r.rank, r.predicted_state, r.state)
        assert abs(relative_error(r.predicted_saved, r.saved_peak)) <= 0.25, (r.rank, r.predicted_saved,
                                                                              r.saved_peak)


def test_probe_equals_autograd_on_one_device() -> None:
    """The bytes capture's probe attributes to the graph's ops add up to what autograd saves
    when the graph's ops train a step on real tensors (each storage once, parameters excluded),
    and every storage is given back after the backward."""
    spec = parse_model_ref("bert:tiny")
    graph = capture_model("bert:tiny")
    probed = sum(t.nbytes for n in graph.calls for t in n.saved)
    torch.manual_seed(0)
    model = spec.build("cpu")
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.measuring():
        run_graph(graph, graph_inputs(graph, model, tuple(spec.make_batch(range(spec.batch_size), seed=1)))).backward()
    assert probed == meter.peak > 0 and meter.bytes == 0


def test_a_saved_tensor_scales_with_its_own_layout() -> None:
    """A linear reading its input rows split (S0) and writing columns split too saves the input at
    the input's share, not the op's: per_share_i = bytes * sigma_i / s_i; a device with no share
    of the op (s_i = 0) saves nothing for it, whole tensors included."""
    from hetsynth.cost_models.memory import activation_memory
    from hetsynth.instruction_set.layouts import R, S

    graph = capture_model("gpt:tiny")
    node = next(n for n in graph.calls if n.target == "aten.linear.default" and n.saved)
    (saved,) = [t for t in node.saved if t.source == "input"]
    sigma = {node.inputs[0]: (0.5, 0.3, 0.2)}
    share_of = lambda name, layout: sigma[name]
    inputs, output = (S(0), R, R), S(len(node.outputs[0].shape) - 1)
    term = activation_memory(node, inputs, output, 3, (0.25, 0.15, 0.0), share_of)
    assert term.per_device((0.25, 0.15, 0.0)) == pytest.approx([saved.nbytes * s for s in (0.5, 0.3, 0.0)])
    whole = activation_memory(node, (R, R, R), S(len(node.outputs[0].shape) - 1), 3, (0.5, 0.5, 0.0), share_of)
    assert whole.fixed == pytest.approx((saved.nbytes, saved.nbytes, 0.0))  # the input held whole, but not
    # where the op has no rows
    plain = activation_memory(node, inputs, output, 3)  # without shares: the op's share for every split tensor
    assert plain.per_device((0.25, 0.15, 0.0)) == pytest.approx([saved.nbytes * s for s in (0.25, 0.15, 0.0)])


def test_the_largest_ops_unsaved_tensors_count_at_the_peak() -> None:
    """A linear widening 16 features to 4096 whose output only a sum reads: the linear saves its
    input (counted as saved), not its output, yet the output is live while the sum runs. The
    data-parallel plan's working set on each device is exactly its rows of that output, and the
    predicted peak is state + saved + working."""
    import hetsynth
    from torch import nn

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 4096)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    plan = hetsynth.plan(Wide(), (torch.randn(64, 16),), cluster=CLUSTER, data_parallel=True)
    for d in plan.predicted.devices:
        rows = d.saved_gib * GIB / (16 * 4)  # the linear saves its input's rows, float32
        assert rows == round(rows) and abs(rows - 64 * d.ratio) < 1  # whole rows, near the ratio's
        assert d.working_gib * GIB == pytest.approx(rows * 4096 * 4 + 4)  # those rows of the output, and the sum
        assert d.memory_gib == pytest.approx(d.state_gib + d.saved_gib + d.working_gib)
    assert "transient (one op's unsaved inputs and output" in plan_summary_text(plan)
    assert len({d.working_gib for d in plan.predicted.devices}) > 1  # the ratios differ, so do the rows
