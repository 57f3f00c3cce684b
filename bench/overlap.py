"""CommFuse measured: all-gather -> matmul and matmul -> reduce-scatter as the unfused pair, as
k-slicing (k = 2, 4) and as the fused ring (runtime.collectives.fused), beside the matmul
alone, on the emulated cluster (needs root), inside a node and across the shaped link.

    python bench/overlap.py [--pilot | --trace PATH | --e2e-only | --no-e2e] [--reps N]

Environments (generated from bench/results/local-emulated-measured.toml, its measured device
kinds and links):
  inside  one node, 2 cpu-fast workers (0.5 CPU each), loopback
  across  two nodes of one cpu-fast worker each, 200 Mbit/s shaped link
The exposed communication fraction of a variant is (variant - matmul) / (unfused - matmul).
A case is one "where t_p <= t_c" when the ring's worst step is (`measured_ratio`: measured, per
step, so skewed shards count the step that moves the long chunk beside the short one's matmul).
`--pilot` runs a few cases per environment and only prints.

End to end (`--e2e-only`, `--e2e-model`, `--e2e-env`, `--e2e-rounds`): the planner's own plan of
the model on the environment (E2E_MODEL on `across`: sequence-parallel tensor parallelism with
its pairs fused) trained interleaved with the same plan without fusion; the fused plan's traced
steps give the per-instruction comparison (bench/results/overlap_e2e_instructions.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, markdown_table, print_table, write_json

sys.path.insert(0, str(ROOT))

from instruction_set.program import FUSED_MATMULS  # noqa: E402  (after the path)

BASE = RESULTS / "local-emulated-measured.toml"
# GPT small-cpu widened (hidden 512, FFN 2048) on 8 sequences of 64 tokens: weights big against
# the batch, so that on `across` the planner's own plan is tensor parallel (sequence-parallel,
# Megatron pairs) and fuses its pairs
E2E_MODEL = "gpt:small-cpu,hidden=512,ffn_hidden=2048,batch_size=8,seq_len=64"
TOKENS = 2048


def environment(name: str, workdir: Path) -> Path:
    """The spec of an environment (module docstring), written to workdir."""
    from instruction_set.cluster import dump_cluster_toml, load_cluster

    base = load_cluster(BASE)
    raw = base.model_dump(mode="json", exclude_none=True)
    if name == "inside":
        raw["devices"] = [{"name": "fast/0", "kind": "cpu-fast"}, {"name": "fast/1", "kind": "cpu-fast"}]
        raw["nodes"] = [{"name": "fast", "devices": ["fast/0", "fast/1"]}]
    else:
        raw["devices"] = [{"name": "a/0", "kind": "cpu-fast"}, {"name": "b/0", "kind": "cpu-fast"}]
        raw["nodes"] = [{"name": "a", "devices": ["a/0"]}, {"name": "b", "devices": ["b/0"]}]
    raw["name"] = f"overlap-{name}"
    spec = type(base).model_validate(raw)
    path = workdir / f"{name}.toml"
    path.write_text(dump_cluster_toml(spec))
    return path


def measure(spec_path: Path, cases: list[dict], reps: int, workdir: Path, trace: bool = False) -> list[dict]:
    from instruction_set.cluster import load_cluster
    from runtime.launch import launch_checked

    case_file, out = workdir / "cases.json", workdir / "records.json"
    case_file.write_text(json.dumps(cases))
    launch_checked(load_cluster(spec_path), [str(ROOT / "bench" / "overlap_worker.py"), "--cases", str(case_file),
                                             "--reps", str(reps), "--out", str(out), *(["--trace"] if trace else [])],
                     "overlap measurement")
    return json.loads(out.read_text())


def pilot_cases(env: str) -> list[dict]:
    outs = (128, 1024) if env == "inside" else (1024, 4096)
    half = TOKENS // 2
    return [{"name": f"{env}-ag-o{o}", "kind": "ag_matmul", "lengths": [half, half], "hidden": 1024, "out": o}
            for o in outs] + [{"name": f"{env}-rs-h{h}", "kind": "matmul_rs", "lengths": [half, half],
                               "hidden": h, "out": 1024} for h in (256, 2048)]


class Model:
    """The cost model's view of one environment (its measured spec): the matmul from the
    device kind's throughput, the collectives from the calibrated links (cost_models.comm),
    the fused forms from cost_models.fused with the kind's transfer CPU share."""

    def __init__(self, spec_path: Path) -> None:
        from cost_models.comm import CommModel
        from instruction_set.cluster import load_cluster

        self.spec = load_cluster(spec_path)
        self.comm = CommModel(self.spec, two_level=False)
        self.kind = self.spec.device_kind(0)

    def matmul_s(self, case: dict) -> float:
        flops = 2.0 * sum(case["lengths"]) * case["hidden"] * case["out"]
        return flops / self.kind.throughput_flops + self.kind.kernel_launch_us * 1e-6

    def _ring(self, case: dict) -> "Ring":
        from cost_models.fused import Ring

        n = len(case["lengths"])
        row = 4.0 * (case["hidden"] if case["kind"] == "ag_matmul" else case["out"])
        alpha, beta = self.comm.alpha_beta("all_gather", "ring", "all")
        k = self.kind
        return Ring(member=tuple(range(n)), matmul_s=(self.matmul_s(case),) * n, gamma=(k.transfer_cpu_share,) * n,
                    per_message_s=(k.transfer_cpu_us_per_message * 1e-6,) * n,
                    membw=(k.memory_bandwidth_gbyte_s * 1e9,) * n, lengths=(tuple(case["lengths"]),) * n,
                    row_bytes=(row,) * n, alpha=alpha, beta=beta)

    def _collective_s(self, case: dict, parts: int) -> float:
        lengths = case["lengths"]
        shares = tuple(x / sum(lengths) for x in lengths)
        gather = case["kind"] == "ag_matmul"
        nbytes = 4.0 * sum(lengths) * (case["hidden"] if gather else case["out"])
        kind = "all_gather" if gather else "reduce_scatter"
        return self.comm.cost(kind, "padded", nbytes / parts, "all", shares).at(shares)

    def step_ratio(self, case: dict) -> float:
        """The cost model's t_p / t_c of the ring's worst step: the per-row ratio (bytes of a row
        over the link's bandwidth against the row's matmul at the throughput) times the
        shards' neighbour imbalance (`imbalance`)."""
        _, beta = self.comm.alpha_beta("all_gather", "ring", "all")
        row = 4.0 * (case["hidden"] if case["kind"] == "ag_matmul" else case["out"])
        per_row = (row / beta) / (2.0 * case["hidden"] * case["out"] / self.kind.throughput_flops)
        return per_row * imbalance(case["lengths"])

    def predict(self, case: dict) -> dict[str, float]:
        from cost_models.fused import ring_cost, sliced_cost
        from cost_models.terms import seconds

        ring, gather = self._ring(case), case["kind"] == "ag_matmul"
        out = {"unfused": self.matmul_s(case) + self._collective_s(case, 1),
               "fused": seconds(ring_cost(ring, gather))}
        for k in (2, 4):
            out[f"sliced{k}"] = seconds(sliced_cost(ring, gather, k, self._collective_s(case, k)))
        return out


