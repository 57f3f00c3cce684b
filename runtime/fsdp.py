"""torch's FSDP2 (`torch.distributed.fsdp.fully_shard`, ZeRO-3 with even shards) on the plain
model: the baseline users reach for when a data-parallel replica does not fit a device.

The same model, initialisation (seed), data, optimizer and global-norm clipping as
`runtime.train`, with rank i holding rows `rows[i]` of the global batch. Every `nn.ModuleList`
member (a transformer's blocks) is its own FSDP unit, then the root: each unit's parameters are
all-gathered for its forward and again for its backward and freed after, and its gradients are
reduce-scattered, on a one-dimensional CPU device mesh over the group (gloo). Every rank holds
1/W of every parameter, gradient and optimizer state whatever its speed or memory: the shards
are even, so the smallest device bounds the model.

`checkpoint=True` adds activation checkpointing to every unit (torch's composable
`checkpoint`, applied before `fully_shard` as torchtitan does): a block keeps only its input
for backward and recomputes its forward there, trading about one more forward for the
activations of all but one block.

Rows and loss weights. `even_rows` splits the batch evenly (FSDP2 as users run it);
`proportional_rows` splits it in proportion to each rank's throughput (largest remainder), and
then each rank backpropagates w_i L_i with w_i = W N_i / N, exactly as runtime.ddp's weighted
mode: FSDP2's reduce-scatter averages over the W ranks like DDP's all-reduce, so
g = (1/W) sum_i w_i grad L_i = grad (1/N) sum_k l_k, the gradient of the global batch. The trainer
is runtime.ddp's (DDPTrainer, its module fully_shard'ed): the same rows, loss count, weight,
clipping and update.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hetsynth.instruction_set.models import ModelSpec
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.ddp import DDPSetupError, DDPTrainer
from hetsynth.runtime.train import host_built, make_optimizer


def even_rows(batch: int, world: int) -> list[int]:
    """`batch` rows over `world` ranks, the first `batch % world` ranks one more."""
    return [batch // world + (r < batch % world) for r in range(world)]


def proportional_rows(batch: int, weights: Sequence[float]) -> list[int]:
    """`batch` rows in proportion to `weights` (largest remainder), at least one per rank."""
    total = sum(weights)
    exact = [batch * w / total for w in weights]
    rows = [max(1, int(x)) for x in exact]
    order = sorted(range(len(rows)), key=lambda r: rows[r] - exact[r])
    while sum(rows) < batch:
        rows[order.pop(0) if order else 0] += 1
    if sum(rows) != batch:
        raise DDPSetupError(f"cannot give {batch} rows to {len(rows)} ranks with at least one each "
                            f"(weights {list(weights)})")
    return rows


def shard_units(model: nn.Module, mesh: DeviceMesh, *, checkpoint: bool) -> nn.Module:
    """fully_shard every ModuleList member (checkpointed first when asked), then the root."""
    from torch.distributed._composable import checkpoint as checkpointed

    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for unit in module:
                if checkpoint:
                    checkpointed(unit)
                fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_setup(spec: ModelSpec, rows: Sequence[int], config: TrainConfig, *, group: Any, rank: int,
               weighted: bool, checkpoint: bool) -> DDPTrainer:
    """Build the plain model from seed `config.seed` and shard it over `group` (on CPU)."""
    rows = tuple(int(r) for r in rows)
    if min(rows) < 1:
        raise DDPSetupError(f"the FSDP2 baseline needs at least one row per rank; rows {list(rows)}")
    world = dist.get_world_size(group)
    if len(rows) != world:
        raise DDPSetupError(f"rows {list(rows)} name {len(rows)} ranks; the group has {world}")
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(config.seed)
    model = shard_units(host_built(spec), mesh, checkpoint=checkpoint)  # fully_shard copies each rank's shards
    optimizer = make_optimizer(list(model.parameters()), config)
    return DDPTrainer(model, optimizer, spec, rows, weighted, config, group, rank, torch.device("cpu"))


def fsdp_parameters(t: DDPTrainer) -> dict[str, torch.Tensor]:
    """The model's whole parameters (gathered from the shards; collective), by fqn."""
    return {k: v.full_tensor().detach().cpu() for k, v in t.module.named_parameters(remove_duplicate=False)}


__all__ = ["even_rows", "fsdp_parameters", "fsdp_setup", "proportional_rows", "shard_units"]
