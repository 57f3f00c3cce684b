"""Training with a plan on one rank: parameters, data, gradient sync, clipping, steps.

- Parameters come from the model's own initialisation under a fixed seed, built whole once
  and sliced per the plan; the whole copy is dropped after set-up.
- Data: the global batch of step s is samples [s * B, (s + 1) * B); a rank loads only its rows
  (the shard lengths of the input's layout), or all of them for replicated inputs.
- Gradients of parameters replicated along some axis are all-reduced along it in the plan's
  buckets, each launched asynchronously from the backward pass as soon as its gradients are
  ready, on process groups of its own, while the backward goes on (runtime.grad_sync); the
  step waits for them after the backward (its `gradient_sync` phase is that wait). SFB weights
  and sharded parameters need none.
- Clipping by the global norm: each element of the full model counts once (a replicated
  parameter only on the first rank of its replica group). When every parameter is replicated
  on every rank (data parallelism), each rank holds the whole synchronised gradient and
  computes the norm alone, with no all-reduce.
- The loss each rank computes is a Partial summand; the global loss is their all-reduced sum,
  issued asynchronously after the forward pass and waited at the end of the step.
- Buffers the forward updates (BatchNorm statistics, counters) are written after the backward
  pass with the new values the program returns (replicated: the same on every rank).
- A global loss or gradient norm that is not finite stops training at that step
  (NonFiniteError): every rank sees the same all-reduced values, so every rank stops there.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from instruction_set.layouts import Layout
from instruction_set.models import ModelSpec, parse_model_ref, with_dtype
from instruction_set.plan import Plan
from instruction_set.precision import float_everywhere, with_float_dtype
from instruction_set.shards import MeshLayout
from instruction_set.training_state import TrainingState
from runtime.codegen import RankProgram, build_rank_program
from runtime.config import TrainConfig
from runtime.grad_sync import BucketTiming, GradientSync
from runtime.input_rows import layout_rows
from runtime.groups import Groups
from runtime.zero import ZeroState


@dataclass
class StepLog:
    loss: float
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # this rank's seconds per phase
    buckets: list[BucketTiming] = field(default_factory=list)


@dataclass
class Trainer:
    plan: Plan
    spec: ModelSpec
    groups: Groups
    program: RankProgram
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's, whole
    log: list[StepLog] = field(default_factory=list)
    sync: GradientSync | None = None
    on_gradients: Callable[[], None] | None = None  # called once the gradients are synchronised
    zero: ZeroState | None = None  # the ZeRO-1 parameters' rows (runtime.zero)


class NonFiniteError(RuntimeError):
    """Training produced a loss or gradient norm that is not finite; the message names the step."""


def check_finite(step: int, **values: float) -> None:
    """NonFiniteError naming the step (1-based, as the step log counts) and each value of
    `values` (loss=..., gradient_norm=...) that is NaN or infinite."""
    bad = [f"the {name.replace('_', ' ')} is {value}" for name, value in values.items() if not math.isfinite(value)]
    if bad:
        raise NonFiniteError(f"step {step + 1}: {', '.join(bad)}; training stopped (a smaller --lr, or "
                             f"--max-grad-norm, may help; or the model or its data make it)")


class ModelMismatchError(ValueError):
    """The model built on a rank lacks a parameter or buffer of the plan, or holds it in another
    shape or dtype: the model changed since it was planned."""


def check_state(plan: Plan, state: dict[str, torch.Tensor]) -> None:
    """ModelMismatchError naming the first parameter or stored buffer of the plan's graph that
    the model built here (`state`, full_state's) lacks or holds in another shape or dtype. The
    launcher compares whole graphs before the ranks start (planner.model_check); this is the
    ranks' own check, for ranks started by hand on other machines."""
    for node in plan.graph.nodes:
        if node.op not in ("param", "buffer") or not node.fqn or node.value is not None:
            continue
        here = state.get(node.fqn)
        found = None if here is None else (tuple(here.shape), str(here.dtype).removeprefix("torch."))
        if found != (node.out.shape, node.out.dtype):
            what = "is missing" if found is None else f"is {found[0]} {found[1]}"
            raise ModelMismatchError(f"model {plan.model.ref!r} changed since it was planned: its {node.op} "
                                     f"{node.fqn!r} {what} here, {node.out.shape} {node.out.dtype} in the plan; "
                                     f"make a new plan (hetsynth plan)")


def full_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Whole parameters and buffers of the model, from its own initialisation."""
    return initial_state(spec, seed)[0]


def initial_state(spec: ModelSpec, seed: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """full_state and the names of the parameters among its entries (from the same module:
    a user's factory is not run again, on the meta device, to learn them)."""
    torch.manual_seed(seed)
    module = spec.build("cpu")
    params = dict(module.named_parameters(remove_duplicate=False))
    state = params | dict(module.named_buffers(remove_duplicate=False))
    return {k: v.detach() for k, v in state.items()}, set(params)


def make_optimizer(params: Sequence[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    trainable = [p for p in params if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(trainable, lr=config.lr, weight_decay=config.weight_decay)
    raise ValueError(f"optimizer {config.optimizer!r}: use adamw or sgd")


def setup(plan: Plan, groups: Groups, config: TrainConfig, device: torch.device | str = "cpu",
          spec: ModelSpec | None = None) -> Trainer:
    spec = spec or parse_model_ref(plan.model.ref)
    if config.dtype is not None:
        plan, spec = with_float_dtype(plan, config.dtype), with_dtype(spec, config.dtype)
    state, param_names = initial_state(spec, config.seed)
    check_state(plan, state)
    program = build_rank_program(plan, groups, state=state, device=device)
    buffers = {k: v for k, v in state.items() if k not in param_names}
    del state  # no rank keeps whole copies of the parameters
    sync = gradient_sync(plan, program, groups)
    zero = ZeroState.build(program.module, plan, groups, sync)
    params = list(program.module.parameters())
    optimizer = make_optimizer(zero.optimizer_params(params) if zero is not None else params, config)
    return Trainer(plan, spec, groups, program, optimizer, config, torch.device(device), buffers, sync=sync,
                   zero=zero)


def gradient_sync(plan: Plan, program: RankProgram, groups: Groups) -> GradientSync | None:
    """The plan's gradient buckets over a rank's program (None when no parameter needs a sync)."""
    buckets = plan.buckets()
    rows = plan.state_shards.rows if plan.state_shards is not None else None
    return GradientSync.build(program.module, buckets, groups, rows) if buckets else None


# -- data ---------------------------------------------------------------------------------------

def rank_rows(plan: Plan, tensor: str, layout: Layout, rank: int, batch: int) -> range:
    """The rows of the global batch this rank holds for an input in `layout`."""
    return layout_rows(plan, plan.mesh, tensor, layout, rank, batch)


def local_batch(trainer: Trainer, step: int) -> list[torch.Tensor]:
    plan, rank = trainer.plan, trainer.groups.rank
    batch = plan.model.batch_size
    names = [n.name for n in plan.graph.nodes if n.op == "input"]
    base = step * batch
    out = []
    for name, layout in trainer.program.inputs:
        rows = rank_rows(plan, name, layout, rank, batch)
        values = trainer.spec.make_batch([base + r for r in rows], seed=trainer.config.data_seed)
        out.append(values[names.index(name)].to(trainer.device))
    return out


# -- gradients ------------------------------------------------------------------------------------

def update_buffers(trainer: Trainer, values: Sequence[torch.Tensor]) -> None:
    """Write the forward's new buffer values (RankProgram.updates order) into the buffers."""
    module = trainer.program.module
    with torch.no_grad():
        for name, value in zip(trainer.program.updates, values, strict=True):
            getattr(module, name).copy_(value)


def counts_once(groups: Groups, layout: Layout) -> bool:
    """Whether this rank's copy of a parameter counts in global sums (first replica)."""
    return MeshLayout(groups.mesh, layout).counts_once(groups.rank)


def clip_global_norm(trainer: Trainer, max_norm: float) -> float:
    """clip_norm on a trainer's program."""
    return clip_norm(trainer.program, trainer.groups, trainer.zero, max_norm)


def clip_norm(program: RankProgram, groups: Groups, zero: ZeroState | None, max_norm: float) -> float:
    """Scale every gradient by max_norm / (||g|| + 1e-6) when that is below 1; returns ||g||.
    A ZeRO-2 gradient is held as rows (runtime.zero): each rank counts its own rows."""
    module = program.module
    zero3 = zero.zero3() if zero is not None else set()
    params = [(p, getattr(module, p.name).grad) for p in program.params if p.name not in zero3]
    rows = zero.row_grads() if zero is not None else []
    replicated = not rows and not any(p.layout.is_shard for p, _ in params)  # every rank holds every gradient
    counted = [g for p, g in params if g is not None and (replicated or counts_once(groups, p.layout))]
    counted += rows
    norms = torch._foreach_norm(counted, 2.0, dtype=torch.float64) if counted else []
    total = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), dtype=torch.float64)
    if not replicated:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=groups.group("all"))
    norm = float(total.sqrt())
    scale = max_norm / (norm + 1e-6)
    grads = [p.grad for n, p in module.named_parameters() if p.grad is not None and n not in zero3] + rows
    if scale < 1.0 and grads:
        torch._foreach_mul_(grads, scale)
    return norm


# -- steps ----------------------------------------------------------------------------------------

def precision(dtype: str | None) -> contextlib.AbstractContextManager:
    """Twins in another dtype compute everything in it (instruction_set.precision)."""
    return float_everywhere(dtype) if dtype is not None else contextlib.nullcontext()


def train_step(trainer: Trainer, step: int, inputs: list[torch.Tensor] | None = None) -> StepLog:
    """One training step on this rank's rows of global batch `step` (`inputs`: those rows,
    made in advance, as a prefetching data loader would)."""
    with precision(trainer.config.dtype):
        return _train_step(trainer, step, inputs)


def _train_step(trainer: Trainer, step: int, inputs: list[torch.Tensor] | None) -> StepLog:
    marks = [("start", time.perf_counter())]
    inputs = local_batch(trainer, step) if inputs is None else inputs
    marks.append(("data", time.perf_counter()))
    if trainer.sync is not None:
        trainer.sync.begin_step()
    gathers = trainer.program.gathers  # ZeRO-3: gathered parameters released after their use (runtime.zero3)
    with gathers.releasing() if gathers is not None else contextlib.nullcontext():
        loss, *new_buffers = trainer.program.module(*inputs)
    total = loss.detach().clone()
    loss_work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=trainer.groups.group("all"), async_op=True)
    marks.append(("forward", time.perf_counter()))
    loss.backward()
    update_buffers(trainer, new_buffers)
    marks.append(("backward", time.perf_counter()))
    buckets = trainer.sync.finish() if trainer.sync is not None else []
    marks.append(("gradient_sync", time.perf_counter()))
    if trainer.zero is not None:  # the leaves' gradients: views of the whole ones, or (ZeRO-2) the rows
        trainer.zero.before_step()
    if trainer.on_gradients is not None:
        trainer.on_gradients()
    if trainer.config.max_grad_norm is not None:
        norm = clip_global_norm(trainer, trainer.config.max_grad_norm)
        if not math.isfinite(norm):  # before the update; the loss names the cause when it is the culprit
            loss_work.wait()
            check_finite(step, loss=float(total), gradient_norm=norm)
    trainer.optimizer.step()
    if trainer.zero is not None:
        trainer.zero.after_step()
    _zero_unbucketed(trainer)
    marks.append(("update", time.perf_counter()))
    loss_work.wait()
    check_finite(step, loss=float(total))
    marks.append(("loss", time.perf_counter()))
    phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    entry = StepLog(float(total), marks[-1][1] - marks[0][1], phases, buckets)
    trainer.log.append(entry)
    return entry


def _zero_unbucketed(trainer: Trainer) -> None:
    """Drop the gradients the buckets do not hold (theirs are zeroed by begin_step)."""
    bucketed = trainer.sync.params if trainer.sync is not None else set()
    for p in trainer.program.module.parameters():
        if id(p) not in bucketed:
            p.grad = None


def local_parameters(trainer: Trainer) -> dict[str, tuple[str, torch.Tensor]]:
    """fqn -> (storage layout, this rank's slice), for reassembling whole parameters."""
    module = trainer.program.module
    return {p.fqn: (p.layout, getattr(module, p.name).detach().cpu()) for p in trainer.program.params}


def model_buffers(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model's buffers by name, whole: the program's (stored R, so whole on every rank,
    updated by training) over the initial values of those the graph does not read."""
    stored = stored_buffers(trainer.plan, trainer.program.module)
    return dict(trainer.buffers) | {fqn: b.detach().cpu() for fqn, b in stored.items()}


def stored_buffers(plan: Plan, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fqn -> the program's own tensor of every buffer the graph reads (stored R: whole on
    every rank, updated by training)."""
    return {node.fqn: getattr(module, node.name) for node in plan.graph.nodes
            if node.op == "buffer" and node.value is None and hasattr(module, node.name)}


def reference_training(spec: ModelSpec, batch_size: int, config: TrainConfig,
                       start: dict[str, Any] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training on one device with the plain model: losses and final parameters
    and buffers (by name). From `start`, a checkpoint (runtime.checkpoint's format), it
    trains the steps after the checkpoint's, from its parameters, buffers and optimizer state."""
    torch.manual_seed(config.seed)
    model = spec.build("cpu")
    optimizer = make_optimizer(list(model.parameters()), config)
    first = _start_from(model, optimizer, start) if start is not None else 0
    with precision(spec.dtype_override):
        losses = _reference_steps(spec, model, optimizer, batch_size, config, first)
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return losses, {k: v.detach() for k, v in state.items()}


def plan_reference(plan: Plan, config: TrainConfig,
                   start: dict[str, Any] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """reference_training of a plan's model (in config.dtype, converted, when it is set)."""
    spec = parse_model_ref(plan.model.ref)
    spec = with_dtype(spec, config.dtype) if config.dtype is not None else spec
    return reference_training(spec, plan.model.batch_size, config, start)


def _start_from(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> int:
    """A checkpoint's state in the plain model and its optimizer, cast to the model's dtype;
    returns the step it holds."""
    model.load_state_dict(ckpt["model"])
    named = dict(model.named_parameters(remove_duplicate=False))
    for fqn, state in ckpt["optimizer"]["state"].items():
        param = named[fqn]
        optimizer.state[param] = {k: v.to(param.dtype) if torch.is_tensor(v) and v.dim() > 0 else
                                  v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return int(ckpt["step"])


def _reference_steps(spec: ModelSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     batch_size: int, config: TrainConfig, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, config.steps):
        inputs = spec.make_batch(range(step * batch_size, (step + 1) * batch_size), seed=config.data_seed)
        loss = model(*inputs)
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def assemble(plan: Plan, per_rank: Sequence[dict[str, tuple[Layout, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's slices (replicated copies must agree)."""
    mesh = plan.mesh
    by_fqn = {n.fqn: n for n in plan.graph.params}
    zero3 = {i.tensor for i in plan.instructions if i.kind == "param" and i.state == TrainingState.ZERO3}
    out = {}
    for fqn, (layout, _) in per_rank[0].items():
        node = by_fqn[fqn]
        if node.name in zero3:  # every rank's rows, in rank order
            out[fqn] = torch.cat([params[fqn][1] for params in per_rank])
            continue
        full = torch.full(node.out.shape, float("nan"), dtype=per_rank[0][fqn][1].dtype)
        for rank, params in enumerate(per_rank):
            index = [slice(None)] * full.dim()
            if layout.is_shard:
                for dim, lengths in plan.lengths(node.name, layout).items():
                    start = MeshLayout(mesh, layout).offset(lengths, dim, rank)
                    index[dim] = slice(start, start + lengths[rank])
            full[tuple(index)] = params[fqn][1]
        out[fqn] = full
    return out


__all__ = ["Any", "ModelMismatchError", "NonFiniteError", "check_state", "TrainConfig", "Trainer", "assemble",
           "check_finite", "clip_global_norm", "clip_norm", "full_state", "initial_state", "local_batch",
           "local_parameters", "model_buffers", "reference_training", "gradient_sync", "setup", "stored_buffers", "train_step",
           "update_buffers"]
