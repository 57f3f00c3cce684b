"""BERT-style encoder with a masked-language-model head.

forward(tokens[B, S], labels[B, S]) -> mean cross-entropy over the masked positions; labels
are -100 (ignored) where a token is not masked, as in HuggingFace's BertForMaskedLM. The
decoder is tied to the word embeddings and has its own bias.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetsynth.zoo.config import Fraction, Pair, Probability, TokenModel, zoo_config
from hetsynth.zoo.layers import Block, init_gpt_style
from hetsynth.instruction_set.models import seeded_generator


@zoo_config
class BERTConfig(TokenModel):
    vocab_size: Pair = 64  # token 0 is [MASK]
    mask_prob: Probability = 0.15
    dropout: Fraction = 0.0


PRESETS: dict[str, dict] = {
    "tiny": {},
    # BERT-base, the HAP paper setting: batch 32 per device (8 devices), sequence 128.
    "paper": dict(vocab_size=30522, seq_len=128, num_layers=12, hidden=768, num_heads=12,
                  ffn_hidden=3072, batch_size=256),
    "base": dict(vocab_size=30522, seq_len=512, num_layers=12, hidden=768, num_heads=12,
                 ffn_hidden=3072, batch_size=32),
    "large": dict(vocab_size=30522, seq_len=512, num_layers=24, hidden=1024, num_heads=16,
                  ffn_hidden=4096, batch_size=32),
    "small-cpu": dict(vocab_size=512, seq_len=64, num_layers=2, hidden=128, num_heads=4,
                      ffn_hidden=512, batch_size=192),
}


class BERT(nn.Module):
    def __init__(self, cfg: BERTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.ln_emb = nn.LayerNorm(cfg.hidden)
        self.layers = nn.ModuleList(
            Block(cfg.hidden, cfg.num_heads, cfg.ffn_hidden, causal=False, pre_norm=False,
                  dropout=cfg.dropout)
            for _ in range(cfg.num_layers)
        )
        self.transform = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln_head = nn.LayerNorm(cfg.hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        init_gpt_style(self)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.ln_emb(self.tok(tokens) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        h = self.ln_head(F.gelu(self.transform(x)))
        logits = F.linear(h, self.tok.weight, self.decoder_bias)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def build(cfg: BERTConfig) -> nn.Module:
    return BERT(cfg)


def example_inputs(cfg: BERTConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    shape = (cfg.batch_size, cfg.seq_len)
    return tuple(torch.zeros(shape, dtype=torch.long, device=device) for _ in range(2))


def _sample(cfg: BERTConfig, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    original = torch.randint(1, cfg.vocab_size, (cfg.seq_len,), generator=g)
    masked = torch.rand(cfg.seq_len, generator=g) < cfg.mask_prob
    masked[0] = True  # every sequence contributes at least one target
    tokens = torch.where(masked, torch.zeros_like(original), original)  # token 0 is [MASK]
    labels = torch.where(masked, original, torch.full_like(original, -100))
    return tokens, labels


def make_batch(cfg: BERTConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    pairs = [_sample(cfg, seeded_generator(seed, i)) for i in sample_ids]
    if not pairs:
        empty = torch.zeros(0, cfg.seq_len, dtype=torch.long)
        return empty, empty.clone()
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
