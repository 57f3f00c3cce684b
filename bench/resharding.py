"""Cross-mesh resharding on the emulated cluster: every method on the paper's cases, measured
against the per-NIC cost model and the NIC lower bound.

    python bench/resharding.py [--mib 32] [--reps 5] [--only case1 case7 ...]

Emulated clusters of 4 CPU ranks per host (one network namespace per host, its NIC shaped both
ways by tbf, ranks of a host on loopback; CPU quotas of 2 CPUs, i.e. no throttling: resharding
is communication-bound): `uniform` (4 hosts, every NIC 500 Mbit/s), `two-speed` (4 hosts at
500, 250, 500, 500 Mbit/s) and `five-host` (5 hosts at 500 Mbit/s, for the paper's case 6,
(2,4) -> (3,4)). Cases: the paper's n-to-m cases 1-9 with its (2,4) meshes kept (4 replicas per
host: with 2 the model's 4x would be 2x), its 1-to-m cases, uneven shards (node blocks 0.6/0.4;
ratios 0.7/0.2/0.1), zero-length shards and two NIC speeds. Tensors are float64 arange, `--mib`
MiB (32 by default).

For every case and method (order rotated every repetition, one warm-up repetition first): the
median seconds from a barrier until the last rank is done, the predicted seconds, the NIC lower
bound, and whether every destination holds exactly the right values. Methods whose schedules
are the same data (the same chains, e.g. one 2-member transfer in 1tom-1) are one piece of work:
it is run once per repetition and its times are recorded for each of them (`same_schedule`).
Prints the table and the acceptance ratios; writes bench/results/resharding.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, print_tables, write_json

sys.path.insert(0, str(ROOT))

from hetsynth.cost_models.flows import NicModel  # noqa: E402
from hetsynth.instruction_set.cluster import ClusterSpec, cluster_from_dict  # noqa: E402
from hetsynth.instruction_set.mesh import Mesh  # noqa: E402
from hetsynth.instruction_set.reshard_sides import Placed, reshard_spec  # noqa: E402
from hetsynth.instruction_set.resharding import ReshardMethod, ReshardPlan  # noqa: E402
from hetsynth.instruction_set.shards import largest_remainder  # noqa: E402
from hetsynth.planner.resharding import plan_reshard  # noqa: E402

PER_HOST = 4
SPEEDS = {"uniform": (500, 500, 500, 500), "two-speed": (500, 250, 500, 500), "five-host": (500,) * 5}
A, B = Mesh(2, 4, True, 0), Mesh(2, 4, True, 8)


def cluster(speeds: tuple[int, ...]) -> ClusterSpec:
    return cluster_from_dict({
        "name": "resharding-bench", "device_kinds": {"cpu": {"throughput_flops": 1e10, "memory_gib": 2}},
        "devices": [{"name": f"h{h}/{i}", "kind": "cpu"} for h in range(len(speeds)) for i in range(PER_HOST)],
        "nodes": [{"name": f"h{h}", "devices": [f"h{h}/{i}" for i in range(PER_HOST)],
                   "nic_bandwidth_gbps": speeds[h] / 1000} for h in range(len(speeds))],
        "links": {"intra_node_bandwidth_gbps": 8, "intra_node_latency_us": 50, "inter_node_bandwidth_gbps": 0.5,
                  "inter_node_latency_us": 200},
        "emulation": {"cpu_quota": {"cpu": 2.0}, "period_us": 10000}})


def split(n: int, ratios: list[float]) -> tuple[int, ...]:
    return tuple(largest_remainder(ratios, n))


def cases(rows: int) -> list[tuple[str, str, Placed, Placed, tuple[int, ...]]]:
    """(name, cluster, source, destination, shape); rows = dim 0 of the 3-d tensors."""
    shape = (rows, 256, 128)
    half = split(rows, [1, 1])
    outer = {0: tuple(n for n in half for _ in range(4))}
    s1_outer = {1: (128,) * 4 + (128,) * 4}
    one4 = Mesh(1, 4, False, 0)
    flat = (rows * 256 * 128,)
    out = [
        ("case1", "uniform", Placed(A, "S0|R", outer), Placed(B, "S0|R", outer), shape),
        ("case2", "uniform", Placed(A, "R", {}), Placed(B, "S0|R", outer), shape),
        ("case3", "uniform", Placed(A, "S1|R", s1_outer), Placed(B, "S0|R", outer), shape),
        ("case4", "uniform", Placed(A, "S1", {1: (32,) * 8}), Placed(B, "S0", {0: split(rows, [1] * 8)}), shape),
        ("case5", "uniform", Placed(A, "R|S0", {0: split(rows, [1] * 4) * 2}), Placed(B, "S0|R", outer), shape),
        ("case6", "five-host", Placed(A, "S0|R", outer),
         Placed(Mesh(3, 4, True, 8), "S0|R", {0: tuple(n for n in split(rows, [1, 1, 1]) for _ in range(4))}), shape),
        ("case7", "uniform", Placed(one4, "S0", {0: split(rows, [1] * 4)}), Placed(B, "R", {}), shape),
        ("case8", "uniform", Placed(one4, "S0", {0: split(rows, [1] * 4)}), Placed(B, "S0|R", outer), shape),
        ("case9", "uniform", Placed(A, "S1|R", s1_outer), Placed(B, "S2|R", {2: (64,) * 8}), shape),
    ]
    for m in (1, 2, 3, 4):
        out.append((f"1tom-{m}", "uniform", Placed(Mesh(1, 1, False, 0), "R", {}),
                    Placed(Mesh(1, m, False, 4), "R", {}), flat))
    out.append(("1tom-2x4", "uniform", Placed(Mesh(1, 1, False, 0), "R", {}), Placed(B, "R", {}), flat))
    blocks = split(rows, [0.6, 0.4])
    out += [
        ("uneven-64", "uniform", Placed(A, "S0|R", {0: tuple(n for n in blocks for _ in range(4))}),
         Placed(B, "S0|R", outer), shape),
        ("uneven-721", "uniform", Placed(Mesh(1, 3, False, 0), "S0", {0: split(rows, [0.7, 0.2, 0.1])}),
         Placed(B, "S0|R", outer), shape),
        ("zero-len", "uniform", Placed(Mesh(1, 3, False, 0), "S1", {1: (160, 0, 96)}),
         Placed(B, "R|S1", {1: (160, 0, 96, 0) * 2}), shape),
        ("two-speed-2", "two-speed", Placed(A, "R", {}), Placed(B, "S0|R", outer), shape),
        ("two-speed-7", "two-speed", Placed(one4, "S0", {0: split(rows, [1] * 4)}),
         Placed(Mesh(2, 4, True, 4), "R", {}), shape),
    ]
    return out


def plans(spec: ClusterSpec, src: Placed, dst: Placed, shape: tuple[int, ...], name: str) -> dict[str, ReshardPlan]:
    hosts, nics = spec.rank_nodes(), NicModel.from_cluster(spec)
    rs = reshard_spec(name, shape, "float64", 8, src, dst, hosts)
    picked = plan_reshard(rs, nics)
    out = {"picked": picked}
    for m in ReshardMethod:
        out[m.value] = plan_reshard(rs, nics, method=m)
    return out


def measure(spec: ClusterSpec, named: list[tuple[str, dict[str, ReshardPlan]]], reps: int, workdir: Path) -> list[dict]:
    from hetsynth.runtime.launch import launch_checked

    path, out = workdir / f"{spec.name}-cases.json", workdir / f"{spec.name}-records.json"
    path.write_text(json.dumps([{"name": n, "plans": {m: p.model_dump(mode="json") for m, p in ps.items()
                                                      if m != "picked"}} for n, ps in named]))
    launch_checked(spec, [str(ROOT / "bench" / "resharding_worker.py"), "--cases", str(path), "--reps", str(reps),
                          "--out", str(out)], "resharding measurement", timeout_s=600)
    return json.loads(out.read_text())


def analyse(name: str, ps: dict[str, ReshardPlan], record: dict, speeds: tuple[int, ...], mib: float) -> dict:
    picked = ps["picked"]
    med = {m: statistics.median(ts) for m, ts in record["times"].items()}
    fastest = min(med, key=med.get)
    methods = {m: {"measured_s": round(med[m], 4), "predicted_s": round(picked.alternatives[ReshardMethod(m)].predicted_s, 4)}
               for m in med}
    return {"name": name, "lower_bound_s": round(picked.lower_bound_s, 4), "picked": picked.method.value,
            "correct": all(record["correct"].values()), "methods": methods,
            "diagnostics": {"src": picked.spec.src.describe, "dst": picked.spec.dst.describe, "mib": mib,
                            "nic_mbit": list(speeds), "fastest": fastest,
                            "pick_within_10pct": med[picked.method.value] <= 1.1 * med[fastest],
                            "lb_over_bound": round(med["broadcast_lb"] / picked.lower_bound_s, 3),
                            "sr_over_lb": round(med["send_recv"] / med["broadcast_lb"], 3),
                            "model_sr_over_lb": round(picked.alternatives[ReshardMethod.SEND_RECV].predicted_s
                                                      / picked.alternatives[ReshardMethod.BROADCAST_LB].predicted_s, 3),
                            "repetitions": len(record["times"]["send_recv"]),
                            "same_schedule": record.get("same", {}),
                            "times_s": record["times"]}}


def table(results: list[dict]) -> None:
    rows = []
    for r in results:
        d = r["diagnostics"]
        for m, v in r["methods"].items():
            rows.append([r["name"], m, f"{v['measured_s']:.3f}", f"{v['predicted_s']:.3f}", f"{r['lower_bound_s']:.3f}",
                         f"{v['measured_s'] / r['lower_bound_s']:.2f}", d["sr_over_lb"] if m == "broadcast_lb" else "",
                         "*" if m == r["picked"] else "", "*" if m == d["fastest"] else "", r["correct"]])
    print_tables(rows, ["case", "method", "measured s", "predicted s", "NIC bound s", "meas/bound", "sr/lb",
                        "picked", "fastest", "correct"])


def acceptance(results: list[dict]) -> dict:
    four = [r for r in results if r["diagnostics"]["model_sr_over_lb"] >= 3.5]  # the model says about 4x or more
    return {
        "sr_over_lb_where_model_4x": {r["name"]: r["diagnostics"]["sr_over_lb"] for r in four},
        "min_sr_over_lb_where_model_4x": min((r["diagnostics"]["sr_over_lb"] for r in four), default=None),
        "lb_slower_than_sr": [r["name"] for r in results if r["diagnostics"]["sr_over_lb"] < 1],
        "max_lb_over_bound": max(r["diagnostics"]["lb_over_bound"] for r in results),
        "pick_accuracy": sum(r["diagnostics"]["pick_within_10pct"] for r in results) / len(results),
        "all_correct": all(r["correct"] for r in results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default="resharding.json")
    args = p.parse_args()
    rows = max(8, int(round(128 * args.mib / 32 / 8)) * 8)
    chosen = [c for c in cases(rows) if args.only is None or c[0] in args.only]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, speeds in SPEEDS.items():
            spec = cluster(speeds).model_copy(update={"name": f"resharding-{kind}"})
            named = [(n, plans(spec, s, d, shape, n)) for n, k, s, d, shape in chosen if k == kind]
            if not named:
                continue
            records = {r["name"]: r for r in measure(spec, named, args.reps, Path(tmp))}
            results += [analyse(n, ps, records[n], speeds, args.mib) for n, ps in named]
    table(results)
    summary = acceptance(results)
    print(json.dumps(summary, indent=2))
    print(write_json(args.out, {"cases": results, "acceptance": summary}))


if __name__ == "__main__":
    main()
