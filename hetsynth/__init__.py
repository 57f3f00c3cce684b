"""hetsynth: plan and run SPMD training of PyTorch models on heterogeneous GPU clusters.

Public API (see README):

    graph = hetsynth.capture_model("gpt:tiny")              # reference graph
    cluster = hetsynth.load_cluster("configs/clusters/a100-t4.toml")
    plan = hetsynth.plan("gpt:tiny", cluster=cluster)       # or plan(module, example_inputs, cluster)
    hetsynth.save_plan(plan, "plan.json")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it. Resolved on first use (PEP 562): a torchrun worker importing
# hetsynth.runtime.worker, or the CLI answering from the plan cache, loads only what it uses.
_EXPORTS = {
    "ClusterSpec": "hetsynth.instruction_set.cluster", "load_cluster": "hetsynth.instruction_set.cluster",
    "ReferenceGraph": "hetsynth.instruction_set.graph",
    "Plan": "hetsynth.instruction_set.plan", "load_plan": "hetsynth.instruction_set.plan",
    "save_plan": "hetsynth.instruction_set.plan",
    "capture_model": "hetsynth.api", "capture_measured": "hetsynth.api", "plan": "hetsynth.api",
    "parallelize": "hetsynth.parallel",
}
_SUBMODULES = ("checkpoint", "data", "plan_cache")

__all__ = ["ClusterSpec", "Plan", "ReferenceGraph", "capture_measured", "capture_model", "checkpoint", "data",
           "load_cluster", "load_plan", "parallelize", "plan", "plan_cache", "save_plan", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"hetsynth.{name}")
    else:
        raise AttributeError(f"module 'hetsynth' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
