"""The layers of the SFB benchmark (bench/sfb.py) as standalone models, for hetsynth's
`path/file.py:factory[,k=v]` model references. Each factory returns (module, meta example
inputs); the training data are then seeded random rows.

- `vgg_classifier`: VGG19's classifier (fc1 features -> hidden, fc2 hidden -> hidden, fc3
  hidden -> classes, ReLU between) with cross-entropy, fed the flattened pooled features;
  `features` defaults to the small-cpu VGG's 64 * 7 * 7 = 3136 (the paper's is 25088).
- `gpt_mlp`: one GPT block's MLP (LayerNorm, fc1 hidden -> 4 hidden, GELU, fc2 back) on
  [batch * seq, hidden] tokens, with a squared-error loss against a target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Classifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), labels)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (self.fc2(F.gelu(self.fc1(self.norm(x)))) - target).pow(2).mean()


def vgg_classifier(batch_size: str = "32", features: str = "3136", hidden: str = "1024",
                   classes: str = "10") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    b = int(batch_size)
    x = torch.zeros(b, int(features), device="meta")
    labels = torch.zeros(b, dtype=torch.long, device="meta")
    return Classifier(int(features), int(hidden), int(classes)), (x, labels)


def gpt_mlp(batch_size: str = "1", seq_len: str = "64", hidden: str = "128",
            ffn_hidden: str = "512") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    shape = (int(batch_size) * int(seq_len), int(hidden))  # tokens flattened: split over tokens
    x, target = torch.zeros(shape, device="meta"), torch.zeros(shape, device="meta")
    return MLP(int(hidden), int(ffn_hidden)), (x, target)
