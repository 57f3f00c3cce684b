"""`hetsynth run`'s recipe: a training loop over runtime.parallel's module (the one
`hetsynth.parallelize` gives a user's loop), with the model's own initialisation and data.

- Parameters come from the model's own initialisation under a fixed seed, built whole once
  and sliced per the plan by the module; the whole copy is dropped after set-up.
- Data: the global batch of step s is samples [s * B, (s + 1) * B); a rank makes only its rows
  of each input (runtime.input_rows), or all of them for replicated inputs.
- The step is a user's loop: forward, backward (the module syncs the plan's gradient buckets,
  overlapped with the backward, and gives ZeRO leaves their rows), clipping by the global
  norm (runtime.rank_state.clip_norm), the optimizer's step; under the plan's precision
  policy, torch's AMP recipe with the module's loss scaler (runtime.mixed_precision: an
  overflow on any rank skips the step on every rank). Its phases are timed: data,
  forward, backward (until the backward pass is done), gradient_sync (the wait for the buckets
  left), update (clipping, the step, and the ZeRO gather it makes due), loss.
- The loss each rank computes is a Partial summand; the global loss is their all-reduced sum,
  issued asynchronously after the forward pass and waited at the end of the step.
- A global loss or gradient norm that is not finite stops training at that step
  (NonFiniteError): every rank sees the same all-reduced values, so every rank stops there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.models import ModelSpec, parse_model_ref, with_dtype
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.precision import with_float_dtype
from hetsynth.runtime.codegen import RankProgram
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.emulation import host_memory
from hetsynth.runtime.grad_sync import BucketTiming, GradientSync
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.input_rows import layout_rows
from hetsynth.runtime.mixed_precision import reference_dtype
from hetsynth.runtime.parallel import ParallelModule
from hetsynth.runtime.rank_state import clip_norm, precision, stored_buffers
from hetsynth.runtime.zero import ZeroState


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
    module: ParallelModule
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's, whole
    log: list[StepLog] = field(default_factory=list)
    on_gradients: Callable[[], None] | None = None  # called once the gradients are synchronised

    @property
    def program(self) -> RankProgram:
        """The module's program (runtime.timing swaps in a timed copy for traced steps)."""
        return self.module.program

    @program.setter
    def program(self, program: RankProgram) -> None:
        self.module.use_program(program)

    @property
    def sync(self) -> GradientSync | None:
        return self.module.sync

    @property
    def zero(self) -> ZeroState | None:
        """The ZeRO parameters' rows (runtime.zero)."""
        return self.module.zero


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
    module = host_built(spec)  # each rank places its part
    params = dict(module.named_parameters(remove_duplicate=False))
    state = params | dict(module.named_buffers(remove_duplicate=False))
    return {k: v.detach() for k, v in state.items()}, set(params)


def host_built(spec: ModelSpec) -> torch.nn.Module:
    """The whole model from its factory, built in the host's memory, not the device's
    (runtime.emulation.host_memory)."""
    with host_memory():
        return spec.build("cpu")


def build_on_host(spec: ModelSpec, device: torch.device | str) -> torch.nn.Module:
    """host_built(spec) placed on `device`: a copy of every parameter and buffer, as
    `.to("cuda")` makes, also on the CPU (where `.to("cpu")` would return the host's tensors
    themselves) so the device holds its own."""
    placed = host_built(spec).to(device)
    if torch.device(device).type == "cpu":
        for t in (*placed.parameters(), *placed.buffers()):
            t.data = t.data.clone()
    return placed


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
    module = ParallelModule(plan, groups, state, {k: k for k in state}, torch.device(device), config.dtype)
    buffers = {k: v for k, v in state.items() if k not in param_names}
    del state  # no rank keeps whole copies of the parameters
    optimizer = make_optimizer(list(module.parameters()), config)
    return Trainer(plan, spec, groups, module, optimizer, config, torch.device(device), buffers)


# -- data ---------------------------------------------------------------------------------------

def rank_rows(plan: Plan, tensor: str, layout: Layout, rank: int, batch: int) -> range:
    """The rows of the global batch this rank holds for an input in `layout`."""
    return layout_rows(plan, plan.mesh, tensor, layout, rank, batch)


def local_batch(trainer: Trainer, step: int) -> list[torch.Tensor]:
    """This rank's rows of every input of global batch `step` (the module's forward's)."""
    return batch_rows(trainer.spec, trainer.module.rows, step * trainer.plan.model.batch_size,
                      trainer.config.data_seed, trainer.device)


