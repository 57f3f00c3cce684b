"""GPT: a decoder-only transformer with causal attention and tied input/output embeddings.

forward(tokens[B, S], targets[B, S]) -> mean next-token cross-entropy.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetsynth.zoo.config import Fraction, TokenModel, zoo_config
from hetsynth.zoo.layers import Block, init_gpt_style
from hetsynth.instruction_set.models import seeded_generator


@zoo_config
class GPTConfig(TokenModel):
    dropout: Fraction = 0.0


PRESETS: dict[str, dict] = {
    "tiny": {},
    # HAP paper setting: 12 layers, hidden 768, FFN 3072, 12 heads, batch 32 per device (8 devices).
    "paper": dict(vocab_size=50257, seq_len=128, num_layers=12, hidden=768, num_heads=12,
                  ffn_hidden=3072, batch_size=256),
    # GPT-2 small (124M parameters).
    "small": dict(vocab_size=50257, seq_len=1024, num_layers=12, hidden=768, num_heads=12,
                  ffn_hidden=3072, batch_size=8),
    # GPT-2 XL shape (1.5B parameters).
    "xl": dict(vocab_size=50257, seq_len=1024, num_layers=48, hidden=1600, num_heads=25,
               ffn_hidden=6400, batch_size=8),
    # Sized for the emulated CPU cluster: about 0.5-3 s per step on 4 throttled workers.
    "small-cpu": dict(vocab_size=512, seq_len=64, num_layers=2, hidden=128, num_heads=4,
                      ffn_hidden=512, batch_size=192),
}


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.num_heads, cfg.ffn_hidden, causal=True, dropout=cfg.dropout)
            for _ in range(cfg.num_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden)
        init_gpt_style(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)  # tied output embedding
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build(cfg: GPTConfig) -> nn.Module:
    return GPT(cfg)


def example_inputs(cfg: GPTConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    shape = (cfg.batch_size, cfg.seq_len)
    return tuple(torch.zeros(shape, dtype=torch.long, device=device) for _ in range(2))


def make_batch(cfg: GPTConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Random token sequences; targets are the tokens shifted by one."""
    rows = [
        torch.randint(0, cfg.vocab_size, (cfg.seq_len + 1,), generator=seeded_generator(seed, i))
        for i in sample_ids
    ]
    data = torch.stack(rows) if rows else torch.zeros(0, cfg.seq_len + 1, dtype=torch.long)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
