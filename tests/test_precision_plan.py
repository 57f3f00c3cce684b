"""Mixed precision in planning (issue 38, items 1-3): per-dtype matmul rates in the cluster spec,
the precision policy a plan records, costs and ratios at the 16-bit rates, and the profiler's
per-dtype rates."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import hetsynth
from hetsynth.cost_models.precision import costed_graph
from hetsynth.cli import main
from hetsynth.report import plan_summary_text
from hetsynth.instruction_set.cluster import ClusterSpec, ClusterSpecError, cluster_from_dict, dump_cluster_toml, load_cluster
from hetsynth.instruction_set.matmul_rates import VENDOR_RATES, Dtype
from hetsynth.instruction_set.mixed_precision import Precision, PrecisionError, choose_policy
from hetsynth.instruction_set.plan import Plan, load_plan, plan_from_json, save_plan
from hetsynth.planner.planner import make_plan
from hetsynth.planner.problem import plan_problem
from hetsynth.planner.step_cost import predict_program
from hetsynth.profiling.matmul_dtypes import dtype_rates, measured_rates, unsupported_claims

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"
A100_T4 = CLUSTERS / "a100-t4.toml"
# one GPT layer of the HAP paper's width: matmul-bound, so the ratios follow the matmul rates
MODEL = "gpt:paper,num_layers=1,vocab_size=1024,batch_size=64"

BASE = {
    "name": "c",
    "device_kinds": {"g": {"throughput_flops": 1e12, "memory_gib": 16}},
    "nodes": [{"name": "n", "kind": "g", "num_devices": 2}],
    "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10},
}


def _spec(**kind: object) -> ClusterSpec:
    raw = copy.deepcopy(BASE)
    raw["device_kinds"]["g"].update(kind)
    return cluster_from_dict(raw)


# -- the spec ------------------------------------------------------------------------------

def test_a_kind_with_throughput_only_runs_float32_only() -> None:
    kind = _spec().device_kinds["g"]
    assert kind.rate_flops(Dtype.FLOAT32) == 1e12 and kind.half_dtypes() == ()
    assert kind.rate_flops(Dtype.BFLOAT16) is None
    assert choose_policy(_spec(), "auto").of("g").compute_dtype is Dtype.FLOAT32


def test_the_rates_table_gives_the_16_bit_types() -> None:
    kind = _spec(matmul_flops={"float16": 8e12, "bfloat16": 8e12, "tf32": 4e12}).device_kinds["g"]
    assert kind.half_dtypes() == (Dtype.BFLOAT16, Dtype.FLOAT16)
    assert kind.rate_flops(Dtype.TF32) == 4e12


def test_a_float32_rate_in_the_table_stands_for_throughput() -> None:
    raw = copy.deepcopy(BASE)
    raw["device_kinds"]["g"] = {"memory_gib": 16, "matmul_flops": {"float32": 2e12, "float16": 9e12}}
    kind = cluster_from_dict(raw).device_kinds["g"]
    assert kind.throughput_flops == 2e12 and kind.half_dtypes() == (Dtype.FLOAT16,)


def test_two_float32_rates_that_differ_are_refused() -> None:
    with pytest.raises(ClusterSpecError, match=r"matmul_flops.float32 = 2e\+12 FLOP/s and throughput_flops = "
                                               r"1e\+12 FLOP/s differ"):
        _spec(matmul_flops={"float32": 2e12})


@pytest.mark.parametrize("rates, message", [
    ({"bfloat16": 1e30}, r"device_kinds.g.matmul_flops.bfloat16 = 1e\+30: must be in \[1000, 1e\+21\] FLOP/s"),
    ({"float16": -5.0}, r"device_kinds.g.matmul_flops.float16 = -5.0: Input should be greater than 0"),
    ({"int8": 1e12}, r"device_kinds.g.matmul_flops.int8 = 1000000000000.0: Extra inputs are not permitted"),
])
def test_rates_out_of_bounds_are_named(rates: dict, message: str) -> None:
    with pytest.raises(ClusterSpecError, match=message):
        _spec(matmul_flops=rates)


def test_the_table_round_trips_through_toml(tmp_path: Path) -> None:
    spec = load_cluster(A100_T4)
    path = tmp_path / "c.toml"
    path.write_text(dump_cluster_toml(spec))
    assert load_cluster(path) == spec


def test_shipped_gpu_specs_carry_the_vendor_rates() -> None:
    for name, kinds in {"a100-t4": ("A100", "T4"), "a100x8": ("A100",), "hap-paper": ("V100", "P100")}.items():
        spec = load_cluster(CLUSTERS / f"{name}.toml")
        for kind in kinds:
            vendor = VENDOR_RATES[kind]
            for dtype in Dtype:
                assert spec.device_kinds[kind].rate_flops(dtype) == vendor.rate(dtype), (name, kind, dtype)
    assert VENDOR_RATES["H200"] == VENDOR_RATES["H100"] and VENDOR_RATES["H100"].float8 == 1979e12


# -- the policy ------------------------------------------------------------------------------

def test_auto_on_a100_t4_is_bf16_on_a100_and_fp16_with_loss_scaling_on_t4() -> None:
    policy = choose_policy(load_cluster(A100_T4), Precision.AUTO)
    assert policy.of("A100").compute_dtype is Dtype.BFLOAT16 and not policy.of("A100").loss_scaling
    assert policy.of("T4").compute_dtype is Dtype.FLOAT16 and policy.of("T4").loss_scaling
    assert (policy.master_dtype, policy.reduce_dtype) == ("float32", "float32")
    assert policy.activation_dtype is Dtype.FLOAT32  # bf16 and fp16 kinds exchange float32 activations


def test_activations_travel_in_the_16_bit_type_every_kind_shares() -> None:
    policy = choose_policy(load_cluster(CLUSTERS / "a100x8.toml"), Precision.AUTO)
    assert policy.activation_dtype is Dtype.BFLOAT16 and policy.activation_dtype.bytes == 2


def test_fp32_is_the_default_and_computes_in_float32() -> None:
    policy = choose_policy(load_cluster(A100_T4))
    assert policy.precision is Precision.FP32 and not policy.is_mixed


def test_auto_keeps_float32_where_the_16_bit_matmul_is_slower() -> None:
    assert choose_policy(_spec(matmul_flops={"bfloat16": 5e11}), "auto").of("g").compute_dtype is Dtype.FLOAT32


def test_bf16_on_a_kind_without_it_names_the_kind_and_what_it_supports() -> None:
    with pytest.raises(PrecisionError, match=r"--precision bf16: device kind 'T4' has no bfloat16 \(it supports "
                                             r"float16, float32\)"):
        choose_policy(load_cluster(A100_T4), "bf16")


def test_cli_bf16_on_t4_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", "--model", "gpt:tiny", "--cluster", str(A100_T4), "--precision", "bf16",
                 "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --precision bf16: device kind 'T4' has no bfloat16 (it supports float16, float32)" in err
    assert not (tmp_path / "p.json").exists()


# -- costs, ratios, the plan file ---------------------------------------------------------------

@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    graph = hetsynth.capture_model(MODEL)
    cluster = load_cluster(A100_T4)
    return {p: make_plan(graph, cluster, progress=False, with_baselines=False, precision=p) for p in ("fp32", "auto")}


@pytest.mark.slow
def test_the_ratios_follow_the_16_bit_rates(plans: dict[str, Plan]) -> None:
    fp32, auto = plans["fp32"].sharding_ratios, plans["auto"].sharding_ratios
    assert sum(auto[:4]) > sum(fp32[:4]) + 0.05  # the A100s' share grows
    assert auto[0] / auto[-1] == pytest.approx(312 / 65, rel=0.05)
    assert fp32[0] / fp32[-1] == pytest.approx(19.5 / 8.1, rel=0.05)
    assert plans["auto"].predicted.step_time_s < plans["fp32"].predicted.step_time_s


@pytest.mark.slow
def test_the_plan_records_the_policy_and_round_trips(plans: dict[str, Plan], tmp_path: Path) -> None:
    plan = plans["auto"]
    assert plan.precision == choose_policy(plan.cluster, "auto")
    assert plan.graph.params[0].out.dtype == "float32" and plan.cluster == load_cluster(A100_T4)
    save_plan(plan, tmp_path / "plan.json")
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["precision"]["kinds"]["T4"] == {"compute_dtype": "float16", "loss_scaling": True}
    again = load_plan(tmp_path / "plan.json")
    assert again == plan
    prediction, _ = predict_program(plan_problem(again), again.instructions, again.gradient_sync.shape)
    assert prediction.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)


def test_a_plan_without_a_policy_reads_as_float32(plans: dict[str, Plan]) -> None:
    raw = json.loads(plans["fp32"].model_dump_json())
    del raw["precision"]
    old = plan_from_json({**raw, "version": 6}, "old.json")
    assert old.precision is None and old.precision_policy() == choose_policy(old.cluster, "fp32")


def test_activations_take_autocasts_dtypes_and_parameters_stay_float32(plans: dict[str, Plan]) -> None:
    """Under bf16 everywhere, the costed graph is the graph as autocast runs it: matmuls output
    bfloat16, the ops autocast keeps in float32 (layer norm, softmax, the loss) output float32,
    parameters stay float32, and each weight a matmul uses is saved as a 16-bit copy (2 bytes
    an element); with kinds of different 16-bit types activations stay float32."""
    plan = plans["fp32"]
    graph = costed_graph(plan.graph, choose_policy(load_cluster(CLUSTERS / "a100x8.toml"), Precision.BF16))
    dtypes = {n.target: graph.node(n.name).out.dtype for n in plan.graph.calls if n.outputs and not n.multi_output}
    matmuls = [t for t in dtypes if t.split(".")[1] in ("mm", "addmm", "linear", "bmm")]
    assert matmuls and all(dtypes[t] == "bfloat16" for t in matmuls), dtypes
    kept = [t for t in dtypes if t.split(".")[1] in ("native_layer_norm", "_softmax", "_log_softmax", "log_softmax")]
    assert [n.out for n in graph.params] == [n.out for n in plan.graph.params]
    weights = {n.name: n.out.numel for n in plan.graph.params}
    for n in graph.calls:
        for s in n.saved or ():
            if s.source == "input" and n.inputs[s.index] in weights and n.target.split(".")[1] in ("mm", "addmm", "linear"):
                assert s.nbytes == 2 * weights[n.inputs[s.index]], (n.name, s)
    assert all(dtypes[t] == "float32" for t in kept), dtypes
    mixed = costed_graph(plan.graph, plans["auto"].precision)  # bf16 and fp16 kinds exchange float32
    assert [n.out for n in mixed.calls] == [n.out for n in plan.graph.calls]


@pytest.mark.parametrize("ref", ["gpt:tiny", "bert:tiny"])
def test_the_costed_graph_saves_what_autograd_saves_under_autocast(ref: str) -> None:
    """The bytes the bf16 costed graph says its ops save add up to what autograd saves when the
    graph's ops train a step under torch.autocast(bfloat16) on real tensors (each storage once,
    parameters excluded; their 16-bit copies are counted), within 1%: torch's fake layer norm of a
    bfloat16 input gives its mean and rstd in bfloat16, the CPU kernel keeps them in float32 (2
    bytes a row each; measured on bert:tiny: 1,024 of 477,700 bytes)."""
    from hetsynth.instruction_set.interpret import graph_inputs, run_graph
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.runtime.memory_report import SavedTensorMeter

    spec, graph = parse_model_ref(ref), hetsynth.capture_model(ref)
    costed = costed_graph(graph, choose_policy(load_cluster(CLUSTERS / "a100x8.toml"), Precision.BF16))
    torch.manual_seed(0)
    model = spec.build("cpu")
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.measuring(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run_graph(graph, graph_inputs(graph, model, tuple(spec.make_batch(range(spec.batch_size), seed=1))))
    loss.backward()
    probed = sum(t.nbytes for n in costed.calls for t in n.saved)
    assert meter.peak > 0 and abs(probed - meter.peak) <= 0.01 * meter.peak, (probed, meter.peak)


def test_the_summary_shows_the_policy(plans: dict[str, Plan]) -> None:
    text = plan_summary_text(plans["auto"])
    assert ("precision    auto: A100 bfloat16, T4 float16 + loss scaling; master weights float32, "
            "gradients reduced in float32") in text


# -- the profiler ----------------------------------------------------------------------------

def test_the_profiler_measures_each_dtype_the_cpu_runs() -> None:
    rates = dtype_rates(torch.device("cpu"), 0.02, shapes=[(64, 64, 64)])
    assert {"float32", "bfloat16", "float16"} <= set(rates) and "tf32" not in rates and "float8" not in rates
    assert all(r > 0 for r in rates.values())
    table = measured_rates([rates, rates])
    assert table.float32 is None and table.bfloat16 == pytest.approx(rates["bfloat16"])


def test_a_claimed_bf16_the_profiler_does_not_find_is_reported() -> None:
    claimed = _spec(matmul_flops={"bfloat16": 9e12, "float16": 9e12})
    found = claimed.model_copy(update={"device_kinds": {"g": claimed.device_kinds["g"].model_copy(
        update={"matmul_flops": measured_rates([{"float32": 1e12, "float16": 7e12}])})}})
    lines = unsupported_claims(claimed, found)
    assert lines == ["device kind 'g': the spec claims bfloat16 at 9e+12 FLOP/s, but the profiler found its devices "
                     "without bfloat16 matmuls"]
    assert unsupported_claims(claimed, claimed) == []


def test_explain_and_the_report_show_each_device_s_dtype(plans: dict[str, Plan]) -> None:
    from hetsynth.explain import explain
    from hetsynth.report_html import cluster_section

    head = explain(plans["auto"], 5).splitlines()[0]
    assert head.endswith("computes in float16 with loss scaling (master weights float32, gradients reduced in float32)")
    assert "<p>precision auto: A100 bfloat16, T4 float16 + loss scaling;" in cluster_section(plans["auto"])


@pytest.mark.slow
def test_pipeline_stages_are_planned_at_the_16_bit_rates(plans: dict[str, Plan], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline of an auto-precision plan: every stage is planned under the plan's policy (the
    A100 stage in bfloat16, the T4 stage in float16 with loss scaling), so each stage's
    predicted compute is below float32's; the CLI plans it too."""
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.planner.pipeline import plan_stages

    spec = parse_model_ref(MODEL)
    made = {p: plan_stages(plans[p], spec, 2, num_micro=2) for p in ("fp32", "auto")}
    assert made["auto"].precision == plans["auto"].precision
    for fp32, auto in zip(made["fp32"].pipeline.stages, made["auto"].pipeline.stages):
        assert auto.calls == fp32.calls
        for b, stage_plan in auto.plans.items():
            assert stage_plan.precision_policy().is_mixed
            assert stage_plan.predicted.compute_s < fp32.plans[b].predicted.compute_s
    out = tmp_path / "pipe.json"
    assert main(["plan", "--model", "gpt:tiny", "--cluster", str(A100_T4), "--precision", "auto", "--stages", "2",
                 "-o", str(out)]) == 0
    assert "pipeline: 2 stages" in capsys.readouterr().out
    assert hetsynth.load_plan(out).precision_policy().is_mixed


