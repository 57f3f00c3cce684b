"""One training configuration (runtime.config): `hetsynth run` and the worker parse the same
defaults, TrainConfig's, and a config survives the launcher's command line."""

from __future__ import annotations

import math

import pytest

from hetsynth.cli import build_parser
from hetsynth.runtime import worker
from hetsynth.runtime.config import TrainConfig, train_config


def test_cli_and_worker_defaults_are_train_configs() -> None:
    cli = build_parser().parse_args(["run", "plan.json"])
    rank = worker.parse_args(["--plan", "plan.json"])
    assert train_config(cli) == train_config(rank) == TrainConfig()


def test_a_config_round_trips_through_the_worker_flags() -> None:
    config = TrainConfig(steps=7, optimizer="sgd", lr=0.5, weight_decay=0.0, max_grad_norm=None, seed=3, data_seed=9)
    assert train_config(worker.parse_args(["--plan", "p.json", *config.to_argv()])) == config


@pytest.mark.parametrize(("field", "value", "message"), [
    ("lr", 0.0, "--lr 0: give a positive, finite learning rate"),
    ("lr", math.inf, "--lr inf: give a positive, finite learning rate"),
    ("weight_decay", math.nan, "--weight-decay nan: give a finite number >= 0"),
    ("max_grad_norm", -1.0, "--max-grad-norm -1.0: give a positive, finite norm, or none"),
    ("max_grad_norm", math.inf, "--max-grad-norm inf: give a positive, finite norm, or none"),
    ("optimizer", "adam", "--optimizer adam: use one of adamw, sgd"),
    ("steps", -2, "--steps -2: give a number >= 0"),
])
def test_bad_values_name_the_flag_and_what_is_valid(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})
