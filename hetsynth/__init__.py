"""hetsynth: plan and run SPMD training of PyTorch models on heterogeneous GPU clusters.

Public API (see README):

    graph = hetsynth.capture_model("gpt:tiny")              # reference graph
    cluster = hetsynth.load_cluster("configs/clusters/a100-t4.toml")
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from cost_models.cluster import ClusterSpec, load_cluster
from instruction_set.graph import ReferenceGraph

__version__ = "0.1.0"


def capture_model(model: str | nn.Module, example_inputs: Sequence[torch.Tensor] | None = None, *,
                  allow_replicate_fallback: bool = False) -> ReferenceGraph:
    """Capture a model reference (`gpt:tiny`) or a module with its example inputs."""
    from hetsynth.models import parse_model_ref
    from planner.capture import capture

    if isinstance(model, str):
        spec = parse_model_ref(model)
        return capture(spec.build("meta"), spec.example_inputs("meta"), model_ref=spec.ref,
                       allow_replicate_fallback=allow_replicate_fallback)
    if example_inputs is None:
        raise ValueError("capture_model(module, example_inputs): example_inputs are required for a module")
    return capture(model, example_inputs, model_ref=type(model).__name__,
                   allow_replicate_fallback=allow_replicate_fallback)


__all__ = ["ClusterSpec", "ReferenceGraph", "capture_model", "load_cluster", "__version__"]
