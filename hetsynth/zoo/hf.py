"""HuggingFace GPT-2 and BERT (masked LM) built from a config, wrapped to return the loss.

Needs the optional `transformers` package (installed by the dev extra). Weights are the
models' own random initialisation; nothing is downloaded.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from hetsynth.zoo import bert as zoo_bert
from hetsynth.zoo import gpt as zoo_gpt
from hetsynth.zoo.config import TokenModel, zoo_config


@zoo_config
class HFConfig(TokenModel):
    """GPT2LMHeadModel / BertForMaskedLM sizes (no dropout: the models are built with none)."""


PRESETS: dict[str, dict] = {
    "tiny": {},
    "small": dict(vocab_size=50257, seq_len=1024, num_layers=12, hidden=768, num_heads=12,
                  ffn_hidden=3072, batch_size=8),
}


class LossOnly(nn.Module):
    """forward(input_ids, labels) -> model(input_ids=..., labels=...).loss"""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the hf-gpt2 / hf-bert models need the 'transformers' package: "
            "pip install 'hetsynth[dev]' or pip install transformers"
        ) from err
    return transformers


def build_gpt2(cfg: HFConfig) -> nn.Module:
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.hidden,
        n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.ffn_hidden, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return LossOnly(t.GPT2LMHeadModel(config))


def build_bert(cfg: HFConfig) -> nn.Module:
    t = _transformers()
    config = t.BertConfig(
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len, hidden_size=cfg.hidden,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn_hidden, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    return LossOnly(t.BertForMaskedLM(config))


def example_inputs(cfg: HFConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    shape = (cfg.batch_size, cfg.seq_len)
    return tuple(torch.zeros(shape, dtype=torch.long, device=device) for _ in range(2))


def make_gpt2_batch(cfg: HFConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    tokens, _ = zoo_gpt.make_batch(cfg, sample_ids, seed)  # type: ignore[arg-type]
    return tokens, tokens.clone()  # GPT2LMHeadModel shifts the labels itself


def make_bert_batch(cfg: HFConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    return zoo_bert.make_batch(zoo_bert.BERTConfig(**{
        k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "batch_size")
    }), sample_ids, seed)
