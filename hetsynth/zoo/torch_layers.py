"""Small models built from torch's own layers: `torch:<family>[,key=value...]`.

Each preset is a family of `torch.nn` layers in a model that returns a loss, for checking that
such layers capture, plan and train exactly:

| family | layers |
|---|---|
| transformer-encoder | nn.TransformerEncoder (batch_first, post-norm) over embeddings, LM head |
| transformer | nn.Transformer encoder-decoder (batch_first, causal target mask) |
| mha | nn.MultiheadAttention (batch_first) with a causal mask, LayerNorm, MLP |
| lstm, gru | nn.LSTM / nn.GRU (batch_first, `num_layers` deep) over embeddings, LM head |
| batchnorm1d | MLP with nn.BatchNorm1d on [B, C] features |
| groupnorm | CNN with nn.GroupNorm |
| instancenorm | CNN with nn.InstanceNorm2d (affine, running statistics tracked) |
| depthwise | MobileNet-style blocks: depthwise 3x3 + BatchNorm + ReLU6, pointwise 1x1, average pooling |
| unet | max-pool down, bilinear upsampling and a transposed convolution up, skip concatenation |

Dropout is 0 (a random mask cannot be compared with single-device training). Overrides:
`hidden`, `num_layers`, `num_heads`, `ffn_hidden`, `vocab_size`, `seq_len`, `batch_size`,
`image_size`, `channels`, `num_classes`, `dtype`.
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from hetsynth.zoo.config import Count, TokenModel as TokenConfig, check_heads, zoo_config
from hetsynth.zoo.vit import image_batch
from hetsynth.instruction_set.models import seeded_generator

TOKENS = ("transformer-encoder", "transformer", "mha", "lstm", "gru")
IMAGES = ("groupnorm", "instancenorm", "depthwise", "unet")
FEATURES = ("batchnorm1d",)


Family = Literal[TOKENS + IMAGES + FEATURES]  # type: ignore[valid-type]  # one name per family above


def _check_sizes(cfg: "TorchLayersConfig") -> "TorchLayersConfig":
    """Heads divide `hidden` where there is attention; the U-Net halves and doubles the image."""
    if cfg.family in ("transformer-encoder", "transformer", "mha"):
        check_heads(cfg)
    if cfg.family == "unet" and cfg.image_size % 2:
        raise ValueError(f"image_size={cfg.image_size} is odd; the U-Net pools by 2 and upsamples by 2, "
                         f"so image_size must be even")
    return cfg


@zoo_config
class TorchLayersConfig(TokenConfig):
    family: Family = "transformer-encoder"
    ffn_hidden: Count = 64
    seq_len: Count = 12
    image_size: Count = 16
    channels: Count = 8
    num_classes: Count = 10

    _heads = model_validator(mode="after")(_check_sizes)


PRESETS: dict[str, dict] = {f: {"family": f} for f in TOKENS + IMAGES + FEATURES}


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class TokenModel(nn.Module):
    """Embeddings, a sequence body from torch.nn, an LM head."""

    def __init__(self, cfg: TorchLayersConfig) -> None:
        super().__init__()
        h, family = cfg.hidden, cfg.family
        self.family = family
        self.emb = nn.Embedding(cfg.vocab_size, h)
        layer = lambda: nn.TransformerEncoderLayer(h, cfg.num_heads, cfg.ffn_hidden, dropout=0.0, batch_first=True)
        if family == "transformer-encoder":
            self.body = nn.TransformerEncoder(layer(), cfg.num_layers, enable_nested_tensor=False)
        elif family == "transformer":
            self.body = nn.Transformer(h, cfg.num_heads, cfg.num_layers, cfg.num_layers, cfg.ffn_hidden,
                                       dropout=0.0, batch_first=True)
        elif family == "mha":
            self.body = nn.MultiheadAttention(h, cfg.num_heads, dropout=0.0, batch_first=True)
            self.ln = nn.LayerNorm(h)
            self.mlp = nn.Sequential(nn.Linear(h, cfg.ffn_hidden), nn.GELU(), nn.Linear(cfg.ffn_hidden, h))
        else:
            self.body = (nn.LSTM if family == "lstm" else nn.GRU)(h, h, cfg.num_layers, batch_first=True)
        self.head = nn.Linear(h, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if self.family == "transformer-encoder":
            x = self.body(x)
        elif self.family == "transformer":
            mask = nn.Transformer.generate_square_subsequent_mask(labels.shape[1], device=x.device, dtype=x.dtype)
            x = self.body(x, self.emb(labels), tgt_mask=mask, tgt_is_causal=True)
        elif self.family == "mha":
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
            x = self.ln(x + self.body(x, x, x, attn_mask=mask, need_weights=False)[0])
            x = x + self.mlp(x)
        else:
            x = self.body(x)[0]
        return _lm_loss(self.head(x), labels)


def _conv_block(cin: int, cout: int, norm: Callable[[int], nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm(cout), nn.ReLU())


def _groups(channels: int) -> int:
    """The most groups of at least 4 channels that divide `channels` (1 below 8 channels)."""
    return max(g for g in range(1, max(channels // 4, 1) + 1) if channels % g == 0)


class ImageModel(nn.Module):
    def __init__(self, cfg: TorchLayersConfig) -> None:
        super().__init__()
        c, family = cfg.channels, cfg.family
        self.family = family
        norms = {"groupnorm": lambda n: nn.GroupNorm(_groups(n), n),
                 "instancenorm": lambda n: nn.InstanceNorm2d(n, affine=True, track_running_stats=True),
                 "depthwise": nn.BatchNorm2d, "unet": nn.BatchNorm2d}
        norm = norms[family]
        self.stem = _conv_block(3, c, norm)
        if family == "depthwise":
            self.body = nn.Sequential(*[nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU6(),
                nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU6()) for _ in range(cfg.num_layers)])
        elif family == "unet":
            self.down = _conv_block(c, 2 * c, norm)
            self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
            self.merge = _conv_block(3 * c, c, norm)
        else:
            self.body = nn.Sequential(*[_conv_block(c, c, norm) for _ in range(cfg.num_layers)])
        self.fc = nn.Linear(c, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        if self.family == "unet":
            low = self.down(F.max_pool2d(x, 2))
            up = F.interpolate(low, scale_factor=2, mode="bilinear", align_corners=False)
            x = self.merge(torch.cat([x, self.up(low), up[:, : x.shape[1]]], 1))
        else:
            x = self.body(x)
        return F.cross_entropy(self.fc(F.avg_pool2d(x, x.shape[-1]).flatten(1)), labels)


class FeatureModel(nn.Module):
    def __init__(self, cfg: TorchLayersConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(cfg.num_layers):
            layers += [nn.Linear(cfg.hidden, cfg.hidden), nn.BatchNorm1d(cfg.hidden), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(features)), labels)


def build(cfg: TorchLayersConfig) -> nn.Module:
    if cfg.family in TOKENS:
        return TokenModel(cfg)
    return ImageModel(cfg) if cfg.family in IMAGES else FeatureModel(cfg)


def example_inputs(cfg: TorchLayersConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    labels_shape = (cfg.batch_size, cfg.seq_len) if cfg.family in TOKENS else (cfg.batch_size,)
    labels = torch.zeros(labels_shape, dtype=torch.long, device=device)
    if cfg.family in TOKENS:
        return torch.zeros(labels_shape, dtype=torch.long, device=device), labels
    dtype = getattr(torch, cfg.dtype)
    if cfg.family in IMAGES:
        return torch.zeros(cfg.batch_size, 3, cfg.image_size, cfg.image_size, dtype=dtype, device=device), labels
    return torch.zeros(cfg.batch_size, cfg.hidden, dtype=dtype, device=device), labels


def make_batch(cfg: TorchLayersConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    if cfg.family in IMAGES:
        return image_batch(3, cfg.image_size, cfg.num_classes, getattr(torch, cfg.dtype), sample_ids, seed)
    rows = []
    for i in sample_ids:
        g = seeded_generator(seed, i)
        if cfg.family in TOKENS:
            rows.append((torch.randint(0, cfg.vocab_size, (cfg.seq_len,), generator=g),
                         torch.randint(0, cfg.vocab_size, (cfg.seq_len,), generator=g)))
        else:
            rows.append((torch.randn(cfg.hidden, generator=g, dtype=getattr(torch, cfg.dtype)),
                         torch.randint(0, cfg.num_classes, (), generator=g)))
    if not rows:
        return tuple(t[:0] for t in example_inputs(cfg, "cpu"))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
