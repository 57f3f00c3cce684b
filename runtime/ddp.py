"""torch's own DistributedDataParallel on the plain model: the baseline users actually run.

The same model, initialisation (seed), data, optimizer and global-norm clipping as
`runtime.train`, with rank i holding rows `rows[i]` of the global batch, on torch's DDP with its
defaults (25 MiB buckets, a small first bucket, all-reduce launched from autograd hooks as
buckets fill, in reverse order of use), as a user runs it. We do not reimplement DDP: this
module only gives it the rows and, for uneven rows, the loss weights.

Loss weights with uneven batches (`weighted=True`, DDP-CP). Rank i holds N_i of the N terms the
global loss averages and computes L_i = (1/N_i) sum_{k in i} l_k. DDP averages gradients over
the W ranks, g = (1/W) sum_i g_i, so each rank backpropagates

    w_i L_i,   w_i = W N_i / N     =>   g = sum_i (N_i / N) grad L_i = grad (1/N) sum_k l_k,

the gradient of the global batch. N_i is counted by `loss_terms`: the elements of the last
integer input (the labels) that are not -100 (cross-entropy's ignore_index), or the rows when
there is no integer input. This is exact for a loss that is a mean over those terms (GPT, BERT
with masked labels, ViT, VGG); MoE's load-balancing term is a per-batch statistic that no
weighting of per-rank losses reproduces. With `weighted=False` (DDP-EV, even rows) every rank
backpropagates its own mean, as users run DDP: the same as the global batch whenever every rank
has the same N_i.

The reported loss of a step is the global one, sum_i N_i L_i / N, all-reduced asynchronously
under the backward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetsynth.instruction_set.models import ModelSpec
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.train import StepLog, build_on_host, make_optimizer

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


class DDPSetupError(ValueError):
    """A DDP baseline that cannot run as asked; the message carries the numbers."""


@dataclass
class DDPTrainer:
    """torch's own data parallelism on this rank's rows (see the module docstring): `module` is
    DDP-wrapped here, or fully_shard'ed (FSDP2, runtime.fsdp); `make_batch(step)` and
    `step(step, inputs)` as `runtime.train`'s trainer."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    spec: ModelSpec
    rows: tuple[int, ...]
    weighted: bool
    config: TrainConfig
    group: Any
    rank: int
    device: torch.device
    log: list[StepLog] = field(default_factory=list)

    def make_batch(self, step: int) -> list[torch.Tensor]:
        start = step * sum(self.rows) + sum(self.rows[:self.rank])
        ids = range(start, start + self.rows[self.rank])
        return [t.to(self.device) for t in self.spec.make_batch(ids, seed=self.config.data_seed)]

    def step(self, step: int, inputs: Sequence[torch.Tensor] | None = None) -> StepLog:
        return ddp_step(self, step, inputs)


def loss_terms(inputs: Sequence[torch.Tensor]) -> int:
    """N_i: the loss terms of a rank's rows (module docstring)."""
    labels = [t for t in inputs if not t.is_floating_point() and not t.is_complex()]
    if not labels:
        return int(inputs[0].shape[0])
    return int((labels[-1] != IGNORE_INDEX).sum())


def ddp_setup(spec: ModelSpec, rows: Sequence[int], config: TrainConfig, *, group: Any, rank: int,
              weighted: bool, device: torch.device | str = "cpu") -> DDPTrainer:
    """Build the plain model from seed `config.seed` and wrap it in DDP over `group`."""
    rows = tuple(int(r) for r in rows)
    if min(rows) < 1:
        raise DDPSetupError(f"the DDP baseline needs at least one row per rank; rows {list(rows)} "
                            f"(DDP averages every rank's mean loss, and the mean of no rows is NaN)")
    if len(rows) != dist.get_world_size(group):
        raise DDPSetupError(f"rows {list(rows)} name {len(rows)} ranks; the group has {dist.get_world_size(group)}")
    torch.manual_seed(config.seed)
    model = build_on_host(spec, device)
    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = make_optimizer(list(ddp.parameters()), config)
    return DDPTrainer(ddp, optimizer, spec, rows, weighted, config, group, rank, torch.device(device))


def ddp_step(t: DDPTrainer, step: int, inputs: Sequence[torch.Tensor] | None = None) -> StepLog:
    """One step of DDP training on this rank's rows; phases as runtime.train (DDP waits for its
    last bucket inside the backward pass, so there is no separate gradient_sync phase)."""
    marks = [("start", time.perf_counter())]
    inputs = t.make_batch(step) if inputs is None else list(inputs)
    marks.append(("data", time.perf_counter()))
    mine = float(loss_terms(inputs))
    count = torch.tensor([mine], dtype=torch.float64)
    count_work = dist.all_reduce(count, group=t.group, async_op=True)
    loss = t.module(*inputs)
    total = loss.detach().double().reshape(1) * mine
    loss_work = dist.all_reduce(total, group=t.group, async_op=True)
    marks.append(("forward", time.perf_counter()))
    count_work.wait()
    scale = len(t.rows) * mine / float(count) if t.weighted else 1.0
    (loss * scale if scale != 1.0 else loss).backward()
    marks.append(("backward", time.perf_counter()))
    if t.config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(t.module.parameters(), t.config.max_grad_norm)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    marks.append(("update", time.perf_counter()))
    loss_work.wait()
    marks.append(("loss", time.perf_counter()))
    phases = {name: m - marks[i][1] for i, (name, m) in enumerate(marks[1:])}
    entry = StepLog(float(total) / float(count), marks[-1][1] - marks[0][1], phases)
    t.log.append(entry)
    return entry


def ddp_parameters(t: DDPTrainer) -> dict[str, torch.Tensor]:
    """The model's whole parameters (every rank holds them all), by fqn."""
    return {k: v.detach().cpu() for k, v in t.module.module.named_parameters(remove_duplicate=False)}


__all__ = ["DDPSetupError", "DDPTrainer", "ddp_parameters", "ddp_setup", "ddp_step", "loss_terms"]
