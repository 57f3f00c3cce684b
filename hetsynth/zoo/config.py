"""Validated configurations of the zoo models: the ranges every preset and override must obey.

Each zoo model's config is a frozen pydantic dataclass (`zoo_config`) built from these field
types, so `gpt:tiny,hidden=-5` or `vit:paper,patch_size=7` fail when the reference is
resolved, with the field, the value and the valid range in the message (instruction_set.models),
rather than inside torch. Overrides arrive as text and are converted by the field's type
(`"96"` -> 96 for an int field; `"1.5"` for an int field is an error).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

Count = Annotated[int, Field(ge=1, description="a positive count or size")]
Pair = Annotated[int, Field(ge=2, description="a count of at least two")]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False, description="in [0, 1)")]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, description="in [0, 1]")]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="a finite number > 0")]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False, description="a finite number >= 0")]
FloatDType = Literal["float16", "bfloat16", "float32", "float64"]  # the parameters' dtype

zoo_config = dataclass(frozen=True, config=ConfigDict(extra="forbid"))


def check_heads(cfg: object) -> object:
    """Attention splits `hidden` into `num_heads` equal heads."""
    hidden, num_heads = getattr(cfg, "hidden"), getattr(cfg, "num_heads")
    if hidden % num_heads:
        divisors = [d for d in range(1, min(hidden, 64) + 1) if hidden % d == 0]
        raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}; "
                         f"num_heads must divide hidden (for hidden={hidden}: {divisors}"
                         f"{', ...' if hidden > 64 else ''})")
    return cfg


@zoo_config
class TransformerStack:
    """What every transformer preset has: the layer stack, the batch and the dtype."""

    num_layers: Count = 2
    hidden: Count = 32
    num_heads: Count = 4
    ffn_hidden: Count = 128
    batch_size: Count = 8
    dtype: FloatDType = "float32"

    _heads = model_validator(mode="after")(check_heads)


@zoo_config
class TokenModel(TransformerStack):
    """A transformer over token sequences."""

    vocab_size: Count = 64
    seq_len: Count = 16


__all__ = ["Count", "FloatDType", "Fraction", "NonNegative", "Pair", "Positive", "Probability", "TokenModel",
           "TransformerStack", "check_heads", "zoo_config"]
