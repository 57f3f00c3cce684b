"""Transformer building blocks shared by the zoo models (plain PyTorch, no fused kernels).

Attention uses `F.scaled_dot_product_attention` so capture sees one attention op kind; the
projections are separate q/k/v linears (as in LLaMA and BERT), which keeps head-parallel
sharding a plain column-parallel split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, *, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        self.num_heads, self.causal, self.dropout = num_heads, causal, dropout
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Transformer layer: pre-LN (GPT, ViT) or post-LN (BERT)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        ffn_hidden: int,
        *,
        causal: bool,
        pre_norm: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, num_heads, causal=causal, dropout=dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.ffn = MLP(hidden, ffn_hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.drop(self.ffn(self.ln2(x)))
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.ffn(x)))


def init_gpt_style(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 initialisation: normal(0, std) weights, zero biases, unit LayerNorm.
    Skipped on the meta device, where there are no values to initialise."""
    if any(p.is_meta for p in module.parameters()):
        return
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
