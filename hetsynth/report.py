"""Text rendering of summaries for the command line (the data come from planner/cost_models)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from cost_models.cluster import ClusterSpec


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
        f"inputs       " + ", ".join(f"{k}{v}" for k, v in summary["inputs"].items()),
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
    return {
        "name": spec.name,
        "fingerprint": spec.fingerprint(),
        "num_devices": spec.num_devices,
        "num_nodes": len(spec.nodes),
        "kinds": {k: {"count": c, **spec.device_kinds[k].model_dump()} for k, c in kinds.items()},
        "total_throughput_flops": sum(spec.throughputs_flops()),
        "total_memory_gib": sum(spec.memories_gib()),
        "nodes": [{"name": n.name, "devices": len(n.devices),
                   "kind": ",".join(sorted({d.kind for d in spec.devices if d.name in n.devices})),
                   "nic_bandwidth_gbps": n.nic_bandwidth_gbps or spec.links.inter_node_bandwidth_gbps,
                   "intra_bandwidth_gbps": n.intra_bandwidth_gbps or spec.links.intra_node_bandwidth_gbps}
                  for n in spec.nodes],
        "links": spec.links.model_dump(),
    }


def cluster_summary_text(summary: dict[str, Any]) -> str:
    kinds = [[k, v["count"], si(v["throughput_flops"], "FLOP/s"), f"{v['memory_gib']:g} GiB",
              "measured" if v["measured"] else "nominal"] for k, v in summary["kinds"].items()]
    nodes = [[n["name"], n["devices"], n["kind"], f"{n['intra_bandwidth_gbps']:g}",
              f"{n['nic_bandwidth_gbps']:g}"] for n in summary["nodes"]]
    links = summary["links"]
    return "\n".join([
        f"cluster      {summary['name']}  ({summary['fingerprint']})",
        f"devices      {summary['num_devices']} on {summary['num_nodes']} nodes; total "
        f"{si(summary['total_throughput_flops'], 'FLOP/s')}, {summary['total_memory_gib']:g} GiB",
        table(kinds, ["kind", "count", "throughput", "memory", "figures"]),
        "",
        table(nodes, ["node", "devices", "kind", "intra Gbit/s", "NIC Gbit/s"]),
        "",
        f"links        intra-node {links['intra_node_bandwidth_gbps']:g} Gbit/s, "
        f"{links['intra_node_latency_us']:g} us; inter-node {links['inter_node_bandwidth_gbps']:g} "
        f"Gbit/s, {links['inter_node_latency_us']:g} us",
    ])