def batch_rows(spec: ModelSpec, rows: Sequence[Sequence[int]], base: int, seed: int,
               device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Input i's rows rows[i] of the model's generated batch starting at sample `base`."""
    made: dict[tuple[int, ...], list[torch.Tensor]] = {}  # inputs read in the same rows: one make_batch
    out = []
    for i, wanted in enumerate(rows):
        key = tuple(wanted)
        if key not in made:
            made[key] = spec.make_batch([base + r for r in wanted], seed=seed)
        out.append(made[key][i].to(device))
    return out


# -- steps ----------------------------------------------------------------------------------------

def clip_global_norm(trainer: Trainer, max_norm: float) -> float:
    """clip_norm on a trainer's program."""
    return clip_norm(trainer.program, trainer.groups, trainer.zero, max_norm)


def train_step(trainer: Trainer, step: int, inputs: list[torch.Tensor] | None = None) -> StepLog:
    """One training step on this rank's rows of global batch `step` (`inputs`: those rows,
    made in advance, as a prefetching data loader would)."""
    with precision(trainer.config.dtype):
        return _train_step(trainer, step, inputs)


def _train_step(trainer: Trainer, step: int, inputs: list[torch.Tensor] | None) -> StepLog:
    module = trainer.module
    marks = [("start", time.perf_counter())]
    inputs = local_batch(trainer, step) if inputs is None else inputs
    marks.append(("data", time.perf_counter()))
    loss = module(*inputs)
    total = loss.detach().clone()
    loss_work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=trainer.groups.group("all"), async_op=True)
    marks.append(("forward", time.perf_counter()))
    scaler = module.scaler
    scaler.scale(loss).backward()
    marks.append(("backward", module.backward_done_s))
    marks.append(("gradient_sync", time.perf_counter()))
    if trainer.on_gradients is not None:
        trainer.on_gradients()
    if trainer.config.max_grad_norm is not None:
        scaler.unscale_(trainer.optimizer)
        norm = clip_global_norm(trainer, trainer.config.max_grad_norm)
        if not math.isfinite(norm) and not scaler.is_enabled():  # a scaler skips the step instead
            loss_work.wait()  # before the update; the loss names the cause when it is the culprit
            check_finite(step, loss=float(total), gradient_norm=norm)
    scaler.step(trainer.optimizer)
    scaler.update()
    module.flush()  # the ZeRO gather the step made due, timed as part of the update
    _zero_unbucketed(trainer)
    marks.append(("update", time.perf_counter()))
    loss_work.wait()
    check_finite(step, loss=float(total))
    marks.append(("loss", time.perf_counter()))
    phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    entry = StepLog(float(total), marks[-1][1] - marks[0][1], phases, module.bucket_timings)
    trainer.log.append(entry)
    return entry


def _zero_unbucketed(trainer: Trainer) -> None:
    """Drop the gradients the buckets do not hold (theirs are zeroed when the next gradient
    cycle begins)."""
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


def reference_training(spec: ModelSpec, batch_size: int, config: TrainConfig,
                       start: dict[str, Any] | None = None,
                       autocast_dtype: torch.dtype | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training on one device with the plain model: losses and final parameters
    and buffers (by name). From `start`, a checkpoint (runtime.checkpoint's format), it
    trains the steps after the checkpoint's, from its parameters, buffers and optimizer state.
    `autocast_dtype`: forward passes under torch.autocast of that type (a precision policy's
    stand-in, runtime.mixed_precision.reference_dtype)."""
    torch.manual_seed(config.seed)
    model = spec.build("cpu")
    optimizer = make_optimizer(list(model.parameters()), config)
    first = _start_from(model, optimizer, start) if start is not None else 0
    with precision(spec.dtype_override):
        losses = _reference_steps(spec, model, optimizer, batch_size, config, first, autocast_dtype)
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return losses, {k: v.detach() for k, v in state.items()}


def plan_reference(plan: Plan, config: TrainConfig,
                   start: dict[str, Any] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """reference_training of a plan's model: in config.dtype, converted, when it is set (a
    twin, without the precision policy); otherwise under the autocast that stands for the
    plan's policy (none for float32)."""
    spec = parse_model_ref(plan.model.ref)
    if config.dtype is not None:
        return reference_training(with_dtype(spec, config.dtype), plan.model.batch_size, config, start)
    return reference_training(spec, plan.model.batch_size, config, start, reference_dtype(plan))


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
                     batch_size: int, config: TrainConfig, first: int = 0,
                     autocast_dtype: torch.dtype | None = None) -> list[float]:
    losses = []
    for step in range(first, config.steps):
        inputs = spec.make_batch(range(step * batch_size, (step + 1) * batch_size), seed=config.data_seed)
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(*inputs)
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


__all__ = ["ModelMismatchError", "NonFiniteError", "StepLog", "TrainConfig", "Trainer", "check_finite", "check_state",
           "clip_global_norm", "full_state", "initial_state", "local_batch", "local_parameters", "make_optimizer",
           "batch_rows", "model_buffers", "plan_reference", "rank_rows", "reference_training", "setup", "train_step"]
