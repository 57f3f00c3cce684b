"""A transformer whose feed-forward layers are top-2 gated mixtures of experts (GShard).

Each sequence is a dispatch group. Per group, the gate picks each token's two best experts;
an expert accepts at most `capacity = ceil(capacity_factor * 2 * seq_len / num_experts)`
tokens per group, the rest are dropped (their FFN output is zero, the residual passes).
Dispatch and combine are dense einsums over one-hot masks (Lepikhin et al., GShard, 2020):

    dispatched[e, g, c, m] = sum_s dispatch[g, s, e, c] * x[g, s, m]
    y[g, s, m]             = sum_{e, c} combine[g, s, e, c] * expert_out[e, g, c, m]

so sharding the group dim g (data parallel) and the expert dim e (expert parallel) meet in an
all-to-all, which the planner can choose. The loss adds GShard's load-balancing term
`aux_weight * E * sum_e mean_gs(gates_e) * mean_gs(top1_e)`.

forward(tokens[B, S], targets[B, S]) -> next-token cross-entropy + auxiliary loss.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetsynth.zoo.config import Count, Fraction, NonNegative, Pair, Positive, TokenModel, zoo_config
from hetsynth.zoo.gpt import make_batch as gpt_batch
from hetsynth.zoo.layers import SelfAttention, init_gpt_style


@zoo_config
class MoEConfig(TokenModel):
    ffn_hidden: Count = 64
    num_experts: Pair = 4  # top-2 gating
    capacity_factor: Positive = 1.25
    aux_weight: NonNegative = 0.01
    dropout: Fraction = 0.0

    @property
    def capacity(self) -> int:
        return math.ceil(self.capacity_factor * 2 * self.seq_len / self.num_experts)


PRESETS: dict[str, dict] = {
    "tiny": {},
    # The HAP paper setting: 12 layers, hidden 768, FFN 3072, 12 heads, 8 experts,
    # batch 32 per device (8 devices).
    "paper": dict(vocab_size=30522, seq_len=128, num_layers=12, hidden=768, num_heads=12,
                  ffn_hidden=3072, num_experts=8, batch_size=256),
    "small-cpu": dict(vocab_size=512, seq_len=64, num_layers=2, hidden=128, num_heads=4,
                      ffn_hidden=256, num_experts=4, batch_size=48),
}


class Top2MoE(nn.Module):
    """Top-2 gated experts: forward(x) -> (y, auxiliary load-balancing loss)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, capacity: int) -> None:
        super().__init__()
        self.num_experts, self.capacity = num_experts, capacity
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        if not self.w1.is_meta:  # the meta device has no values to initialise
            nn.init.normal_(self.w1, std=0.02)
            nn.init.normal_(self.w2, std=0.02)

    def _routing(self, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (combine[g,s,e,c], dispatch[g,s,e,c], top-1 mask[g,s,e])."""
        e, c = self.num_experts, self.capacity
        mask1 = F.one_hot(gates.argmax(-1), e).to(gates.dtype)
        mask2 = F.one_hot((gates * (1 - mask1)).argmax(-1), e).to(gates.dtype)
        pos1 = torch.cumsum(mask1, dim=1) - 1
        pos2 = torch.cumsum(mask2, dim=1) - 1 + mask1.sum(dim=1, keepdim=True)
        keep1, keep2 = mask1 * (pos1 < c), mask2 * (pos2 < c)
        g1, g2 = (gates * keep1).sum(-1), (gates * keep2).sum(-1)
        denom = g1 + g2 + 1e-9
        slot1 = F.one_hot((pos1 * keep1).sum(-1).long(), c).to(gates.dtype)
        slot2 = F.one_hot((pos2 * keep2).sum(-1).long(), c).to(gates.dtype)
        combine = (g1 / denom)[..., None, None] * keep1[..., None] * slot1[..., None, :] + (
            (g2 / denom)[..., None, None] * keep2[..., None] * slot2[..., None, :]
        )
        return combine, (combine > 0).to(gates.dtype), mask1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gates = F.softmax(self.gate(x), dim=-1)
        combine, dispatch, top1 = self._routing(gates)
        aux = self.num_experts * (gates.mean(dim=(0, 1)) * top1.mean(dim=(0, 1))).sum()
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, x)
        h = F.gelu(torch.einsum("egcm,emf->egcf", expert_in, self.w1))
        expert_out = torch.einsum("egcf,efm->egcm", h, self.w2)
        return torch.einsum("gsec,egcm->gsm", combine, expert_out), aux


class MoEBlock(nn.Module):
    """Pre-LN transformer layer with a Top2MoE feed-forward: forward(x) -> (x, aux)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.num_heads, causal=True, dropout=cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.moe = Top2MoE(cfg.hidden, cfg.ffn_hidden, cfg.num_experts, cfg.capacity)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.aux_weight = cfg.aux_weight
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        init_gpt_style(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        logits = F.linear(self.ln_f(x), self.tok.weight)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return loss + self.aux_weight * aux


def build(cfg: MoEConfig) -> nn.Module:
    return MoETransformer(cfg)


def example_inputs(cfg: MoEConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    shape = (cfg.batch_size, cfg.seq_len)
    return tuple(torch.zeros(shape, dtype=torch.long, device=device) for _ in range(2))


def make_batch(cfg: MoEConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    return gpt_batch(cfg, sample_ids, seed)  # type: ignore[arg-type]
