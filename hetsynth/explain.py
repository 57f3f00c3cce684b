"""`hetsynth explain plan.json --rank R`: one rank's generated program, readable.

Builds the rank's torch.fx program without any process group (parameters on the meta device)
and prints its Python code, the collectives it calls with their groups and shard lengths, and
the rank's shard table: every split tensor's local shape and where its slice starts.
"""

from __future__ import annotations

from hetsynth.report import table
from hetsynth.instruction_set.plan import Plan, PlanError
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.runtime.codegen import build_rank_program, local_shape
from hetsynth.runtime.groups import Groups


def shard_rows(plan: Plan, rank: int) -> list[list[str]]:
    mesh = plan.mesh
    rows = []
    for tensor, layouts in plan.shards.items():
        shape = plan.graph.node(tensor).outputs[0].shape
        for layout, dims in layouts.items():
            if not layout.is_shard:
                continue
            local = local_shape(plan, tensor, layout, rank, shape)
            placed = MeshLayout(mesh, layout)
            starts = ", ".join(f"dim {d} from {placed.offset(ls, d, rank)}" for d, ls in dims.items())
            rows.append([tensor, str(layout), str(list(shape)), str(list(local)), starts])
    return rows


def _precision_text(plan: Plan, kind: str) -> str:
    """What a device of `kind` computes in under the plan's policy, in words."""
    policy = plan.precision_policy()
    k = policy.of(kind)
    return (f"computes in {k.compute_dtype.value}{' with loss scaling' if k.loss_scaling else ''} "
            f"(master weights {policy.master_dtype}, gradients reduced in {policy.reduce_dtype})")


def explain(plan: Plan, rank: int) -> str:
    """Rank `rank`'s generated program and shard table, as text."""
    n = plan.cluster.num_devices
    if not 0 <= rank < n:
        raise PlanError(f"--rank {rank}: the plan has {n} ranks (0..{n - 1})")
    mesh = plan.mesh
    program = build_rank_program(plan, Groups.local_only(mesh, rank))
    device = plan.cluster.devices[rank]
    head = (f"rank {rank} of {n}: device {device.name} ({device.kind}), node {mesh.node(rank)}, "
            f"local index {mesh.local(rank)}, ratio {plan.sharding_ratios[rank]:.4f}, "
            f"{_precision_text(plan, device.kind)}")
    modules = [f"  {name}: {module}" for name, module in program.module.named_children()]
    params = [f"  {p.name} ({p.fqn}): {p.layout}, gradient sync: "
              f"{p.sync.describe() if p.sync else 'none'}" for p in program.params]
    return "\n".join([
        head, "", "generated program (torch.fx):", program.module.code.strip(), "",
        "collectives:", *modules, "", "parameters:", *params, "",
        "shard table:", table(shard_rows(plan, rank), ["tensor", "layout", "global", "local", "slice starts"]),
    ])
