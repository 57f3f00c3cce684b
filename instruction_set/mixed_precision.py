"""A plan's precision policy: what each device kind computes in, and what stays float32.

Mixed-precision training as torch users know it (torch.autocast with float32 master weights:
Micikevicius et al., "Mixed Precision Training", ICLR 2018; torch FSDP2's MixedPrecisionPolicy):

- parameters and optimizer state are float32 (`master_dtype`): the optimizer updates these;
- each device computes forward and backward in its kind's `compute_dtype` under autocast
  semantics (matmuls and convolutions in the 16-bit type, reductions and losses in float32),
  so activations and their gradients travel in 16 bits;
- gradients are reduced across devices in `reduce_dtype`: float32, or bfloat16 where the user
  asks (FSDP2's `reduce_dtype`, torchtitan's `mixed_precision_reduce`): each gradient is cast
  to bfloat16 for the collective and the sum cast back into the float32 gradient the optimizer
  reads (a weight synchronised by sufficient factors gathers them in bfloat16), so gradient
  traffic is half (the cost model's `reduce_scale`); the sum is rounded to bfloat16's 8
  significant bits on the way (a tolerance, not exactness);
- a kind computing in float16 scales the loss (`loss_scaling`: dynamic loss scaling, one scale
  agreed across ranks, an overflow on any rank skips the step on every rank); bfloat16 has
  float32's exponent range and needs none.

`Precision` is what the user asks for: fp32 (everything float32), bf16 or fp16 (that type on
every kind, an error where a kind lacks it), or auto (per kind the fastest type it has, bfloat16
where both 16-bit types are as fast, float32 where it has neither or they are slower).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from hetsynth.instruction_set.cluster import ClusterSpec, DeviceKind
from hetsynth.instruction_set.matmul_rates import Dtype


class Precision(StrEnum):
    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


_ASKED = {Precision.BF16: Dtype.BFLOAT16, Precision.FP16: Dtype.FLOAT16, Precision.FP32: Dtype.FLOAT32}


REDUCE_BYTES = {"float32": 4, "bfloat16": 2}  # the gradient reduce dtypes, bytes an element


class PrecisionError(ValueError):
    """A precision a device kind of the cluster cannot compute in; the message names both."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KindPrecision(_Frozen):
    """How the devices of one kind compute."""

    compute_dtype: Dtype
    loss_scaling: bool = False


class PrecisionPolicy(_Frozen):
    """The plan's precision: per device kind its compute dtype and loss scaling; master weights
    in float32, gradients reduced in float32 or bfloat16 (module docstring)."""

    precision: Precision
    kinds: dict[str, KindPrecision]
    master_dtype: Literal["float32"] = "float32"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"

    def of(self, kind: str) -> KindPrecision:
        if kind not in self.kinds:
            raise PrecisionError(f"device kind {kind!r} has no precision in this policy; "
                                 f"it covers {sorted(self.kinds)}")
        return self.kinds[kind]

    @property
    def is_mixed(self) -> bool:
        """Whether some kind computes in a 16-bit type."""
        return any(k.compute_dtype is not Dtype.FLOAT32 for k in self.kinds.values())

    @property
    def loss_scaling(self) -> bool:
        """Whether training scales the loss: some kind computes in float16. The scale is one for
        the whole run, agreed across every rank (an overflow anywhere skips the step everywhere)."""
        return any(k.loss_scaling for k in self.kinds.values())

    @property
    def activation_dtype(self) -> Dtype:
        """The dtype activations travel in between devices: the compute dtype every kind
        shares, else float32 (a collective carries one dtype on every rank; bfloat16 and
        float16 do not convert into each other without loss)."""
        dtypes = {k.compute_dtype for k in self.kinds.values()}
        return dtypes.pop() if len(dtypes) == 1 else Dtype.FLOAT32

    @property
    def reduce_scale(self) -> float:
        """Bytes a gradient carries in its reduction per byte of its float32 master copy."""
        return REDUCE_BYTES[self.reduce_dtype] / 4

    def describe(self) -> str:
        """One line: each kind's dtype, loss scaling, master and reduction dtypes."""
        kinds = ", ".join(f"{name} {k.compute_dtype.value}{' + loss scaling' if k.loss_scaling else ''}"
                          for name, k in sorted(self.kinds.items()))
        return (f"{self.precision.value}: {kinds}; master weights {self.master_dtype}, "
                f"gradients reduced in {self.reduce_dtype}")


def supported(kind: DeviceKind) -> tuple[Dtype, ...]:
    """The compute dtypes a kind supports: its 16-bit types (bfloat16 first) and float32."""
    return (*kind.half_dtypes(), Dtype.FLOAT32)


def kind_precision(name: str, kind: DeviceKind, precision: Precision) -> KindPrecision:
    """The compute dtype of kind `name` under `precision`: the asked one (PrecisionError where
    the kind lacks it), or for auto the supported type of the highest rate, ties going to
    bfloat16, then float16, then float32 (a CPU whose 16-bit matmuls are slower than its
    float32 ones computes in float32)."""
    if precision is Precision.AUTO:
        dtype = max(supported(kind), key=lambda d: kind.rate_flops(d) or 0.0)  # ties: the first, bfloat16
    else:
        dtype = _ASKED[precision]
        if kind.rate_flops(dtype) is None:
            raise PrecisionError(f"--precision {precision.value}: device kind {name!r} has no {dtype.value} "
                                 f"(it supports {', '.join(d.value for d in supported(kind))}); use --precision auto "
                                 f"or one of those")
    return KindPrecision(compute_dtype=dtype, loss_scaling=dtype is Dtype.FLOAT16)


def choose_policy(cluster: ClusterSpec, precision: Precision | str = Precision.FP32,
                  reduce_dtype: str = "float32") -> PrecisionPolicy:
    """The policy of `precision` for the device kinds the cluster's devices use, gradients
    reduced in `reduce_dtype` (float32 or bfloat16)."""
    try:
        precision = Precision(precision)
    except ValueError:
        raise PrecisionError(f"precision {precision!r}: use one of {', '.join(p.value for p in Precision)}") from None
    if reduce_dtype not in REDUCE_BYTES:
        raise PrecisionError(f"gradient reduce dtype {reduce_dtype!r}: use one of {', '.join(REDUCE_BYTES)}")
    used = sorted({d.kind for d in cluster.devices})
    return PrecisionPolicy(precision=precision, reduce_dtype=reduce_dtype,  # type: ignore[arg-type]
                           kinds={k: kind_precision(k, cluster.device_kinds[k], precision) for k in used})
