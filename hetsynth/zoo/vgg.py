"""VGG19 on CIFAR-size images with the ImageNet-size classifier (25088 x 4096), as in HAP.

The 16 convolutions (3x3, padding 1) and 5 max-pools reduce a 32x32 image to 1x1; an
adaptive average pool to 7x7 (as in torchvision) then feeds the 512*7*7 = 25088-wide
classifier, whose large weight matrices make this the model where hybrid plans and
sufficient-factor broadcasting pay.

forward(images[B, 3, 32, 32], labels[B]) -> mean cross-entropy.
"""

from __future__ import annotations

from typing import Annotated, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from hetsynth.zoo.config import Count, FloatDType, zoo_config
from hetsynth.zoo.vit import image_batch

# Configuration "E" of Simonyan & Zisserman: channel multipliers of `base_channels`, M = pool.
VGG19_LAYOUT: tuple[int | str, ...] = (
    1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M",
)


@zoo_config
class VGGConfig:
    image_size: Annotated[int, Field(ge=32, description="five 2x2 poolings")] = 32
    channels: Count = 3
    base_channels: Count = 4
    hidden: Count = 64
    num_classes: Count = 10
    pool_size: Count = 7
    batch_size: Count = 8
    dtype: FloatDType = "float32"


PRESETS: dict[str, dict] = {
    "tiny": {},
    # The HAP paper setting: VGG19 with a 25088 x 4096 classifier, batch 32 per device (8 devices).
    "paper": dict(base_channels=64, hidden=4096, num_classes=1000, batch_size=256),
    "small-cpu": dict(base_channels=8, hidden=1024, num_classes=10, batch_size=384),
}


class VGG19(nn.Module):
    def __init__(self, cfg: VGGConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = cfg.channels
        for item in VGG19_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out_ch = int(item) * cfg.base_channels
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU()]
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(cfg.pool_size)
        self.fc1 = nn.Linear(in_ch * cfg.pool_size**2, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc3 = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(images)).flatten(1)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        return F.cross_entropy(self.fc3(x), labels)


def build(cfg: VGGConfig) -> nn.Module:
    return VGG19(cfg)


def example_inputs(cfg: VGGConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    images = torch.zeros(cfg.batch_size, cfg.channels, cfg.image_size, cfg.image_size,
                         dtype=getattr(torch, cfg.dtype), device=device)
    return images, torch.zeros(cfg.batch_size, dtype=torch.long, device=device)


def make_batch(cfg: VGGConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    return image_batch(cfg.channels, cfg.image_size, cfg.num_classes, getattr(torch, cfg.dtype),
                       sample_ids, seed)
