"""A rank's share of the plan's precision policy (instruction_set.mixed_precision): the
autocast around its forward passes and the run's one loss scaler.

- Compute: torch.autocast of the rank's device kind's 16-bit type (none for float32), so
  matmuls and convolutions run in 16 bits and reductions and losses in float32, as on one
  device under autocast. Parameters stay float32: they are the master weights the optimizer
  updates, their gradients come out float32 and are reduced in float32, or in bfloat16 where
  the policy asks (gradient_wire: each gradient, or bucket, cast for its collective and the
  sum cast back: the grad-sync buckets, ZeRO-3's reduce-scatters, a pipeline's syncs; SFB's
  factors likewise, runtime.sfb).
- What crosses ranks inside the program travels in one dtype on every rank (wire_dtype): an
  activation in the 16-bit type every kind computes in, or in the plan's dtype when kinds
  compute in different ones (bfloat16 and float16 do not convert into each other without
  loss); parameters, and so their gradients, in the plan's dtype. A collective of the
  program (runtime.conversions, runtime.fused_ops) casts its input first. Pipeline
  boundaries carry the plan's dtype.
- Loss scaling, where some kind computes in float16: gradients are sums over ranks, so every
  rank scales its loss summand by the same S. torch's ShardedGradScaler (FSDP's) all-reduces
  the overflow flag over the world group before the step: an inf or nan on any rank skips
  the step on every rank and sets S <- S * 0.5 everywhere; after 2000 steps without one,
  S <- 2 S. torch's plain GradScaler decides per rank, which is right only when every rank
  holds the same gradients (DDP), not with shards or ZeRO rows. Where no kind uses float16
  the scaler is disabled (the same calls do nothing), so one loop serves every plan.
- A twin in another float dtype (the float64 exactness check, instruction_set.precision) runs
  without autocast: it checks the program, not the policy.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch

from hetsynth.instruction_set.matmul_rates import Dtype
from hetsynth.instruction_set.plan import Plan

if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

TORCH_DTYPES = {Dtype.BFLOAT16: torch.bfloat16, Dtype.FLOAT16: torch.float16}


def compute_dtype(plan: Plan, rank: int) -> torch.dtype | None:
    """The 16-bit type rank `rank` computes in under the plan's policy, None for float32."""
    kind = plan.cluster.devices[rank].kind
    return TORCH_DTYPES.get(plan.precision_policy().of(kind).compute_dtype)


def wire_dtype(plan: Plan, tensor: str) -> torch.dtype | None:
    """The dtype a collective of graph tensor `tensor` carries (module docstring); None for a
    tensor that is not floating-point."""
    node = plan.graph.node(tensor)
    own = getattr(torch, node.out.dtype, None)
    if not isinstance(own, torch.dtype) or not own.is_floating_point:
        return None
    shared = TORCH_DTYPES.get(plan.precision_policy().activation_dtype)
    return shared if shared is not None and node.op not in ("param", "buffer") else own


def gradient_wire(plan: Plan) -> torch.dtype | None:
    """The dtype gradients travel in through their reduction under the plan's policy (bfloat16
    where asked: instruction_set.mixed_precision), None for float32; a twin's plan has no policy,
    so its gradients are reduced in its own dtype."""
    return torch.bfloat16 if plan.precision_policy().reduce_dtype == "bfloat16" else None


def reduced(collective: Callable[[torch.Tensor], torch.Tensor], grad: torch.Tensor,
            wire: torch.dtype | None) -> torch.Tensor:
    """collective(grad) with grad carried in `wire` (None: as it is), the result back in
    grad's dtype."""
    if wire is None or grad.dtype == wire or not grad.is_floating_point():
        return collective(grad)
    return collective(grad.to(wire)).to(grad.dtype)


def reference_dtype(plan: Plan) -> torch.dtype | None:
    """The 16-bit type single-device training computes in to stand for the plan's policy
    (`run --check`): the least precise of the types its kinds compute in, None for float32."""
    dtypes = [TORCH_DTYPES[k.compute_dtype] for k in plan.precision_policy().kinds.values()
              if k.compute_dtype in TORCH_DTYPES]
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else None


def forward_dtype(plan: Plan, rank: int, twin: str | None = None) -> torch.dtype | None:
    """What rank `rank`'s forward passes autocast to: its compute dtype, None in float32 or in
    a twin (another dtype throughout). Resolved once per module, not per forward."""
    return None if twin is not None else compute_dtype(plan, rank)


def autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """The context of a forward pass: torch.autocast of `dtype` (forward_dtype's), or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def loss_scaler(plan: Plan, device: torch.device, group: Any,
                twin: str | None = None) -> "ShardedGradScaler | torch.amp.GradScaler":
    """The run's loss scaler over `group` (every rank of the plan): enabled where some kind
    computes in float16 (and not in a twin)."""
    if not (plan.precision_policy().loss_scaling and twin is None):
        # torch's own, disabled (every call a pass-through, as a disabled ShardedGradScaler's): no
        # import of torch.distributed.fsdp, which loads DTensor (about 1 s of CPU, on an emulated
        # device several seconds at its quota)
        return torch.amp.GradScaler(device.type, enabled=False)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type, enabled=True, process_group=group)


__all__ = ["TORCH_DTYPES", "autocast", "compute_dtype", "forward_dtype", "loss_scaler", "reference_dtype", "wire_dtype"]
