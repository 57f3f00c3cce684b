"""`hetsynth.parallelize(module, plan)`: the user's module, running this rank's program of the plan.

Called on every rank of a run (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...).
It initialises the default process group when there is none (NCCL on a GPU per rank, gloo on
CPUs), checks that `module` is the one the plan was made for, and returns

- for SPMD plans a runtime.parallel.ParallelModule: `loss = pm(*rows)`, `loss.backward()`,
  a standard `torch.optim` optimizer on `pm.parameters()`;
- for pipeline plans a runtime.pipeline.module.PipelineModule: `loss = pm.train_step(*rows)`.

The module is checked three ways before any parameter is placed, each a ValueError naming
the first difference: its parameters and buffers (names, shapes, dtypes) against the plan's
graph; its graph, captured again on rank 0 with inputs of the plan's shapes, against the plan's
fingerprint (the program runs the plan's graph, so a changed forward would otherwise be
trained as the old one); and its values, which every rank must pass alike (a checksum of every
tensor, all-reduced as max and min: c = (sum x_k, sum w_k x_k) with w_k = 1 + k / n). A
model that draws random values (dropout) gets every rank's generator set to rank 0's: each
rank draws a random op's whole tensor and keeps its part, one device's stream.

A module whose floating-point tensors are all in another dtype than the plan's (a float64
copy of a float32 plan, for exact checks) runs the plan converted to that dtype
(instruction_set.precision.with_float_dtype): the ratios and the program are the plan's.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetsynth.instruction_set.local import graph_draws
from hetsynth.instruction_set.plan import Plan, PlanShape, load_plan
from hetsynth.instruction_set.precision import with_float_dtype
from hetsynth.runtime.groups import Groups
from hetsynth.runtime.parallel import ParallelModule
from hetsynth.runtime.rank import rank_device
from hetsynth.runtime.train import check_state

DEFAULT_TIMEOUT_S = 300.0


class PlanMismatchError(ValueError):
    """The module is not the one the plan was made for, or ranks passed different values."""


def parallelize(module: nn.Module, plan: Plan | str | Path, *, timeout_s: float | None = None,
                check_graph: bool = True) -> nn.Module:
    """This rank's program of `plan` over `module`'s parameter values (module docstring).
    `timeout_s`: the collective timeout of a process group created here (default
    $HETSYNTH_TIMEOUT or 300 s). `check_graph=False` skips the graph comparison (the
    parameter and value checks always run)."""
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    device = rank_device()
    _init_process_group(device, timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != plan.cluster.num_devices:
        raise PlanMismatchError(f"the plan is for {plan.cluster.num_devices} devices, this run has world size {world}; "
                                f"launch it with hetsynth launch PLAN SCRIPT (one rank per device)")
    state = _state(module)
    dtype = _float_dtype(state)
    if dtype is not None and dtype != plan.model.dtype:
        plan = with_float_dtype(plan, dtype)
    else:
        dtype = None
    try:
        check_state(plan, state)
    except ValueError as err:
        raise PlanMismatchError(f"the module is not the one the plan was made for: {err}") from None
    _agree(_verdict(module, plan, rank, check_graph), rank)
    _check_same_values(state, rank)
    if graph_draws(plan.graph.calls):
        _same_generator(device)
    keys = _state_keys(module, plan)
    if plan.shape is PlanShape.PIPELINE:
        from hetsynth.runtime.pipeline.module import PipelineModule

        return PipelineModule(plan, rank, state, keys, device, dtype=dtype, world=dist.group.WORLD)
    groups = Groups.create(plan.mesh, rank, world=dist.group.WORLD)
    return ParallelModule(plan, groups, state, keys, device, dtype=dtype)


def _init_process_group(device: torch.device, timeout_s: float | None) -> None:
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"parallelize needs a process group or torchrun's environment ({', '.join(missing)} "
                           f"unset); run the script with hetsynth launch PLAN SCRIPT")
    timeout = timeout_s if timeout_s is not None else float(os.environ.get("HETSYNTH_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name (tied ones under each), detached."""
    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    return {k: v.detach() for k, v in state.items()}


def _float_dtype(state: dict[str, torch.Tensor]) -> str | None:
    """The one floating-point dtype of the module's tensors, or None when there are several."""
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _state_keys(module: nn.Module, plan: Plan) -> dict[str, str]:
    """The plain module's state-dict key -> the name the plan's graph knows the tensor by
    (tied parameters: one graph name for all their keys)."""
    planned = {n.fqn for n in plan.graph.nodes if n.op in ("param", "buffer") and n.fqn}
    names: dict[int, list[str]] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    by_id = {i: next((n for n in ns if n in planned), ns[0]) for i, ns in names.items()}
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    return {key: by_id[id(tensors[key])] if key in tensors else key for key in module.state_dict()}


def _verdict(module: nn.Module, plan: Plan, rank: int, check_graph: bool) -> str:
    """Rank 0's graph comparison: '' when the module captures to the plan's graph."""
    if rank != 0 or not check_graph:
        return ""
    from hetsynth.planner.capture import capture
    from hetsynth.planner.model_check import first_difference

    inputs = [torch.zeros(n.out.shape, dtype=getattr(torch, n.out.dtype)) for n in plan.graph.nodes if n.op == "input"]
    try:
        graph = capture(module, inputs, model_ref=plan.model.ref,
                        allow_replicate_fallback=bool(plan.graph.fallback_ops))
    except Exception as err:  # noqa: BLE001 - the message goes to every rank
        return f"the module does not capture with the plan's inputs: {type(err).__name__}: {err}"
    if graph.fingerprint == plan.graph.fingerprint:
        return ""
    return f"the module is not the one the plan was made for: {first_difference(plan.graph, graph)}"


def _agree(verdict: str, rank: int) -> None:
    box: list[Any] = [verdict]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise PlanMismatchError(box[0])


def _checksums(state: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(state), 2, dtype=torch.float64)
    for k, t in enumerate(state.values()):
        x = t.detach().reshape(-1).to("cpu", torch.float64)
        if x.numel():
            out[k, 0] = x.sum()
            out[k, 1] = (x * torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64)).sum()
    return out


def _same_generator(device: torch.device) -> None:
    """Every rank's random generator (the CPU's, and the device's) set to rank 0's: the
    model draws random values, and each rank draws them whole and keeps its part
    (instruction_set.local.draw_whole), so the ranks' generators must be one stream."""
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    for get, put in states:
        state = get().to(device)
        dist.broadcast(state, src=0)
        put(state.cpu())


def _check_same_values(state: dict[str, torch.Tensor], rank: int) -> None:
    """PlanMismatchError naming the first tensor whose values differ between ranks."""
    sums = _checksums(state)
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    differ = ((high != low) & ~(torch.isnan(high) & torch.isnan(low))).any(dim=1).nonzero()
    if len(differ):
        name = list(state)[int(differ[0])]
        raise PlanMismatchError(f"ranks passed different values for {name!r} (checksum {float(low[differ[0], 0]):.6g} "
                                f"to {float(high[differ[0], 0]):.6g} across ranks); every rank must pass the same "
                                f"weights: seed the initialisation (torch.manual_seed) or load the same checkpoint "
                                f"before parallelize")


__all__ = ["PlanMismatchError", "parallelize"]
