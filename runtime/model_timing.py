"""Time a model on the devices of a cluster that runs on this machine (the emulated one).

Op timings taken on this machine (planner.op_profile) scaled by the devices' matmul rates do
not predict an emulated device well: under a CPU quota a device loses its caches to the
other workers every period, and how much that costs depends on the model and the quota
(VGG's convolutions on a quarter CPU run 1.5x slower than a quarter of this machine's matmul
rate says; the same quota costs GPT about 1.1x). HAP profiles its ops on every device type;
this does the same for the whole model: every device trains its rows of the batch, split in
proportion to the profiled throughputs, forward and backward, all devices at once (so that
they contend as in training), and each device kind's time is extrapolated to the whole
batch:

    full_k = mean over devices i of kind k of  seconds_i * batch / rows_i

`time_on_cluster` launches it (runtime.launch: emulated when the spec asks and root allows)
and returns full_k per kind; hetsynth.capture_measured turns that into the graph's
device_scales (full_k / this machine's time for the whole model), which then replace the
matmul-rate ratio for every op of the model on devices of that kind (cost_models.compute).

    python -m runtime.model_timing --model REF --cluster SPEC --output JSON   (under torchrun)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from cost_models.cluster import ClusterSpec, dump_cluster_toml, load_cluster
from instruction_set.shards import largest_remainder
from runtime.rank import run_rank


def time_on_cluster(ref: str, cluster: ClusterSpec, seconds: float = 1.0) -> dict[str, float]:
    """Seconds of the model's forward and backward on its whole batch, per device kind of
    `cluster`, measured on the devices (see the module docstring)."""
    from runtime.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "cluster.toml", Path(tmp) / "timing.json"
        spec_path.write_text(dump_cluster_toml(cluster))
        rc, failure = launch(cluster, ["-m", "runtime.model_timing", "--model", ref, "--cluster", str(spec_path),
                                       "--output", str(out), "--seconds", str(seconds)])
        if rc != 0:
            raise RuntimeError(f"timing {ref} on the devices of {cluster.name!r} failed: "
                               f"{failure.rank if failure else '?'} ({failure.why if failure else f'exit status {rc}'})")
        records = json.loads(out.read_text())["devices"]
    return full_batch_seconds(records)


def full_batch_seconds(records: list[dict]) -> dict[str, float]:
    """Per kind: the mean over its devices of seconds * batch / rows (devices without rows
    tell nothing)."""
    by_kind: dict[str, list[float]] = {}
    for r in records:
        if r["rows"] > 0:
            by_kind.setdefault(r["kind"], []).append(r["seconds"] * r["batch"] / r["rows"])
    return {kind: statistics.mean(values) for kind, values in by_kind.items()}


def device_rows(cluster: ClusterSpec, batch: int) -> list[int]:
    """Rows per device in proportion to the profiled throughputs (DP-CP's split)."""
    rates = cluster.throughputs_flops()
    return largest_remainder([r / sum(rates) for r in rates], batch)


def time_rows(rank: int, args: argparse.Namespace) -> None:
    from hetsynth.models import parse_model_ref
    from planner.op_profile import model_seconds

    cluster = load_cluster(args.cluster)
    spec = parse_model_ref(args.model)
    rows = device_rows(cluster, spec.batch_size)
    start, mine = sum(rows[:rank]), rows[rank]
    torch.manual_seed(0)
    module = spec.build("cpu")
    inputs = spec.make_batch(range(start, start + mine), seed=1) if mine > 0 else None
    dist.barrier()  # every device times at once
    seconds = model_seconds(module, inputs, args.seconds) if inputs is not None else 0.0
    device = cluster.devices[rank]
    record = {"name": device.name, "kind": device.kind, "rows": mine, "batch": spec.batch_size, "seconds": seconds}
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(record, gathered, dst=0)
    if rank == 0:
        Path(args.output).write_text(json.dumps({"model": args.model, "devices": gathered}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="runtime.model_timing")
    p.add_argument("--model", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="time per sustained measurement (three are taken)")
    args = p.parse_args(argv)
    return run_rank(lambda rank, device: time_rows(rank, args), timeout_s=600, device=torch.device("cpu"))


if __name__ == "__main__":
    sys.exit(main())
