"""The matmul rate of each dtype on the device a rank runs on, and what a spec claims of them.

For every dtype of instruction_set.matmul_rates.Dtype the device can run, the best sustained
rate over the MATMULS shapes (profiling.measure), 2 m k n FLOPs per product:

- float32 with tf32 off; tf32 (float32 tensors, tf32 tensor-core products) on CUDA devices of
  compute capability 8.0 and above;
- bfloat16 and float16: operands in that type (on a CPU, what torch's CPU kernels really do in
  it, often slower than float32; on CUDA, bfloat16 only where the device has it natively);
- float8 (e4m3 operands, torch._scaled_mm) on CUDA devices of capability 8.9 and above.

A dtype whose matmul raises (anything) is skipped: the device does not run it. A spec that gives a rate
for a 16-bit dtype on a kind whose devices the profiler finds without it is reported
(`unsupported_claims`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.matmul_rates import HALF_DTYPES, Dtype, MatmulRates
from hetsynth.profiling.measure import MATMULS, device_sync, sustained_seconds

_TORCH = {Dtype.FLOAT32: torch.float32, Dtype.TF32: torch.float32, Dtype.BFLOAT16: torch.bfloat16,
          Dtype.FLOAT16: torch.float16}


def runnable(device: torch.device, dtype: Dtype) -> bool:
    """Whether to time `dtype` on `device` (a matmul that then raises is skipped too)."""
    if device.type != "cuda":
        return dtype in (Dtype.FLOAT32, Dtype.BFLOAT16, Dtype.FLOAT16)
    capability = torch.cuda.get_device_capability(device)
    if dtype is Dtype.TF32:
        return capability >= (8, 0)
    if dtype is Dtype.BFLOAT16:
        return capability >= (8, 0)  # native bfloat16 (Ampere on); Volta and Turing only emulate it
    if dtype is Dtype.FLOAT8:
        return capability >= (8, 9) and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
    return True


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _product(dtype: Dtype, m: int, k: int, n: int, device: torch.device) -> Callable[[], object]:
    """A callable computing one m x k @ k x n product in `dtype`."""
    if dtype is Dtype.FLOAT8:
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm asks
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    a = torch.randn(m, k, device=device, dtype=_TORCH[dtype])
    b = torch.randn(k, n, device=device, dtype=_TORCH[dtype])
    return lambda: a @ b


def dtype_rate(device: torch.device, dtype: Dtype, seconds: float,
               shapes: Sequence[tuple[int, int, int]] = MATMULS) -> float | None:
    """FLOP/s of `dtype` matmuls on `device` (the best shape), None where it does not run."""
    if not runnable(device, dtype):
        return None
    sync, rates = device_sync(device), []
    with _tf32(dtype is Dtype.TF32):
        for m, k, n in shapes:
            try:
                product = _product(dtype, m, k, n, device)
                rates.append(2 * m * k * n / sustained_seconds(product, seconds, sync))
            except Exception:  # noqa: BLE001 - any failure of the product means the device does not run it
                return None
    return max(rates)


def dtype_rates(device: torch.device, seconds: float, shapes: Sequence[tuple[int, int, int]] = MATMULS,
                dtypes: Sequence[Dtype] = tuple(Dtype)) -> dict[str, float]:
    """{dtype: FLOP/s} of each of `dtypes` the device runs."""
    found = {d.value: dtype_rate(device, d, seconds, shapes) for d in dtypes}
    return {d: r for d, r in found.items() if r is not None}


def measured_rates(rows: Sequence[dict[str, float]]) -> MatmulRates:
    """The kind's table from its devices' measurements (`dtype_rates`): the mean rate of each
    dtype every device ran; float32 left to the kind's throughput_flops."""
    common = set.intersection(*(set(r) for r in rows)) - {Dtype.FLOAT32.value} if rows else set()
    return MatmulRates(**{d: sum(r[d] for r in rows) / len(rows) for d in sorted(common)})


def unsupported_claims(claimed: ClusterSpec, measured: ClusterSpec) -> list[str]:
    """One line per (device kind, 16-bit dtype) the claimed spec gives a rate for and the
    profiler found the kind's devices without."""
    lines = []
    for name, kind in claimed.device_kinds.items():
        found = measured.device_kinds[name].half_dtypes() if name in measured.device_kinds else ()
        for dtype in kind.half_dtypes():
            if dtype not in found and dtype in HALF_DTYPES:
                lines.append(f"device kind {name!r}: the spec claims {dtype.value} at {kind.rate_flops(dtype):.3g} "
                             f"FLOP/s, but the profiler found its devices without {dtype.value} matmuls")
    return lines