# The shapes of the cases, by environment: (tokens, the fixed dim, the sizes that set the per-step
# t_p / t_c). The cost model's figures for these links are off by up to 4x from what the worker
# measures, so the sizes are set from measured figures: a chunk's matmul at ~47 GFLOP/s
# (0.5 CPU); a step across the 200 Mbit/s link at ~43 ms per MiB; inside a node, over loopback,
# ~2-5 ms per MiB, all of it CPU work under the worker's quota. The communication must also be
# large against the matmul's own run-to-run spread (a few %), or the exposed fraction, a ratio
# to it, is noise: hence 8 MiB per rank inside a node and 2 MiB across. The cost model's t_p / t_c
# of every case is printed beside the measured one.
#   inside  2048 tokens; ag: hidden 2048, out O: t_c per 1024-row chunk ~ O * 89 us (O = 1024:
#           91 ms), t_p of 8 MiB ~ 15-40 ms; rs: out 2048, hidden H (the same with H for O)
#   across  1024 tokens; ag: hidden 1024, out O: t_c per 512-row chunk ~ O * 22 us (O = 12288:
#           274 ms), t_p of 2 MiB ~ 85 ms; rs: out 1024, hidden H
REGIMES = {"inside": (TOKENS, 2048, (1024, 512, 128, 32)), "across": (TOKENS // 2, 1024, (12288, 8192, 4096, 1024))}

# repetitions by environment: across, a case's communication is 15-25% of its matmul where
# t_p < t_c, and the matmul's time moves by 5-25% for seconds at a time (exposure_interval)
REPS = {"inside": 15, "across": 25}

SHORT = {"ag_matmul": "ag", "matmul_rs": "rs"}


def cases(env: str, model: Model) -> list[dict]:
    """ag_matmul and matmul_rs at four sizes per environment (REGIMES: two with t_p well below
    t_c, one near it, one well above, as measured), even and skewed 2:1 shards. ag_matmul's
    per-step t_p / t_c is 4 H / beta over 2 H O / F: only O sets it; matmul_rs's is
    4 O / beta over 2 H O / F: only H does. Each case carries the cost model's ratio."""
    tokens, fixed, sizes = REGIMES[env]
    out = []
    for size in sizes:
        for skew, lengths in (("even", [tokens // 2] * 2), ("skewed", [2 * tokens // 3, tokens - 2 * tokens // 3])):
            for kind, hidden, o in (("ag_matmul", fixed, size), ("matmul_rs", size, fixed)):
                case = {"name": f"{env}-{SHORT[kind]}-{size}-{skew}", "kind": kind,
                        "lengths": lengths, "hidden": hidden, "out": o}
                out.append(case | {"model_ratio": model.step_ratio(case)})
    return out


def exposed(r: dict, variant: str) -> float:
    comm = r["unfused_s"] - r["matmul_s"]
    return (r[f"{variant}_s"] - r["matmul_s"]) / comm if comm > 0 else float("nan")


VARIANTS = ("unfused", "sliced2", "sliced4", "fused")


def imbalance(lengths: list[int]) -> float:
    """The largest ratio of two ring neighbours' chunks, L_j / L_{j+-1} (cyclic): a ring step moves
    one chunk while the matmul of its neighbour's runs, so with uneven shards the step that
    moves the longest chunk beside the shortest has t_p / t_c this many times the per-row
    ratio (2 for 2:1 shards; infinite beside a zero-length chunk)."""
    n = len(lengths)
    pairs = [(lengths[j], lengths[(j + d) % n]) for j in range(n) for d in (1, -1)]
    return max((a / b if b else float("inf")) for a, b in pairs if a)


def measured_row_ratio(r: dict) -> float:
    """The measured per-row t_p / t_c: the unfused pair's communication per row moved (a padded
    ring step moves max(L) rows, P - 1 of them) over the matmul per row."""
    lengths = r["lengths"]
    per_row_p = (r["unfused_s"] - r["matmul_s"]) / ((len(lengths) - 1) * max(lengths))
    return per_row_p / (r["matmul_s"] / sum(lengths))


def exposure_interval(samples: dict[str, list[float]], variant: str = "fused", draws: int = 2000,
                      level: float = 0.90) -> tuple[float, float]:
    """How well one run determines a variant's exposed fraction: a `level` interval of
    (med v - med matmul) / (med unfused - med matmul) over bootstrap resamples of whole
    repetitions (each repetition's variants ran back to back, so a resample keeps them
    together; fixed seed). On this machine a one-thread matmul's time moves by 5-25% for
    seconds at a time (the host: the same matmul took 311-357 ms of CPU time in one run), so
    a case whose communication is small against its matmul has an interval wider than 0.15
    whatever the ring does."""
    import random

    reps = len(samples["matmul"])
    rng = random.Random(0)
    values = []
    for _ in range(draws):
        pick = [rng.randrange(reps) for _ in range(reps)]
        med = {v: statistics.median(samples[v][k] for k in pick) for v in ("matmul", "unfused", variant)}
        comm = med["unfused"] - med["matmul"]
        values.append((med[variant] - med["matmul"]) / comm if comm > 0 else float("inf"))
    values.sort()
    tail = (1.0 - level) / 2.0
    return values[int(tail * (draws - 1))], values[int((1.0 - tail) * (draws - 1))]


def measured_ratio(r: dict) -> float:
    """The measured t_p / t_c of the ring's worst step (the issue's "where t_p <= t_c" is per
    step): the per-row ratio times the shards' neighbour imbalance."""
    return measured_row_ratio(r) * imbalance(r["lengths"])


def analyse(r: dict, predicted: dict[str, float]) -> tuple[dict, list]:
    """The issue's record of one case (plus the model's and the measured t_p / t_c), and its
    printed row."""
    picked = min(VARIANTS, key=lambda v: predicted[v])
    fastest = min(VARIANTS, key=lambda v: r[f"{v}_s"])
    ok = r[f"{picked}_s"] <= 1.10 * r[f"{fastest}_s"]
    ratio = measured_ratio(r)
    interval = exposure_interval(r["samples"])
    record = {"name": r["name"], "kind": r["kind"], "matmul_s": r["matmul_s"], "unfused_s": r["unfused_s"],
              "sliced_s": {"2": r["sliced2_s"], "4": r["sliced4_s"]}, "fused_s": r["fused_s"],
              "predicted_fused_s": predicted["fused"], "picked": picked,
              "model_step_ratio": r.get("model_ratio"), "measured_step_ratio": ratio,
              "measured_row_ratio": measured_row_ratio(r), "fused_exposed_90": list(interval),
              "samples_s": r["samples"]}
    model_ratio = f"{r['model_ratio']:.2f}" if "model_ratio" in r else ""
    row = [r["name"], *(f"{r[v + '_s'] * 1e3:.1f}" for v in ("matmul", *VARIANTS)),
           f"{predicted['fused'] * 1e3:.1f}", *(f"{exposed(r, v):.2f}" for v in ("sliced2", "sliced4", "fused")),
           f"{interval[0]:.2f}..{interval[1]:.2f}", model_ratio, f"{ratio:.2f}", picked, fastest, "yes" if ok else "NO"]
    return record | {"_ok": ok, "_hidden": 0 < ratio <= 1.0, "_no_comm": ratio <= 0}, row


HEADER = ["case", "matmul ms", "unfused ms", "sliced2 ms", "sliced4 ms", "fused ms", "pred fused ms",
          "exp s2", "exp s4", "exp fused", "exp fused 90%", "t_p/t_c model", "t_p/t_c meas", "picked", "fastest", "ok"]


def summary(records: list[dict]) -> dict:
    """The acceptance figures of one run: where t_p <= t_c (measured), the largest fused exposure
    and in how many cases it is below both slicings'; the largest fused / unfused; the picks
    within 10% of the fastest. A case whose unfused pair measured no slower than the matmul alone
    has no communication to expose (its fraction is undefined): it is named, not counted."""
    hidden = [r for r in records if r["_hidden"]]
    exp = lambda r, v: ((r[v] if v == "fused_s" else r["sliced_s"][v]) - r["matmul_s"]) / max(
        r["unfused_s"] - r["matmul_s"], 1e-12)
    return {"hidden_cases": len(hidden), "no_comm_cases": [r["name"] for r in records if r["_no_comm"]],
            "hidden_fused_exposed_max": max((exp(r, "fused_s") for r in hidden), default=None),
            "hidden_fused_exposed_le_0.15": sum(exp(r, "fused_s") <= 0.15 for r in hidden),
            "hidden_fused_below_sliced": sum(exp(r, "fused_s") < min(exp(r, "2"), exp(r, "4")) for r in hidden),
            "fused_over_unfused_max": max(r["fused_s"] / r["unfused_s"] for r in records),
            "fused_over_unfused_gt_1.05": [r["name"] for r in records if r["fused_s"] > 1.05 * r["unfused_s"]],
            "picks_right": sum(r["_ok"] for r in records), "cases": len(records)}


def tensor_parallel_force(graph) -> dict[str, str]:
    """Megatron-style tensor-parallel MLPs, the residual stream split by batch: every fc1
    reads an all-gathered activation, every fc2's Partial is reduce-scattered."""
    linears = [n for n in graph.calls if n.target == "aten.linear.default"]
    force = {n.name: "S2" for n in linears if "fc1" in n.module_path}
    force |= {n.name: "P" for n in linears if "fc2" in n.module_path}
    return force | {n.name: "S0" for n in graph.calls if n.target == "aten.add.Tensor" and "blocks" in n.module_path}


def fused_count(plan) -> int:
    """How many of the plan's instructions are fused collective-matmuls."""
    return sum(i.kind in FUSED_MATMULS for i in plan.instructions)


def end_to_end(env: str, model_ref: str, workdir: Path, rounds: int,
               keep_trace: Path | None = None) -> tuple[dict, list]:
    """The planner's own plan when it fuses (else, a plan with forced tensor-parallel layouts in
    which the cost model chooses fusion per pair) against the same plan without fusion
    (planner.without_fusion), trained interleaved (runtime.compare): measured median step
    times beside the predictions; the fused plan's steps are also traced (per_instruction)."""
    import hetsynth
    from instruction_set.cluster import load_cluster
    from planner.planner import make_plan, without_fusion
    from planner.problem import Restrictions
    from runtime.launch import launch_checked

    spec_path = environment(env, workdir)
    spec = load_cluster(spec_path)
    graph = hetsynth.capture_measured(model_ref, cluster=spec)  # ops timed on the emulated devices
    own = make_plan(graph, spec, progress=False, with_baselines=False)
    own_fused = fused_count(own)
    if own_fused:
        fused, how = own, "the planner's own plan"
    else:
        fused, how = make_plan(graph, spec, progress=False, with_baselines=False,
                               restrictions=Restrictions(force=tensor_parallel_force(graph), two_level=False)), \
            "TP layouts forced, fusion by the cost model"
    count = fused_count(fused)
    if not count:
        raise SystemExit(f"the cost model fuses nothing in the tensor-parallel plan of {model_ref} on {env}")
    plain = without_fusion(fused)
    paths = {}
    for name, plan in (("fused", fused), ("unfused", plain)):
        paths[name] = workdir / f"{name}.json"
        hetsynth.save_plan(plan, paths[name])
    report, raw = workdir / "compare.json", workdir / "raw"
    raw.mkdir()
    raw.chmod(0o777)  # ranks of an emulated cluster may run as another user
    launch_checked(spec, ["-m", "runtime.compare", "--plans", str(paths["fused"]), str(paths["unfused"]),
                          "--names", "fused", "unfused", "--warmup", "2", "--rounds", str(rounds), "--steps", "2",
                          "--traced", "fused", "--trace-raw", str(raw), "--report", str(report)],
                   "end-to-end measurement")
    per_instruction(fused, raw, keep_trace or workdir / "trace.json")
    times = json.loads(report.read_text())
    for name in ("fused", "unfused"):
        print(name, "step seconds", [round(x, 3) for x in times[name]["step_seconds"]],
              "phases by rank", times[name]["phases_by_rank"])
    ratio = [f / u for f, u in zip(times["fused"]["step_seconds"], times["unfused"]["step_seconds"])]
    result = {"fused_s": times["fused"]["median_s"], "unfused_s": times["unfused"]["median_s"],
              "predicted_s": fused.predicted.step_time_s, "predicted_unfused_s": plain.predicted.step_time_s,
              "model": model_ref, "env": env, "plan": how, "fused_instructions": count,
              "fused_over_unfused_median": statistics.median(ratio), "steps": len(ratio),
              "device_scales": dict(graph.device_scales or {})}
    kinds = sorted({i.describe() for i in fused.instructions if i.kind in FUSED_MATMULS})[:2]
    row = [f"{model_ref} on {env}, {how}",
           f"{result['fused_s']:.3f}", f"{result['unfused_s']:.3f}",
           f"{result['predicted_s']:.3f}", f"{plain.predicted.step_time_s:.3f}",
           f"planner's own plan on this spec: {own_fused} fused instruction(s)"]
    print("fused instructions, e.g.:", *kinds, sep="\n  ")
    return result, row


def per_instruction(plan, raw: Path, trace: Path) -> None:
    """The fused plan's traced steps (runtime.compare --traced, interleaved with the timed ones):
    predicted against measured seconds per instruction (hetsynth.measured, as `hetsynth run
    --trace` writes them), kept in bench/results/overlap_e2e_instructions.json; prints the
    step's totals by kind and the instructions that differ most."""
    from hetsynth.measured import write_measured

    result = write_measured(plan, raw, trace)
    write_json("overlap_e2e_instructions.json", result)
    by_kind: dict[str, list[float]] = {}
    for row in result["instructions"]:
        acc = by_kind.setdefault(f"{row['kind']} ({row['lane']})", [0.0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + row["predicted_s"], acc[1] + row["measured_s"], acc[2] + 1
    rows = [[k, n, f"{p * 1e3:.1f}", f"{m * 1e3:.1f}"] for k, (p, m, n) in sorted(by_kind.items())]
    rows += [[g["name"], "", f"{g['predicted_s'] * 1e3:.1f}", f"{g['measured_s'] * 1e3:.1f}"] for g in result["bulk"]]
    rows.append(["step", "", f"{result['step']['predicted_s'] * 1e3:.1f}", f"{result['step']['measured_s'] * 1e3:.1f}"])
    print_table(rows, ["traced fused step: kind", "instructions", "predicted ms", "measured ms (slowest rank)"])
    worst = sorted(result["instructions"], key=lambda r: -abs(r["measured_s"] - r["predicted_s"]))[:10]
    print_table([[r["name"], r["kind"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}"] for r in worst],
                ["instruction", "kind", "predicted ms", "measured ms"])


E2E_HEADER = ["end to end", "fused s/step", "unfused s/step", "predicted fused", "predicted unfused", "note"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pilot", action="store_true", help="a few cases per environment; prints only")
    parser.add_argument("--envs", nargs="+", default=["inside", "across"])
    parser.add_argument("--reps", type=int, help="repetitions of every variant of every case (medians); "
                        f"default by environment {REPS} (at 7 a case's exposed fraction moved by 0.1-0.3 "
                        "between runs; across, at 15, a large case's by up to 0.27)")
    parser.add_argument("--only", nargs="+", help="only the cases whose name contains one of these; prints only")
    parser.add_argument("--trace", type=Path, help="also trace one more call of every variant (every rank's "
                        "matmul intervals) and write the raw records there; prints only, like --pilot")
    parser.add_argument("--e2e-only", action="store_true", help="only the end-to-end case (keeps the cases)")
    parser.add_argument("--no-e2e", action="store_true", help="the cases only (keeps the last end-to-end result)")
    parser.add_argument("--e2e-model", default=E2E_MODEL)
    parser.add_argument("--e2e-rounds", type=int, default=3)
    parser.add_argument("--e2e-env", default="across", choices=["inside", "across"])
    parser.add_argument("--e2e-trace", type=Path, help="keep the fused plan's measured trace (Chrome trace JSON) "
                        "there, its comparison beside it")
    args = parser.parse_args()
    if args.e2e_only:
        with tempfile.TemporaryDirectory() as tmp:
            result, row = end_to_end(args.e2e_env, args.e2e_model, Path(tmp), args.e2e_rounds, args.e2e_trace)
        print_table([row], E2E_HEADER)
        old = json.loads((RESULTS / "overlap.json").read_text())
        write_json("overlap.json", {"cases": old["cases"], "end_to_end": result})
        return
    rows, records, traces = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs:
            spec = environment(env, Path(tmp))
            model = Model(spec)
            todo = pilot_cases(env) if args.pilot else cases(env, model)
            todo = [c for c in todo if not args.only or any(o in c["name"] for o in args.only)]
            if not todo:
                continue
            measured = measure(spec, todo, args.reps or REPS[env], Path(tmp), trace=args.trace is not None)
            traces += measured
            for r in measured:
                record, row = analyse(r, model.predict(r))
                records.append(record)
                rows.append(row)
    print_table(rows, HEADER)
    print(markdown_table(rows, HEADER))
    s = summary(records)
    print(json.dumps(s))
    if args.trace:
        args.trace.write_text(json.dumps(traces))
    if args.pilot or args.trace or args.only:
        return
    cases_json = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
    old = RESULTS / "overlap.json"  # the end-to-end case is kept from the last run that made it until replaced
    e2e = json.loads(old.read_text()).get("end_to_end") if old.exists() else None
    write_json("overlap.json", {"cases": cases_json, "end_to_end": e2e})
    if not args.no_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            e2e, row = end_to_end(args.e2e_env, args.e2e_model, Path(tmp), args.e2e_rounds, args.e2e_trace)
        print_table([row], E2E_HEADER)
        write_json("overlap.json", {"cases": cases_json, "end_to_end": e2e})


if __name__ == "__main__":
    main()
