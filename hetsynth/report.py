"""Text rendering of summaries for the command line (the data come from planner/cost_models)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hetsynth.cost_models.memory import OPTIMIZER_COPIES
from hetsynth.instruction_set.blocks import recompute_units, recomputed_units
from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.experts_op import OP as EXPERTS_OP, rank_loads
from hetsynth.instruction_set.graph import CUSTOM_BACKWARD
from hetsynth.instruction_set.layouts import R, S
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.instruction_set.sync import ONE_BUCKET
from hetsynth.instruction_set.training_state import TrainingState


def si(value: float, unit: str = "") -> str:
    """1.5e12 -> '1.50 T' + unit."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def graph_summary_text(summary: dict[str, Any]) -> str:
    ops = summary["op_counts"]
    lines = [
        f"model        {summary['model']}  (graph {summary['fingerprint']})",
        "inputs       " + ", ".join(f"{k}{v}" for k, v in summary["inputs"].items()),
        f"parameters   {summary['num_params']:,} in {summary['param_tensors']} tensors",
        f"FLOPs/step   {si(summary['flops_total'], 'FLOP')} "
        f"(forward {si(summary['flops_forward'])}, backward {si(summary['flops_backward'])})",
        f"ops          {summary['num_ops']} in {len(ops)} kinds",
        table([[k, v] for k, v in ops.items()], ["op", "count"]),
    ]
    if summary["fallback_ops"]:
        lines.append("replicated fallback (no sharding rule): "
                     + ", ".join(f"{k} x{v}" for k, v in summary["fallback_ops"].items()))
    return "\n".join(lines)


def cluster_summary(spec: ClusterSpec) -> dict[str, Any]:
    kinds = Counter(d.kind for d in spec.devices)
    kind_of = {d.name: d.kind for d in spec.devices}
    return {
        "name": spec.name,
        "fingerprint": spec.fingerprint(),
        "num_devices": spec.num_devices,
        "num_nodes": len(spec.nodes),
        "kinds": {k: {"count": c, **spec.device_kinds[k].model_dump()} for k, c in kinds.items()},
        "total_throughput_flops": sum(spec.throughputs_flops()),
        "total_memory_gib": sum(spec.memories_gib()),
        "nodes": [{"name": n.name, "devices": len(n.devices),
                   "kind": ",".join(sorted({kind_of[d] for d in n.devices})),
                   "nic_bandwidth_gbps": n.nic_bandwidth_gbps or spec.links.inter_node_bandwidth_gbps,
                   "intra_bandwidth_gbps": n.intra_bandwidth_gbps or spec.links.intra_node_bandwidth_gbps}
                  for n in spec.nodes],
        "links": spec.links.model_dump(),
    }


def cluster_summary_text(summary: dict[str, Any]) -> str:
    kinds = [[k, v["count"], si(v["throughput_flops"], "FLOP/s"), half_rates_text(v.get("matmul_flops")),
              f"{v['memory_gib']:g} GiB", "measured" if v["measured"] else "nominal"]
             for k, v in summary["kinds"].items()]
    nodes = [[name, n["devices"], n["kind"], f"{n['intra_bandwidth_gbps']:g}", f"{n['nic_bandwidth_gbps']:g}"]
             for name, n in _node_runs(summary["nodes"])]
    links = summary["links"]
    return "\n".join([
        f"cluster      {summary['name']}  ({summary['fingerprint']})",
        f"devices      {summary['num_devices']} on {summary['num_nodes']} nodes; total "
        f"{si(summary['total_throughput_flops'], 'FLOP/s')}, {summary['total_memory_gib']:g} GiB",
        table(kinds, ["kind", "count", "throughput", "16-bit", "memory", "figures"]),
        "",
        table(nodes, ["node", "devices", "kind", "intra Gbit/s", "NIC Gbit/s"]),
        "",
        f"links        intra-node {links['intra_node_bandwidth_gbps']:g} Gbit/s, "
        f"{links['intra_node_latency_us']:g} us; inter-node {links['inter_node_bandwidth_gbps']:g} "
        f"Gbit/s, {links['inter_node_latency_us']:g} us",
    ])


