"""Time a model on the devices of a cluster that runs on this machine (the emulated one).

Op timings taken on this machine (profiling.op_profile) scaled by the devices' matmul rates do
not predict an emulated device well: under a CPU quota a device loses its caches to the
other workers every period, and how much that costs depends on the model and the quota
(on a quarter CPU, VGG runs 5.8x slower than on this machine alone, where the matmul rates
say 4.6x; GPT and BERT within 3% of what the rates say). HAP profiles its ops on every device
type; this does the same for the whole model: every device trains its rows of the batch,
split in proportion to the profiled throughputs, forward and backward, all devices in lock-step
(each step starts on every device at once and the fast ones wait for the slowest, so that they
contend as in a synchronous training step: lockstep_seconds); this machine then trains the same
rows alone, and each device kind's factor is

    scale_k = mean over devices i of kind k of  seconds_i / reference_seconds(rows_i)

The same rows on both sides, so fixed per-step costs (Python, small-batch inefficiency) are
not extrapolated: a factor measured on a few rows is still a slowdown, not a per-row cost.
`time_on_cluster` launches the devices' part (runtime.launch: emulated when the spec asks and
root allows); profiling.measured times the reference rows and stores the factors as the
graph's device_scales, which then replace the matmul-rate ratio for every op of the model on
devices of that kind (cost_models.compute).

    python -m hetsynth.profiling.model_timing --model REF --cluster SPEC --output JSON   (under torchrun)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hetsynth.instruction_set.cluster import ClusterSpec, dump_cluster_toml, load_cluster
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.shards import largest_remainder
from hetsynth.runtime.rank import run_rank


def time_on_cluster(ref: str, cluster: ClusterSpec, seconds: float = 1.0) -> list[dict]:
    """Per device of `cluster`: {name, kind, rows, batch, seconds}, the sustained seconds of
    the model's forward and backward on its rows, measured on the device with all devices
    busy (see the module docstring)."""
    from hetsynth.runtime.launch import launch_checked, recorded_run

    with recorded_run() as (_, tmp):
        spec_path, out = tmp / "cluster.toml", tmp / "timing.json"
        spec_path.write_text(dump_cluster_toml(cluster))
        launch_checked(cluster, ["-m", "hetsynth.profiling.model_timing", "--model", ref, "--cluster", str(spec_path),
                                 "--output", str(out), "--seconds", str(seconds)],
                       f"timing {ref} on the devices of {cluster.name!r}")
        return json.loads(out.read_text())["devices"]


def device_scales(records: list[dict], reference_s: dict[int, float]) -> dict[str, float]:
    """Per kind: the mean over its devices of seconds / reference_s[rows] (devices without
    rows tell nothing)."""
    by_kind: dict[str, list[float]] = {}
    for r in records:
        if r["rows"] > 0:
            by_kind.setdefault(r["kind"], []).append(r["seconds"] / reference_s[r["rows"]])
    return {kind: statistics.mean(values) for kind, values in by_kind.items()}


def device_rows(cluster: ClusterSpec, batch: int) -> list[int]:
    """Rows per device in proportion to the profiled throughputs (DP-CP's split)."""
    from hetsynth.planner.baselines import proportional

    return largest_remainder(proportional(cluster), batch)


PERIODS_PER_SAMPLE = 5  # a timed sample spans at least this many of the emulation's CPU-quota periods


def lockstep_seconds(module: torch.nn.Module, inputs: list[torch.Tensor] | None, seconds: float,
                     sample_s: float) -> float:
    """This device's seconds of the model's forward and backward on its rows, timed as a
    synchronous training step runs it:

        t_i = median over samples s of (seconds of sample s on device i) / k

    every sample started on all devices at once (a barrier), so a device that finishes early
    waits, idle, for the slowest, as in training; devices running their rows free, back to back,
    would all be busy for the whole timing, more contention than a step has (on
    local-emulated.toml it made GPT small-cpu's slow devices 4.8x this machine and the predicted
    steps 10-15% long). A sample is k steps, k the least that makes the slowest device's sample
    last `sample_s` (a few CPU-quota periods: a device under a quota runs until its quota for
    the period is spent and waits out the rest, so a shorter sample may or may not pay that
    wait). At least 5 samples and about 3 `seconds` of the slowest device's time; the counts are
    agreed by an all-reduce, so that every device takes as many barriers. 0.0 for a device
    without rows (it only keeps step)."""
    def step() -> None:
        if inputs is not None:
            module(*inputs).backward()
            module.zero_grad(set_to_none=True)

    step()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    step()
    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    longest = max(float(slowest), 1e-6)
    per_sample = max(1, math.ceil(sample_s / longest))
    samples = []
    for _ in range(max(5, math.ceil(3 * seconds / (per_sample * longest)))):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_sample):
            step()
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples) if inputs is not None else 0.0


def time_rows(rank: int, args: argparse.Namespace) -> None:
    from hetsynth.instruction_set.models import parse_model_ref

    cluster = load_cluster(args.cluster)
    spec = parse_model_ref(args.model)
    rows = device_rows(cluster, spec.batch_size)
    start, mine = sum(rows[:rank]), rows[rank]
    torch.manual_seed(0)
    module = spec.build("cpu")
    inputs = spec.make_batch(range(start, start + mine), seed=1) if mine > 0 else None
    period_s = (cluster.emulation.period_us if cluster.emulation is not None else 10_000) / 1e6
    seconds = lockstep_seconds(module, inputs, args.seconds, PERIODS_PER_SAMPLE * period_s)
    device = cluster.devices[rank]
    record = {"name": device.name, "kind": device.kind, "rows": mine, "batch": spec.batch_size, "seconds": seconds}
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(record, gathered, dst=0)
    if rank == 0:
        write_atomic(args.output, json.dumps({"model": args.model, "devices": gathered}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetsynth.profiling.model_timing")
    p.add_argument("--model", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="the timing takes about three times this (lockstep_seconds)")
    args = p.parse_args(argv)
    return run_rank(lambda rank, device: time_rows(rank, args), timeout_s=600, device=torch.device("cpu"))


if __name__ == "__main__":
    sys.exit(main())
