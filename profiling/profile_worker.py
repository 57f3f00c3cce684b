"""One rank of `hetsynth profile`, started by torchrun (`python -m hetsynth.profiling.profile_worker`).

Every rank measures its compute, then all ranks time the collectives on all ranks, on each
node's ranks and on the cross-node groups of one rank per node, all groups at once
(profiling.profiler), then the compute an asynchronous all-reduce takes from each rank
(profiling.overlap); rank 0 fits alpha-beta and writes the measured spec.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch
import torch.distributed as dist

from hetsynth.runtime.quick_exit import freeze_at_exit
from hetsynth.instruction_set.cluster import dump_cluster_toml, load_cluster
from hetsynth.instruction_set.files import write_atomic
from hetsynth.instruction_set.mesh import Mesh
from hetsynth.profiling.overlap import p2p_cpu_rows, transfer_cpu_rows
from hetsynth.profiling.profiler import measure_collectives, measure_compute, measured_spec
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.rank import run_rank

log = logging.getLogger("hetsynth.profiling.profile_worker")  # runs as __main__ under torchrun


OUTER_SKEWS = [None]  # outer groups of two nodes; their shares follow node sums


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    p = argparse.ArgumentParser(prog="hetsynth.profiling.profile_worker")
    p.add_argument("--cluster", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--seconds", type=float, default=1.0, help="time per compute measurement")
    p.add_argument("--reps", type=int, default=3, help="repetitions per collective measurement")
    p.add_argument("--max-bytes", type=int, default=16 * 2**20)
    p.add_argument("--records", help="write the collective measurements here (JSON, by link class)")
    args = p.parse_args(argv)
    return run_rank(lambda rank, device: profile(rank, device, args), timeout_s=600)


def profile(rank: int, device: torch.device, args: argparse.Namespace) -> None:
    """Measure this rank's compute and, with all ranks, the collectives; rank 0 writes the spec."""
    cluster = load_cluster(args.cluster)
    mesh = Mesh.of([len(n.devices) for n in cluster.nodes])
    groups = Groups.create(mesh, rank, world=dist.group.WORLD)
    compute = measure_compute(device, args.seconds)
    # up to 16 MiB by default (gradient buckets, big activations): below a few MiB a shaped
    # link passes its burst at line rate, and a fit on small messages alone promises too much
    sizes = [s for s in (64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20) if s <= args.max_bytes]
    records = {("inter" if len(cluster.nodes) > 1 else "intra"): measure_collectives(groups, "all", sizes, device, args.reps)}
    if mesh.two_level:
        records["intra"] = measure_collectives(groups, "inner", sizes, device, args.reps)
        records["outer"] = measure_collectives(groups, "outer", sizes, device, args.reps, OUTER_SKEWS)
    compute["transfer_cpu_rows"] = transfer_cpu_rows(groups.group("all"), device)
    compute["p2p_cpu_rows"] = p2p_cpu_rows(cluster.rank_nodes(), rank, device)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(compute, gathered, dst=0)
    if rank == 0:
        spec = measured_spec(cluster, gathered, records)
        if args.records:
            write_atomic(args.records, json.dumps(records))
        write_atomic(args.output, f"# measured by hetsynth profile from {args.cluster}\n" + dump_cluster_toml(spec))
        for d, c in zip(cluster.devices, gathered):
            log.info("%-12s %-10s %8.2f GFLOP/s  %6.2f GB/s  launch %6.1f us  compute lost to transfers "
                     "in flight (messages, transfer ms, lost ms): %s", d.name, d.kind, c["throughput_flops"] / 1e9,
                     c["memory_bandwidth_gbyte_s"], c["kernel_launch_us"],
                     ", ".join(f"({k}, {s * 1e3:.1f}, {x * 1e3:.1f})" for k, s, x in c["transfer_cpu_rows"]))
            log.info("%-12s matmul GFLOP/s by dtype: %s", d.name,
                     ", ".join(f"{k} {v / 1e9:.2f}" for k, v in c.get("matmul_flops", {}).items()))
            log.info("%-12s point-to-point: %s", d.name,
                     ", ".join(f"({k}, {s * 1e3:.1f}, {x * 1e3:.1f})" for k, s, x in c["p2p_cpu_rows"]) or "none")
        for name, kind in spec.device_kinds.items():
            log.info("%-10s transfers take %.2f of their time + %.0f us per message", name,
                     kind.transfer_cpu_share, kind.transfer_cpu_us_per_message)
            if kind.p2p_cpu_share is not None:
                log.info("%-10s point-to-point: %.2f of their time + %.0f us per message", name,
                         kind.p2p_cpu_share, kind.p2p_cpu_us_per_message)


if __name__ == "__main__":
    sys.exit(main())
