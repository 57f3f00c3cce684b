"""How a plan trains: one `TrainConfig`, the same on the CLI (`hetsynth run`), in the launcher,
on every rank (runtime.worker) and in the single-device reference (`--check`). Its defaults
live here only; the command-line flags are made from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0  # None: no clipping
    seed: int = 0                      # parameter initialisation
    data_seed: int = 1                 # training batches
    dtype: str | None = None           # train the plan's twin in this floating-point dtype

    def __post_init__(self) -> None:
        bad = [(f"--steps {self.steps}", "give a number >= 0", self.steps < 0),
               (f"--optimizer {self.optimizer}", f"use one of {', '.join(OPTIMIZERS)}",
                self.optimizer not in OPTIMIZERS),
               (f"--lr {self.lr:g}", "give a positive, finite learning rate", not 0 < self.lr < math.inf),
               (f"--weight-decay {self.weight_decay:g}", "give a finite number >= 0",
                not 0 <= self.weight_decay < math.inf),
               (f"--max-grad-norm {self.max_grad_norm}", "give a positive, finite norm, or none",
                self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf)]
        for what, valid, wrong in bad:
            if wrong:
                raise ValueError(f"{what}: {valid}")

    def to_argv(self) -> list[str]:
        """The flags that give this config to `add_train_arguments`' parser."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out += [_flag(f.name), "none" if value is None else str(value)]
        return out


HELP = {
    "steps": "training steps",
    "optimizer": "optimizer",
    "lr": "learning rate",
    "weight_decay": "weight decay of the optimizer",
    "max_grad_norm": "clip the global gradient norm to this ('none': no clipping)",
    "seed": "seed of the parameters' initialisation",
    "data_seed": "seed of the training batches",
    "dtype": "train the plan's twin in this floating-point dtype ('none': as planned; instruction_set.precision)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _optional_str(text: str) -> str | None:
    return None if text.lower() == "none" else text


def add_train_arguments(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field but `skip`, its default read from TrainConfig()."""
    default = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        value = getattr(default, f.name)
        kind = {"max_grad_norm": _optional_float, "dtype": _optional_str}.get(f.name, type(value))
        extra = {"choices": OPTIMIZERS} if f.name == "optimizer" else {}
        p.add_argument(_flag(f.name), type=kind, default=value, help=f"{HELP[f.name]} (default {value})", **extra)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The config of parsed flags (fields without a flag keep their defaults)."""
    default = TrainConfig()
    return TrainConfig(**{f.name: getattr(args, f.name, getattr(default, f.name))
                          for f in dataclasses.fields(TrainConfig)})
