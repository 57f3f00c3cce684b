"""`hetsynth run --check`: the distributed run against single-device training.

The plan runs as written (in its dtype, usually float32) and, unless it is float64 already,
again as its float64 twin (instruction_set.precision: the same instructions, layouts, ratios
and shard lengths; the same initialisation and data, converted). Each run is compared with the
plain model trained on one device in the same dtype, same initialisation, data, optimizer and
clipping.

**float64 decides.** Every step's global loss within `tolerance` (default 1e-9) relative,
and every parameter and buffer within `10 * tolerance`, measured elementwise as
`|a - b| / max(1, |b|)` (absolute for small values, relative for large ones such as running
variances). A failure names the worst tensor and its difference.

**An op without a float64 kernel** (torch._grouped_mm in transformers' MoE layers, a
float32-only custom op) runs in float32 inside the twin and the reference alike
(instruction_set.precision); the float64 comparison then names those ops and judges at
float32's tolerances (below), the precision the lowest op computes in.

**float32 (or lower) is information.** Sums in another order round differently, and AdamW
turns that noise on near-zero gradients into updates of up to the learning rate per step,
so a correct float32 run can differ from single-device training by about `2 * lr * steps`
in a parameter. Its figures are printed against a tolerance for the dtype: `sqrt(eps)`
relative for the loss (float32: 3.5e-4), `sqrt(eps) + 2 * lr * steps` for parameters and
buffers (AdamW; `sqrt(eps)` for SGD).

**A 16-bit precision policy** (runtime.mixed_precision): the run as planned is compared with
single-device training under torch.autocast of the least precise 16-bit type its kinds compute
in (no loss scaling on one device), at that type's tolerances (bfloat16: 8.8e-2 relative for
the loss); the float64 twin has no policy and still decides. A policy that reduces gradients
in bfloat16 rounds every sum to it: the run is judged at bfloat16's tolerances (against autocast
on one device where its kinds compute in 16 bits, else against the plan's dtype), and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from hetsynth.instruction_set.graph import CUSTOM_BACKWARD

PARAM_FACTOR = 10.0


@dataclass(frozen=True)
class Comparison:
    dtype: str
    loss_rel: float                 # largest relative loss difference over the steps
    worst: str                      # the parameter or buffer with the largest difference
    worst_diff: float
    loss_tolerance: float
    tensor_tolerance: float
    lowered: tuple[tuple[str, str], ...] = ()  # (op, the dtype it ran in): ops without a `dtype` kernel
    policy: str = ""  # a 16-bit precision policy's description: the run was judged against its stand-in
    half: str = ""    # the 16-bit type whose tolerances apply (the stand-in's, or the gradients' reduction's)
    autocast: str = ""  # the stand-in's autocast type on one device ("": none, the plan's dtype)
    custom_backwards: tuple[str, ...] = ()  # the model's torch.autograd.Functions (ReferenceGraph's)

    @property
    def judged(self) -> str:
        """The dtype whose tolerances the comparison used."""
        return self.half or self.dtype

    @property
    def ok(self) -> bool:
        return self.loss_rel <= self.loss_tolerance and self.worst_diff <= self.tensor_tolerance

    def describe(self) -> str:
        lowered = ""
        if self.lowered:
            ops = ", ".join(f"{op} ({dtype})" for op, dtype in self.lowered)
            lowered = (f"; ops without a {self.dtype} kernel ran in a lower precision: {ops}, so the "
                       f"tolerances are {lowest_dtype(self.dtype, dict(self.lowered))}'s")
        against = f"{self.autocast} autocast" if self.autocast else self.dtype
        head = (f"{self.dtype} with precision {self.policy}, against {against} on one device"
                + (f", at {self.half}'s tolerances" if self.half != self.autocast else "")
                if self.policy else self.dtype)
        custom = (f"; the model applies torch.autograd.Function(s) {', '.join(self.custom_backwards)}: "
                  f"{CUSTOM_BACKWARD}" if self.custom_backwards and not self.ok else "")
        return (f"{head}: largest relative loss difference {self.loss_rel:.3e} (tolerance "
                f"{self.loss_tolerance:.1e}), largest parameter/buffer difference {self.worst_diff:.3e} "
                f"in {self.worst or '-'} (tolerance {self.tensor_tolerance:.1e}){lowered}{custom}")


def lowest_dtype(dtype: str, lowered: Mapping[str, str]) -> str:
    """The least precise of `dtype` and the dtypes ops ran in instead of it."""
    return max([dtype, *lowered.values()], key=lambda d: torch.finfo(getattr(torch, d)).eps)


def tensor_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |a - b| / max(1, |b|) elementwise, in float64 (NaN when either has a NaN)."""
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.nan
    return float(((a - b).abs() / b.abs().clamp(min=1.0)).max())