def half_rates_text(rates: dict[str, float | None] | None) -> str:
    """A kind's 16-bit matmul rates, `bf16 312 T, fp16 312 T`, or `none`."""
    shown = [(short, rates.get(name)) for name, short in (("bfloat16", "bf16"), ("float16", "fp16"))] if rates else []
    return ", ".join(f"{short} {si(rate)}" for short, rate in shown if rate is not None) or "none"


def _node_runs(nodes: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Consecutive nodes alike but for their names as one row: `p100-0 .. p100-5 (6 nodes)`."""
    runs: list[list[dict[str, Any]]] = []
    alike = lambda a, b: {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    for node in nodes:
        if runs and alike(runs[-1][0], node):
            runs[-1].append(node)
        else:
            runs.append([node])
    return [(run[0]["name"] if len(run) == 1 else f"{run[0]['name']} .. {run[-1]['name']} ({len(run)} nodes)",
             run[0]) for run in runs]


def _custom_backward_lines(plan: Plan) -> list[str]:
    """A warning naming the torch.autograd.Function classes whose backward never runs."""
    custom = plan.graph.custom_backwards
    return [f"warning      {len(custom)} torch.autograd.Function(s) traced through their forward: "
            f"{', '.join(custom)}; {CUSTOM_BACKWARD} (hetsynth run --check tells)"] if custom else []


def plan_summary_text(plan: Plan) -> str:
    """What `hetsynth plan` prints: prediction, speed-ups, ratios, instruction mix, search."""
    p, s = plan.predicted, plan.synthesis
    mem = max(d.memory_gib for d in p.devices)
    cap = min(d.memory_capacity_gib for d in p.devices)
    lines = [
        f"model        {plan.model.ref}  ({plan.model.num_params:,} parameters, batch {plan.model.batch_size})",
        f"cluster      {plan.cluster.name}  ({plan.cluster.num_devices} devices)",
        f"precision    {plan.precision_policy().describe()}",
        f"predicted    {p.step_time_s * 1e3:.2f} ms/step (compute {p.compute_s * 1e3:.2f} ms, "
        f"communication {p.communication_s * 1e3:.2f} ms); peak memory {mem:.2f} GiB "
        f"({'fits' if p.fits else 'DOES NOT FIT'}, smallest device {cap:g} GiB)",
        _memory_line(plan),
        *_experts_lines(plan),
        *_custom_backward_lines(plan),
        "",
        table([[name, f"{b.step_time_s * 1e3:.2f} ms", f"{b.step_time_s / p.step_time_s:.2f}x",
                "yes" if b.fits else "no", b.note] for name, b in plan.baselines.items()],
              ["baseline", "step time", "hetsynth speed-up", "fits", "note"]),
        "",
        table(_ratio_rows(plan), ["device kind", "devices", "ratio each", "share", "zero-length"]),
        "",
        table([[k, v] for k, v in instruction_mix(plan).items()], ["instruction", "count"]),
        "",
        f"synthesis    {s.seconds:.2f} s ({s.search_seconds:.2f} s search, {s.lp_seconds:.3f} s LP), "
        f"{s.states_expanded:,} states expanded, {s.rounds} round(s), "
        f"{'exact' if s.exact else 'width-bounded'}",
    ]
    return "\n".join(lines + _state_rows_lines(plan) + _sync_lines(plan))


ROW_COPIES = {TrainingState.ZERO1: OPTIMIZER_COPIES - 2, TrainingState.ZERO2: OPTIMIZER_COPIES - 1,
              TrainingState.ZERO3: OPTIMIZER_COPIES}  # of a parameter's copies, those held on its rows


def state_rows_per_device(plan: Plan) -> list[tuple[int, float]]:
    """Per rank: the ZeRO parameters' rows it holds (summed over parameters) and the bytes
    of the state it keeps on them (Adam moments; the gradient under ZeRO-2/3; the parameter
    under ZeRO-3)."""
    z = plan.state_shards
    copies = {i.tensor: ROW_COPIES[i.state] for i in plan.instructions if i.kind == "param" and z and i.tensor in z.rows}
    out = []
    for rank in range(plan.cluster.num_devices):
        rows = sum(r[rank] for r in z.rows.values()) if z else 0
        nbytes = sum(r[rank] * copies[t] * plan.graph.node(t).out.nbytes / max(plan.graph.node(t).out.shape[0], 1)
                     for t, r in z.rows.items()) if z else 0.0
        out.append((rows, nbytes))
    return out


def _state_rows_lines(plan: Plan) -> list[str]:
    """A table of the ZeRO rows per device (runs of equal devices merged) beside the predicted
    memory, when the plan shards training state."""
    if plan.state_shards is None:
        return []
    runs: list[list] = []
    for d, (rows, nbytes) in zip(plan.predicted.devices, state_rows_per_device(plan)):
        row = [f"{rows:,}", f"{nbytes / 2**30:.3f}", f"{d.memory_gib:.2f} of {d.memory_capacity_gib:g}"]
        if runs and runs[-1][1:] == row:
            runs[-1][0].append(d.name)
        else:
            runs.append([[d.name], *row])
    body = [[names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})", *rest]
            for names, *rest in runs]
    return ["", table(body, ["devices", "ZeRO state rows", "state on rows GiB", "memory GiB"])]


def _zero3_text(plan: Plan) -> str:
    has_zero3 = any(i.kind == "param" and i.state == TrainingState.ZERO3 for i in plan.instructions)
    return "; ZeRO-3's gathered parameter" if has_zero3 else ""


EXPERT_SPLITS = {"experts_dispatched": "tokens sent to them by all-to-all",
                 "experts_sharded": "tokens all-gathered to them, outputs reduce-scattered"}


def _experts_lines(plan: Plan) -> list[str]:
    """How a plan's routed-experts ops (instruction_set.experts_op) run: experts per device and
    how the tokens reach them, and with expected loads each device's share of the routed pairs;
    one line per different way."""
    ops = {n.name for n in plan.graph.calls if n.target == EXPERTS_OP}
    ways: Counter[str] = Counter()
    for ins in plan.instructions:
        if ins.kind == "compute" and ins.node in ops:
            ways[_experts_way(plan, ins)] += 1
    return [f"experts      {n} MoE op(s): {way}" for way, n in ways.items()]


def _experts_way(plan: Plan, ins: Any) -> str:
    node = plan.graph.node(ins.node)
    weights, layout = node.inputs[3], ins.inputs[3]
    experts = plan.graph.node(weights).out.shape[0]
    kind = next((k for k in EXPERT_SPLITS if k in ins.local), None)
    if kind is None:
        split = "tokens split" if ins.inputs[0].is_shard else "tokens whole"
        return f"{experts} experts on every device ({split})"
    lengths = plan.lengths(weights, layout)[0]
    text = f"{experts} experts split {'/'.join(map(str, lengths))} ({EXPERT_SPLITS[kind]})"
    loads = plan.graph.expert_loads.get(node.name)
    if loads:
        shares = rank_loads(loads, lengths, MeshLayout(plan.mesh, layout))
        text += f"; expected share of the routed pairs {'/'.join(f'{v:.2f}' for v in shares)} (loads given)"
    return text


def _memory_line(plan: Plan) -> str:
    """What the memory holds on the fullest device, and the techniques the plan uses to fit."""
    d = max(plan.predicted.devices, key=lambda d: d.memory_gib)
    split = (f"{d.state_gib:.2f} GiB parameters, gradients and optimizer state, {d.saved_gib:.2f} GiB saved "
             f"for backward" if d.state_gib is not None and d.saved_gib is not None else "no split recorded")
    if d.working_gib:
        amount = f"{d.working_gib:.2f} GiB" if d.working_gib >= 0.1 else f"{d.working_gib * 1024:.1f} MiB"
        split += f", {amount} transient (one op's unsaved inputs and output at once{_zero3_text(plan)})"
    units = recomputed_units(plan.instructions)
    found = len(recompute_units(plan.graph, plan.instructions)) if units else 0
    used = f"recomputes {len(units)} of {found} blocks ({units[0].name} ...)" if units else "no recomputation"
    return f"memory       on {d.name}: {split}; {used}; {_zero_text(plan)}{_sequence_parallel_text(plan)}"


NORMS = ("aten.layer_norm.default", "aten.rms_norm.default")


def _sequence_parallel_text(plan: Plan) -> str:
    """Sequence-parallel activations: how many of the layer norms over [B, T, H] activations
    the plan computes on token-split layouts S(1) (Megatron-SP), if any."""
    norms = {n.name for n in plan.graph.calls if n.target in NORMS and len(n.out.shape) >= 3}
    split = {i.node for i in plan.instructions if i.kind == "compute" and i.node in norms and i.layout is S(1)}
    return f"; sequence-parallel activations ({len(split)} of {len(norms)} layer norms token-split)" if split else ""


def _zero_text(plan: Plan) -> str:
    """ZeRO's use: which stage for how many parameters, and each device kind's share of their
    sharded state."""
    z = plan.state_shards
    if z is None:
        return "optimizer state replicated (no ZeRO)"
    kinds: dict[str, float] = {}
    for device, q in zip(plan.cluster.devices, z.ratios):
        kinds[device.kind] = kinds.get(device.kind, 0.0) + q
    counts = {k: sum(1 for d in plan.cluster.devices if d.kind == k) for k in kinds}
    shares = ", ".join(f"{k} {kinds[k] / counts[k]:.3f} each" for k in kinds)
    states = [i.state for i in plan.instructions if i.kind == "param" and i.tensor in z.rows]
    stages = {s: states.count(s) for s in dict.fromkeys(sorted(states))}
    used = " and ".join(f"ZeRO-{str(s)[-1]} for {n} parameters" for s, n in stages.items())
    scatter = f"; gradients reduce-scattered {z.scatter_variant}" if {TrainingState.ZERO2, TrainingState.ZERO3} & set(stages) else ""
    return f"{used} (state rows: {shares}; all-gather {z.variant}{scatter})"


def _sync_lines(plan: Plan) -> list[str]:
    """The gradient buckets: how many, their cap, and the caps the cost model compared."""
    g = plan.gradient_sync
    if g is None or not g.buckets:
        return []
    tried = ", ".join(f"{shape} {s * 1e3:.1f} ms" for shape, s in g.chosen_from.items())
    first = "" if g.first_bucket_cap_bytes is None else f"the first of at most {g.first_bucket_cap_bytes / 2**20:g} MiB, "
    last = "" if g.last_bucket_cap_bytes is None else f", the last of at most {g.last_bucket_cap_bytes / 2**20:g} MiB"
    cap = "one bucket per lane" if g.bucket_cap_bytes >= ONE_BUCKET else f"at most {g.bucket_cap_bytes / 2**20:g} MiB"
    return [f"grad sync    {len(g.buckets)} bucket(s), {first}{cap}{last}, launched "
            f"during the backward pass" + (f" (predicted, caps in MiB: {tried})" if tried else "")]


def _ratio_rows(plan: Plan) -> list[list[Any]]:
    rows: dict[str, list[float]] = {}
    for device, ratio in zip(plan.cluster.devices, plan.sharding_ratios):
        rows.setdefault(device.kind, []).append(ratio)
    out = []
    for kind, ratios in rows.items():
        each = f"{min(ratios):.4g}" if max(ratios) - min(ratios) < 1e-9 else f"{min(ratios):.4g}-{max(ratios):.4g}"
        out.append([kind, len(ratios), each, f"{sum(ratios):.3f}", sum(1 for r in ratios if r < 1e-9)])
    return out


def instruction_mix(plan: Plan) -> dict[str, int]:
    mix: Counter = Counter()
    for ins in plan.instructions:
        if ins.kind in ("input", "buffer"):
            continue
        label = ins.kind
        if ins.kind == "compute":
            sharded = any(l is not R for l in (*ins.inputs, ins.layout))
            label = "compute (sharded)" if sharded else "compute (replicated)"
        elif ins.variant and ins.variant != "local":
            label += f" [{ins.variant}]"
        if ins.phase == "backward":
            label += " (backward)"
        mix[label] += 1
    return dict(mix.most_common())
