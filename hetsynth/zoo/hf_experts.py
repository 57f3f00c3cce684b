"""transformers' experts implementation `hetsynth_routed`: the experts block as one op.

`hf:<moe>,experts=routed` sets a model's `config._experts_implementation` to it. It calls
`hetsynth::routed_experts` (instruction_set.experts_op), whose rules let the planner split the
experts over devices unevenly (instruction_set.rules.moe). Experts of another form than the
op computes (biases, transposed or interleaved weights, no gate, a norm after each expert, a
custom gate, an activation it does not know) run transformers' `batched_mm` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from hetsynth.instruction_set.experts_op import ACTIVATIONS

NAME = "hetsynth_routed"


def _activation(module: Any) -> str | None:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act if act in ACTIVATIONS else None


def _plain(module: Any) -> bool:
    """Whether the experts have the op's form: [gate; up] x, then down, no bias or norm."""
    from transformers.integrations import moe

    return (module.has_gate and not module.has_bias and not module.is_transposed and module.is_concatenated
            and not module.has_post_expert_norm and not module._is_expert_parallel
            and type(module)._apply_gate is moe._default_apply_gate and _activation(module) is not None)


def routed_experts_forward(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    from transformers.integrations import moe

    if not _plain(module):
        return moe.batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    weights = top_k_weights.to(hidden_states.dtype)
    return torch.ops.hetsynth.routed_experts(hidden_states, top_k_index.long(), weights, module.gate_up_proj,
                                             module.down_proj, _activation(module), 0)


def register() -> None:
    """Make `hetsynth_routed` a valid `config._experts_implementation` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, routed_experts_forward)