def loss_difference(got: Sequence[float], want: Sequence[float]) -> float:
    if len(got) != len(want):
        return math.inf
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want)]
    return max(diffs, default=0.0) if not any(math.isnan(d) for d in diffs) else math.nan


def dtype_tolerances(dtype: str, optimizer: str, lr: float, steps: int, tolerance: float,
                     lowered: Mapping[str, str] | None = None) -> tuple[float, float]:
    """(relative loss, parameter/buffer) tolerances of a comparison in `dtype`, or in the
    lowest dtype an op of the run computed in instead (`lowered`: {op: dtype})."""
    dtype = lowest_dtype(dtype, lowered or {})
    if dtype == "float64":
        return tolerance, PARAM_FACTOR * tolerance
    eps = math.sqrt(torch.finfo(getattr(torch, dtype)).eps)
    return eps, eps + (2 * lr * steps if optimizer == "adamw" else 0.0)


def compare(dtype: str, losses: Sequence[float], expected_losses: Sequence[float],
            tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
            tolerances: tuple[float, float], lowered: Mapping[str, str] | None = None, policy: str = "",
            half: str = "", autocast: str = "", custom_backwards: tuple[str, ...] = ()) -> Comparison:
    """The run's losses and final tensors against single-device training; NaN counts as
    the worst difference, and a tensor missing on either side fails. `lowered`: the ops that
    ran in a lower precision than `dtype` ({op: dtype}), named in the result;
    `custom_backwards`: the model's autograd Functions, named where the check fails."""
    low = tuple(sorted((lowered or {}).items()))
    worst, worst_diff = "", 0.0
    for name in sorted(set(tensors) | set(expected)):
        if name not in tensors or name not in expected:
            if name in tensors:  # the run has a tensor the plain model does not
                return Comparison(dtype, 0.0, name, math.inf, *tolerances, lowered=low, policy=policy, half=half,
                                  autocast=autocast, custom_backwards=custom_backwards)
            continue  # an alias or a buffer the graph never reads: not trained
        diff = tensor_difference(tensors[name], expected[name])
        if math.isnan(diff) or diff > worst_diff:
            worst, worst_diff = name, math.inf if math.isnan(diff) else diff
    loss = loss_difference(losses, expected_losses)
    return Comparison(dtype, math.inf if math.isnan(loss) else loss, worst, worst_diff, *tolerances, lowered=low,
                      policy=policy, half=half, autocast=autocast, custom_backwards=custom_backwards)


# -- the same check on a pool of ranks (tests, bench/families.py) ---------------------------------

def pool_worker(rank: int, world: int, plan: Any, config: Any) -> tuple[list[float], dict, dict]:
    """Train a plan on one rank of a RankPool: (global losses, local parameters, buffers)."""
    import torch.distributed as dist
    from hetsynth.runtime.groups import Groups
    from hetsynth.runtime.train import local_parameters, model_buffers, setup, train_step

    trainer = setup(plan, Groups.create(plan.mesh, rank, world=dist.group.WORLD), config)
    losses = [train_step(trainer, step).loss for step in range(config.steps)]
    return losses, local_parameters(trainer), model_buffers(trainer) if rank == 0 else {}


def check_on_pool(pool: Any, plan: Any, config: Any, tolerance: float = 1e-9) -> list[Comparison]:
    """`run --check` on a RankPool: the plan as written and, unless float64, its float64 twin,
    each against single-device training in its dtype; the last comparison decides."""
    from dataclasses import replace

    from hetsynth.instruction_set.precision import lowered_ops_recorded, with_float_dtype
    from hetsynth.runtime.rank_state import assemble
    from hetsynth.runtime.train import plan_reference

    out = []
    for dtype in [plan.model.dtype] + (["float64"] if plan.model.dtype != "float64" else []):
        twin = dtype != plan.model.dtype
        run_config = replace(config, dtype=dtype if twin else None)
        results = pool.run(pool_worker, plan, run_config, timeout_s=900)
        ran = with_float_dtype(plan, dtype) if twin else plan
        tensors = assemble(ran, [r[1] for r in results]) | results[0][2]
        with lowered_ops_recorded() as lowered:
            losses, expected = plan_reference(plan, run_config)
        tol = dtype_tolerances(dtype, config.optimizer, config.lr, config.steps, tolerance, lowered)
        out.append(compare(dtype, results[0][0], losses, tensors, expected, tol, lowered,
                           custom_backwards=plan.graph.custom_backwards))
    return out
