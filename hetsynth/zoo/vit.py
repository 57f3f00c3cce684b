"""ViT: patch-embedding convolution, a class token, a pre-LN encoder and a linear head.

forward(images[B, C, H, W], labels[B]) -> mean cross-entropy of the class-token logits.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from hetsynth.zoo.config import Count, Fraction, TransformerStack, zoo_config
from hetsynth.zoo.layers import Block, init_gpt_style
from hetsynth.instruction_set.models import seeded_generator


@zoo_config
class ViTConfig(TransformerStack):
    image_size: Count = 16
    patch_size: Count = 4
    channels: Count = 3
    num_classes: Count = 10
    dropout: Fraction = 0.0

    @model_validator(mode="after")
    def _patches(self) -> "ViTConfig":
        if self.patch_size > self.image_size:
            raise ValueError(f"patch_size={self.patch_size} is larger than image_size={self.image_size}; "
                             f"choose patch_size <= image_size")
        return self

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, dict] = {
    "tiny": {},
    # ViT-Base/16, the HAP paper setting: batch 32 per device (8 devices).
    "paper": dict(image_size=224, patch_size=16, num_classes=1000, num_layers=12, hidden=768,
                  num_heads=12, ffn_hidden=3072, batch_size=256),
    "small-cpu": dict(image_size=32, patch_size=4, num_classes=10, num_layers=2, hidden=128,
                      num_heads=4, ffn_hidden=512, batch_size=48),
}


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size={cfg.image_size} is not a multiple of patch_size={cfg.patch_size}")
        self.patch = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos = nn.Parameter(torch.zeros(1, cfg.num_patches + 1, cfg.hidden))
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.num_heads, cfg.ffn_hidden, causal=False, dropout=cfg.dropout)
            for _ in range(cfg.num_layers)
        )
        self.ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)
        init_gpt_style(self)
        if not self.cls.is_meta:
            nn.init.normal_(self.cls, std=0.02)
            nn.init.normal_(self.pos, std=0.02)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)[:, 0]), labels)


def build(cfg: ViTConfig) -> nn.Module:
    return ViT(cfg)


def example_inputs(cfg: ViTConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    dtype = getattr(torch, cfg.dtype)
    images = torch.zeros(cfg.batch_size, cfg.channels, cfg.image_size, cfg.image_size,
                         dtype=dtype, device=device)
    return images, torch.zeros(cfg.batch_size, dtype=torch.long, device=device)


def make_batch(cfg: ViTConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    return image_batch(cfg.channels, cfg.image_size, cfg.num_classes, getattr(torch, cfg.dtype),
                       sample_ids, seed)


def image_batch(channels: int, size: int, num_classes: int, dtype: torch.dtype,
                sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (standard normal) with a random label each; shared with VGG."""
    images = torch.zeros(len(sample_ids), channels, size, size, dtype=dtype)
    labels = torch.zeros(len(sample_ids), dtype=torch.long)
    for row, i in enumerate(sample_ids):
        g = seeded_generator(seed, i)
        images[row] = torch.randn(channels, size, size, generator=g, dtype=dtype)
        labels[row] = int(torch.randint(0, num_classes, (1,), generator=g))
    return images, labels
