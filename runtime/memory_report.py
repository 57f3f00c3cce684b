"""`hetsynth run --memory-report`: the memory a rank holds, measured, beside the plan's prediction.

One training step (the second run: the first creates the optimizer state) is measured on
every rank:

- **state**: the bytes of the parameters, of their gradients (taken right after the gradient
  sync, before the update frees any) and of the optimizer state (`optimizer.state` tensors
  with dims, not AdamW's scalar `step`), each storage counted once (gradients that are views
  into a bucket's flat buffer count the buffer once);
- **saved**: the peak bytes of tensors autograd saves for backward, from
  `torch.autograd.graph.saved_tensors_hooks` over the forward and backward (`SavedTensorMeter`):
  a saved tensor's storage is added when first packed and subtracted when autograd frees its
  last saved reference (views share storage: counted once); parameters (and views of them) are
  state, not activations, and are not counted. This is what the memory model predicts
  (cost_models.memory, probed the same way at capture by cost_models.saved_tensors);
- on a GPU also the allocator's peak over the step (`torch.cuda.max_memory_allocated`), which
  includes workspaces and temporaries the model does not predict (information).

The prediction is the plan's (`DevicePrediction.state_gib`, `saved_gib`), its state scaled
from the AdamW the planner assumes to the run's optimizer (instruction_set.plan.STATE_COPIES).

On an emulated cluster with device memory (`emulation.memory_scale`), the launcher also reads
each rank's memory group after the run (runtime.emulation: `memory.max_usage_in_bytes`, the
peak of everything the rank allocated after joining its device, allocator slack and
communication buffers included) and `format_cgroup_peaks` sets it beside the plan's predicted
peak per device (`DevicePrediction.memory_gib`) and the limit.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hetsynth.instruction_set.plan import PLANNED_OPTIMIZER, STATE_COPIES, Plan

MIB, GIB = 2.0**20, 2.0**30


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped)."""
    seen: dict[StorageWeakRef, int] = {}
    for t in tensors:
        if t is not None:
            seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class _Saved:
    """A packed tensor; gives its storage back to the meter when autograd frees it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: StorageWeakRef, meter: "SavedTensorMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of the storages autograd holds for backward (module docstring)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {_key(t) for t in exclude}
        self.live: dict[StorageWeakRef, list[int]] = {}  # storage -> [bytes, saved references]
        self.bytes = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = _key(t)
        if key in self.exclude:
            return t
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key: StorageWeakRef) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]

    @contextlib.contextmanager
    def measuring(self) -> Iterator["SavedTensorMeter"]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


@dataclass
class RankMemory:
    """One rank's figures, bytes (predicted: None for plans without the split)."""

    rank: int
    device: str
    params: int
    grads: int
    optimizer: int
    saved_peak: int
    allocator_peak: int | None = None
    predicted_state: float | None = None
    predicted_saved: float | None = None

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes(v for state in optimizer.state.values() for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0)


def measure_step(trainer: Any, run_step: Callable[[], Any]) -> RankMemory:
    """Run one step (`run_step`) of `trainer` (runtime.train.Trainer) under the meters."""
    params = list(trainer.program.module.parameters())
    params += trainer.zero.leaves() if trainer.zero is not None else []  # views, or (ZeRO-2) with row gradients
    meter, grads = SavedTensorMeter(exclude=params), [0]
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)

    def on_gradients() -> None:
        grads[0] = storage_bytes(p.grad for p in params)

    trainer.on_gradients = on_gradients
    try:
        with meter.measuring():
            run_step()
    finally:
        trainer.on_gradients = None
    rank = trainer.groups.rank
    device = trainer.plan.predicted.devices[rank]
    scale = STATE_COPIES[trainer.config.optimizer] / STATE_COPIES[PLANNED_OPTIMIZER]
    return RankMemory(rank=rank, device=device.name, params=storage_bytes(params), grads=grads[0],
                      optimizer=optimizer_bytes(trainer.optimizer), saved_peak=meter.peak,
                      allocator_peak=torch.cuda.max_memory_allocated(trainer.device) if cuda else None,
                      predicted_state=None if device.state_gib is None else device.state_gib * GIB * scale,
                      predicted_saved=None if device.saved_gib is None else device.saved_gib * GIB)


def relative_error(predicted: float | None, measured: int) -> float | None:
    """(predicted - measured) / measured; None without a prediction."""
    if predicted is None:
        return None
    return (predicted - measured) / measured if measured else (0.0 if predicted == 0 else float("inf"))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.2f}"


def format_report(plan: Plan, rows: list[RankMemory], optimizer: str) -> str:
    """The table rank 0 prints."""
    head = (f"memory per rank (MiB; predicted by the plan's memory model for {optimizer}, measured in one step; "
            "state = parameters + gradients + optimizer state)")
    cols = f"{'rank':>4} {'device':<14} {'params':>9} {'grads':>9} {'optim':>9} {'state pred':>10} " \
           f"{'meas':>9} {'err':>7} {'saved pred':>10} {'meas':>9} {'err':>7}"
    lines = [head, cols]
    for r in rows:
        lines.append(f"{r.rank:>4} {r.device:<14} {_mib(r.params):>9} {_mib(r.grads):>9} {_mib(r.optimizer):>9} "
                     f"{_mib(r.predicted_state):>10} {_mib(r.state):>9} "
                     f"{_pct(relative_error(r.predicted_state, r.state)):>7} {_mib(r.predicted_saved):>10} "
                     f"{_mib(r.saved_peak):>9} {_pct(relative_error(r.predicted_saved, r.saved_peak)):>7}"
                     + (f"  allocator peak {_mib(r.allocator_peak)}" if r.allocator_peak is not None else ""))
    if any(r.predicted_state is None for r in rows):
        lines.append("(this plan records no memory split: make it again with `hetsynth plan` for predictions)")
    return "\n".join(lines)


def format_cgroup_peaks(plan: Plan, usage: dict[int, dict[str, int]]) -> str:
    """Measured peak per rank (its memory group) beside the plan's predicted peak and the limit (MiB)."""
    lines = ["peak memory per rank (MiB; predicted by the plan, measured by the rank's memory cgroup)",
             f"{'rank':>4} {'device':<14} {'predicted':>10} {'measured':>9} {'err':>7} {'limit':>8}"]
    for rank, u in sorted(usage.items()):
        device = plan.predicted.devices[rank]
        predicted = device.memory_gib * GIB
        lines.append(f"{rank:>4} {device.name:<14} {_mib(predicted):>10} {_mib(u['peak_bytes']):>9} "
                     f"{_pct(relative_error(predicted, u['peak_bytes'])):>7} {_mib(u['limit_bytes']):>8}"
                     + ("  out of memory" if u["oom_kills"] else ""))
    return "\n".join(lines)


def as_json(rows: list[RankMemory]) -> list[dict]:
    return [asdict(r) | {"state": r.state, "state_error": relative_error(r.predicted_state, r.state),
                         "saved_error": relative_error(r.predicted_saved, r.saved_peak)} for r in rows]


__all__ = ["RankMemory", "SavedTensorMeter", "as_json", "format_cgroup_peaks", "format_report", "measure_step", "relative_error",
           "storage_bytes"]
