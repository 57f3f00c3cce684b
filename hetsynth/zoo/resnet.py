"""ResNet (He et al., 2016) with BatchNorm in training mode.

Stages of residual blocks, each `conv-BN-ReLU-conv-BN` (basic) or `1x1-3x3-1x1` with BN
(bottleneck), the shortcut added in place (`out += identity`) and a 1x1 convolution with BN
where the shape changes; a stem (7x7 stride 2 and a max-pool for images of 64 pixels and
more, else 3x3), global average pooling and a linear classifier. BatchNorm normalises with
the batch's statistics and updates its running mean, variance and batch counter, so a plan
must all-reduce the statistics of a batch-split BatchNorm and update the buffers.

`blocks` lists the blocks per stage, separated by colons (`blocks=2:2:2:2`: ResNet-18 with basic
blocks; `3:4:6:3` with `bottleneck=true`: ResNet-50); stage i has `width * 2**i` channels
(times 4 at a bottleneck's output).

forward(images[B, 3, S, S], labels[B]) -> mean cross-entropy.
"""

from __future__ import annotations

import re
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import AfterValidator
from torch import nn

from hetsynth.zoo.config import Count, FloatDType, zoo_config
from hetsynth.zoo.vit import example_inputs, make_batch  # noqa: F401  (images and labels: the same config fields)


def _stages(text: str) -> str:
    if not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)*", text):
        raise ValueError("expected a positive count of blocks per stage, separated by colons, like 2:2:2:2")
    return text


Blocks = Annotated[str, AfterValidator(_stages)]


@zoo_config
class ResNetConfig:
    blocks: Blocks = "1:1"
    width: Count = 8
    bottleneck: bool = False
    image_size: Count = 16
    channels: Count = 3
    num_classes: Count = 10
    batch_size: Count = 8
    dtype: FloatDType = "float32"

    @property
    def stages(self) -> list[int]:
        return [int(b) for b in self.blocks.split(":")]


PRESETS: dict[str, dict] = {
    "tiny": {},
    "small-cpu": dict(blocks="2:2:2", width=16, image_size=32, batch_size=64),
    "resnet18": dict(blocks="2:2:2:2", width=64, image_size=224, num_classes=1000, batch_size=256),
    "resnet50": dict(blocks="3:4:6:3", width=64, bottleneck=True, image_size=224, num_classes=1000,
                     batch_size=256),
}


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout))


class Block(nn.Module):
    def __init__(self, cin: int, width: int, stride: int, bottleneck: bool) -> None:
        super().__init__()
        cout = width * 4 if bottleneck else width
        if bottleneck:
            self.body = nn.ModuleList([_conv_bn(cin, width, 1), _conv_bn(width, width, 3, stride),
                                       _conv_bn(width, cout, 1)])
        else:
            self.body = nn.ModuleList([_conv_bn(cin, width, 3, stride), _conv_bn(width, cout, 3)])
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = x
        for i, layer in enumerate(self.body):
            out = layer(out)
            if i < len(self.body) - 1:
                out = F.relu(out)
        out += identity
        return F.relu(out)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        large = cfg.image_size >= 64
        self.stem = _conv_bn(cfg.channels, cfg.width, 7 if large else 3, 2 if large else 1)
        self.pool = nn.MaxPool2d(3, 2, 1) if large else nn.Identity()
        blocks, cin = [], cfg.width
        for stage, count in enumerate(cfg.stages):
            for i in range(count):
                block = Block(cin, cfg.width * 2**stage, 2 if stage > 0 and i == 0 else 1, cfg.bottleneck)
                blocks.append(block)
                cin = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.stem(images)))
        x = self.blocks(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return F.cross_entropy(logits, labels)


def build(cfg: ResNetConfig) -> nn.Module:
    return ResNet(cfg)
