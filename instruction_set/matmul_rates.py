"""Matmul rates per floating-point type of a device kind, and the types themselves.

A device computes a dense matmul at a rate that depends on the dtype of its operands: an
A100 does 19.5 TFLOP/s in float32, 156 in tf32 and 312 in bfloat16 or float16 on its tensor
cores; a T4 8.1 in float32 and 65 in float16, and has no bfloat16 at all. `MatmulRates` is
that table for one device kind (FLOP/s, dense: no structured sparsity); a dtype without a rate
is one the kind does not run (for the 16-bit types: it has no such tensor-core path, so a plan
never computes in it there). float32 is always runnable; its rate defaults to the kind's
`throughput_flops` (instruction_set.cluster).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from hetsynth.instruction_set.units import Flops


class Dtype(StrEnum):
    """A matmul type: tf32 is float32 storage with a 10-bit-mantissa tensor-core product."""

    FLOAT32 = "float32"
    TF32 = "tf32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT8 = "float8"

    @property
    def bytes(self) -> int:
        """Bytes per element of a tensor stored in this type (tf32 is stored as float32)."""
        return {Dtype.FLOAT32: 4, Dtype.TF32: 4, Dtype.BFLOAT16: 2, Dtype.FLOAT16: 2, Dtype.FLOAT8: 1}[self]


HALF_DTYPES = (Dtype.BFLOAT16, Dtype.FLOAT16)  # the 16-bit compute types, preferred first


class MatmulRates(BaseModel):
    """Dense matmul FLOP/s per dtype; None: the kind does not run that dtype (float32: unset
    means the kind's throughput_flops)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    float32: Flops | None = None
    tf32: Flops | None = None
    bfloat16: Flops | None = None
    float16: Flops | None = None
    float8: Flops | None = None

    def rate(self, dtype: Dtype) -> float | None:
        """FLOP/s in `dtype`, None when not given."""
        return getattr(self, dtype.value)

    def given(self) -> tuple[Dtype, ...]:
        """The dtypes with a rate, in Dtype order."""
        return tuple(d for d in Dtype if self.rate(d) is not None)


# Dense (non-sparse) vendor peaks of the GPUs hetsynth ships specs for (NVIDIA data sheets:
# V100 SXM2, P100 PCIe, T4, A100 SXM4, H100 SXM5; H200 has H100 SXM's compute). A spec's
# `matmul_flops` table can copy these; `hetsynth profile` measures what a device really does.
VENDOR_RATES: dict[str, MatmulRates] = {
    "V100": MatmulRates(float32=15.7e12, float16=125e12),
    "P100": MatmulRates(float32=9.3e12, float16=18.7e12),
    "T4": MatmulRates(float32=8.1e12, float16=65e12),
    "A100": MatmulRates(float32=19.5e12, tf32=156e12, bfloat16=312e12, float16=312e12),
    "H100": MatmulRates(float32=67e12, tf32=495e12, bfloat16=989e12, float16=989e12, float8=1979e12),
    "H200": MatmulRates(float32=67e12, tf32=495e12, bfloat16=989e12, float16=989e12, float8=1979e12),
}