def test_one_loss_scale_where_any_kind_computes_in_float16() -> None:
    cluster = load_cluster(A100_T4)
    assert choose_policy(cluster, "auto").loss_scaling and not choose_policy(cluster, "fp32").loss_scaling


@pytest.mark.slow
def test_cli_plan_auto_records_and_prints_the_policy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "gpt:tiny", "--cluster", str(A100_T4), "--precision", "auto", "--json",
                 "-o", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["precision"]["kinds"]["A100"] == {"compute_dtype": "bfloat16", "loss_scaling": False}
    assert load_plan(out).precision == choose_policy(load_cluster(A100_T4), "auto")


def test_gradients_reduced_in_bfloat16_are_costed_at_half_the_bytes() -> None:
    """reduce_dtype bfloat16: the policy says so, and the same data-parallel program's gradient
    buckets are costed at half their float32 bytes (its step is predicted faster)."""
    from hetsynth import capture_model
    from hetsynth.planner import baselines

    spec = load_cluster(CLUSTERS / "local-emulated.toml")
    graph = capture_model("gpt:tiny")
    plans = {r: make_plan(graph, spec, ratios=baselines.even(spec), restrictions=baselines.DP, progress=False,
                          with_baselines=False, reduce_dtype=r) for r in ("float32", "bfloat16")}
    policy = plans["bfloat16"].precision_policy()
    assert policy.reduce_dtype == "bfloat16" and policy.reduce_scale == 0.5
    assert "gradients reduced in bfloat16" in policy.describe()
    program = {r: [(i.kind, i.tensor, i.layout, i.variant) for i in p.instructions] for r, p in plans.items()}
    assert program["bfloat16"] == program["float32"]
    syncs = {r: [i.predicted_s for i in p.instructions if i.kind == "all_reduce" and i.phase == "backward"]
             for r, p in plans.items()}
    assert syncs["bfloat16"] == pytest.approx([s / 2 for s in syncs["float32"]])
    assert plans["bfloat16"].predicted.step_time_s < plans["float32"].predicted.step_time_s
    with pytest.raises(PrecisionError, match="float16"):
        choose_policy(spec, "fp32", "float16")
