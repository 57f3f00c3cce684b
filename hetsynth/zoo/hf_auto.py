"""Any HuggingFace architecture from a small config: `hf:<model_type>[,key=value...]`.

`hf:llama`, `hf:t5,num_layers=4`, `hf:vit,image_size=64`, `hf:mistral,hidden=4096,num_layers=32`
build `transformers.AutoModelFor<task>.from_config(...)` with the model's own random
initialisation (nothing is downloaded) and wrap it so that forward returns the loss.

- **Task** (`task=`): `seq2seq-lm` (labels, decoder inputs shifted from them by the model),
  `masked-lm` (labels -100 except about 15% of positions), `causal-lm` (labels = inputs, the
  model shifts them) or `image-classification` (pixel values, class labels); by default the
  first of these the architecture supports, in that order.
- **Sizes.** The architecture's default config, with every size attribute it has set small
  (SMALL: hidden 32, 2 layers, 4 heads, 2 key/value heads, FFN 64, vocabulary 128, images
  64 x 64 in patches of 8, two stages for hierarchical vision models), dropouts set to 0 (a
  random mask cannot be compared with single-device training), the KV cache off, attention
  through scaled_dot_product_attention. Mixture-of-experts models get EXPERTS: 4 experts, 2 per
  token, expert FFNs of 64, and DeepSeek's low-rank attention and expert groups set small; their
  experts run as one op (`experts=routed`: hetsynth.zoo.hf_experts, instruction_set.experts_op),
  which the planner may split by tokens or by experts (expert parallelism, unevenly: more
  experts on faster devices). `experts=batched_mm` (each token gathers its experts' weights:
  row-wise in the tokens, but a copy of the weights per token) and `experts=grouped_mm`,
  transformers' default (instruction_set.rules.moe: no copies, but the tokens stay replicated
  around its grouped matmuls and the experts never split), capture too.
- **Images of 64 pixels**: at 32, a network that downsamples 32-fold normalises its last
  stages over the batch's 8 values per channel alone; MobileNetV2 is then so ill-conditioned
  that in float64 the plain model and its own captured graph (the same math, rounded in
  another order) drift apart by 4e-9 in 5 AdamW steps (at 64: 9e-12).
- **Overrides.** The zoo's shared names map to the architecture's own attributes (`hidden`
  to hidden_size / d_model / n_embd / dim, `num_layers` to every layer count, `num_heads`,
  `num_kv_heads`, `ffn_hidden`, `vocab_size`, `head_dim`), plus `seq_len`, `batch_size`,
  `image_size`, `num_labels`, `dtype`, `task`, `experts`; any other key sets that config attribute
  (converted to the type of its default), and a key the config does not have is an error.
  The own fields are validated like every zoo config (hetsynth.zoo.config: sizes >= 1, two
  labels or more, a float dtype, one of TASKS), and a task the architecture has no model for
  is refused with the tasks it has.

Needs the optional `transformers` package (the dev extra).
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from torch import nn

from pydantic import ValidationError

from hetsynth.zoo.config import Count, FloatDType, Pair, zoo_config
from hetsynth.zoo.vit import image_batch
from hetsynth.instruction_set.models import ModelRefError, ModelSpec, config_error, seeded_generator

TASKS = ("seq2seq-lm", "masked-lm", "causal-lm", "image-classification")
_MAPPINGS = {"seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
             "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}
_AUTO = {"seq2seq-lm": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM",
         "causal-lm": "AutoModelForCausalLM", "image-classification": "AutoModelForImageClassification"}

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
SHARED: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "d_model", "n_embd", "dim", "embedding_size", "word_embed_proj_dim"),
    "num_layers": ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                   "decoder_layers", "num_decoder_layers"),
    "num_heads": ("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads",
                  "decoder_attention_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                   "hidden_dim", "n_inner"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim", "d_kv"),
}
SMALL = {"hidden": HIDDEN, "num_layers": LAYERS, "num_heads": HEADS, "num_kv_heads": KV_HEADS,
         "ffn_hidden": FFN, "vocab_size": 128}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
EXPERTS = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
           "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "moe_intermediate_size": FFN,
           "shared_expert_intermediate_size": FFN, "expert_ffn_hidden_size": FFN, "n_group": 1, "topk_group": 1,
           "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
           "qk_nope_head_dim": 4, "v_head_dim": 8}
OWN = ("seq_len", "batch_size", "image_size", "num_labels", "dtype", "task", "experts")
_STAGES = {"depths": [1, 1], "hidden_sizes": [16, 32], "num_stages": 2, "embed_dim": 16, "window_size": 2,
           "patch_size": 8, "num_channels": 3, "rotary_dim": 4, "relative_attention_num_buckets": 8,
           "position_buckets": 8, "max_relative_positions": 16, "intermediate_size_mlp": FFN}


@zoo_config
class HFAutoConfig:
    """What hf:<model_type> sets itself (validated); `attrs` are the architecture's own config
    attributes, checked by the architecture's config class when the model is built."""

    model_type: str
    task: Literal[TASKS]  # type: ignore[valid-type]
    seq_len: Count = 16
    batch_size: Count = 8
    image_size: Count = 64
    num_labels: Pair = 10   # one label would make HuggingFace's heads regress on float labels
    dtype: FloatDType = "float32"
    experts: Literal["routed", "batched_mm", "grouped_mm"] = "routed"  # transformers' experts implementation
    attrs: dict[str, Any] = field(default_factory=dict)   # HuggingFace config attributes

    @property
    def vocab_size(self) -> int:
        return int(self.attrs.get("vocab_size", 128))


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("hf:<model_type> models need the 'transformers' package: "
                          "pip install 'hetsynth[dev]' or pip install transformers") from err
    return transformers


def model_types() -> list[str]:
    from transformers.models.auto import modeling_auto
    found = set()
    for name in _MAPPINGS.values():
        found |= set(getattr(modeling_auto, name))
    return sorted(found)


def supported_tasks(model_type: str) -> list[str]:
    """The tasks of TASKS this architecture has a HuggingFace model class for."""
    from transformers.models.auto import modeling_auto
    return [task for task in TASKS if model_type in getattr(modeling_auto, _MAPPINGS[task])]


def _task(model_type: str, asked: str | None) -> str:
    """The asked task when the architecture supports it, else the first it supports."""
    tasks = supported_tasks(model_type)
    if not tasks:
        raise ValueError(f"hf:{model_type}: no {', '.join(TASKS)} model for this architecture; "
                         f"architectures with one: {', '.join(model_types()[:40])}, ...")
    if asked is not None and asked in TASKS and asked not in tasks:
        raise ValueError(f"hf:{model_type},task={asked}: this architecture has no {asked} model; "
                         f"its tasks: {', '.join(tasks)}")
    return asked or tasks[0]


def _base_config(model_type: str, **attrs: Any) -> Any:
    t = _transformers()
    try:
        return t.AutoConfig.for_model(model_type, **attrs)
    except ValueError:
        raise ValueError(f"hf:{model_type}: unknown model_type; known ones include "
                         f"{', '.join(model_types()[:40])}, ...") from None


def _coerce(key: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            return type(default)(text)
        if isinstance(default, list):
            return [type(default[0])(x) if default else int(x) for x in text.split(":")]
        return text if default is None or isinstance(default, str) else type(default)(text)
    except ValueError:
        kind = type(default).__name__
        raise ValueError(f"{key}={text!r} is not a valid {kind}") from None


def _small_attrs(base: Any, seq_len: int, image_size: int, num_labels: int) -> dict[str, Any]:
    """The size attributes of this architecture, set small, and dropouts off."""
    attrs: dict[str, Any] = {}
    have = base.to_dict()
    for name, attr_names in SHARED.items():
        for attr in attr_names:
            if attr in have and name in SMALL and not isinstance(have[attr], list):
                attrs[attr] = SMALL[name]
    for attr, value in _STAGES.items():
        if attr in have and isinstance(have[attr], list) == isinstance(value, list):
            attrs[attr] = value
    # None: unset in the architecture's default config (DeepSeek-V2's experts per token)
    attrs |= {attr: value for attr, value in EXPERTS.items()
              if attr in have and isinstance(have[attr], (int, type(None)))}
    if isinstance(have.get("num_heads"), list):
        attrs["num_heads"] = [2, 4]
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"):
        if attr in have and isinstance(have[attr], int):
            attrs[attr] = max(64, 2 * seq_len)
    for attr, value in have.items():
        if ("dropout" in attr or attr.endswith("_pdrop") or attr == "drop_path_rate") and isinstance(value, float):
            attrs[attr] = 0.0
    attrs.update({k: v for k, v in (("image_size", image_size), ("num_labels", num_labels),
                                    ("use_cache", False)) if k in have or k == "num_labels"})
    return attrs


def _head_dim(have: dict[str, Any], given: set[str]) -> dict[str, int]:
    """hidden / heads for an architecture with its own head-dim attribute (head_dim, T5's
    d_kv), unless `head_dim` was given: the architecture's default is its full-size one."""
    attr = next((a for a in SHARED["head_dim"] if a in have), None)
    hidden = next((have[a] for a in SHARED["hidden"] if isinstance(have.get(a), int)), None)
    heads = next((have[a] for a in SHARED["num_heads"] if isinstance(have.get(a), int)), None)
    if attr is None or "head_dim" in given or attr in given or not hidden or not heads:
        return {}
    if isinstance(have.get("qk_rope_head_dim"), int):  # DeepSeek's head_dim is its rotary part
        return {attr: have["qk_rope_head_dim"]}
    return {attr: max(hidden // heads, 1)}


def _latent_kv_heads(have: dict[str, Any], given: set[str]) -> dict[str, int]:
    """Latent attention (DeepSeek's kv_lora_rank) expands keys and values to every head: one
    key/value head per head, unless `num_kv_heads` was given."""
    heads = next((have[a] for a in SHARED["num_heads"] if isinstance(have.get(a), int)), None)
    if "kv_lora_rank" not in have or "num_kv_heads" in given or "num_key_value_heads" not in have or not heads:
        return {}
    return {"num_key_value_heads": heads}


def resolve(model_type: str, overrides: dict[str, str]) -> HFAutoConfig:
    """The config of `hf:<model_type>` with the overrides applied (ValueError, or pydantic's
    ValidationError for the validated fields, when invalid)."""
    base = _base_config(model_type)
    own = {k: overrides[k] for k in OWN if k in overrides}
    own["task"] = _task(model_type, own.get("task"))
    cfg = HFAutoConfig(model_type=model_type, **own)  # pydantic checks the values
    attrs = _small_attrs(base, cfg.seq_len, cfg.image_size, cfg.num_labels)
    have = base.to_dict() | attrs
    for key, text in overrides.items():
        if key in OWN:
            continue
        targets = [a for a in SHARED.get(key, ()) if a in have] or ([key] if key in have else [])
        if not targets:
            raise ValueError(f"hf:{model_type} has no option {key!r}; shared options: "
                             f"{', '.join(sorted(SHARED) + list(OWN))}, or any attribute of its config")
        for attr in targets:
            attrs[attr] = _coerce(key, text, have[attr])
    attrs |= _head_dim(have | attrs, set(overrides)) | _latent_kv_heads(have | attrs, set(overrides))
    vocab = attrs.get("vocab_size", have.get("vocab_size"))
    for attr in _TOKEN_IDS:  # special tokens of the full vocabulary, moved into the small one
        if isinstance(vocab, int) and isinstance(have.get(attr), int) and attrs.get(attr, have[attr]) >= vocab:
            attrs[attr] = vocab - 1
    return dataclasses.replace(cfg, attrs=attrs)


class LossOnly(nn.Module):
    """forward(*inputs) -> model(<input names>=...).loss"""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.model, self.names = model, tuple(names)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs))).loss


def _input_names(task: str) -> tuple[str, str]:
    return ("pixel_values", "labels") if task == "image-classification" else ("input_ids", "labels")


def _hf_config(cfg: HFAutoConfig) -> Any:
    """The architecture's config made with the attributes (its __init__ derives the rest)."""
    config = _base_config(cfg.model_type, **cfg.attrs)
    if hasattr(config, "_experts_implementation"):  # `experts`: see the module docstring
        config._experts_implementation = _experts_implementation(cfg.experts)
    if cfg.task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


def _experts_implementation(experts: str) -> str:
    if experts != "routed":
        return experts
    from hetsynth.zoo import hf_experts

    hf_experts.register()
    return hf_experts.NAME


def build(cfg: HFAutoConfig) -> nn.Module:
    t = _transformers()
    auto = getattr(t, _AUTO[cfg.task])
    try:
        try:
            model = auto.from_config(_hf_config(cfg), attn_implementation="sdpa")
        except (ValueError, ImportError):  # architectures without an sdpa path
            model = auto.from_config(_hf_config(cfg), attn_implementation="eager")
    except (AttributeError, KeyError, IndexError, AssertionError, NotImplementedError) as err:
        # transformers' own code failing on the config it made (for example DbrxAttentionConfig
        # without rope_theta in transformers 5.25): not the user's to fix by another size
        frames = traceback.extract_tb(err.__traceback__)
        where = next((f for f in reversed(frames) if Path(f.filename).name.startswith("modeling_")), frames[-1])
        raise ModelRefError(f"hf:{cfg.model_type}: transformers {t.__version__} cannot build this model from its "
                            f"config ({type(err).__name__}: {err}, in {Path(where.filename).name}:{where.lineno}); "
                            f"another model_type, or another transformers version, may") from None
    return LossOnly(model, _input_names(cfg.task))


def example_inputs(cfg: HFAutoConfig, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    if cfg.task == "image-classification":
        channels = int(cfg.attrs.get("num_channels", 3))
        return (torch.zeros(cfg.batch_size, channels, cfg.image_size, cfg.image_size,
                            dtype=getattr(torch, cfg.dtype), device=device),
                torch.zeros(cfg.batch_size, dtype=torch.long, device=device))
    shape = (cfg.batch_size, cfg.seq_len)
    return tuple(torch.zeros(shape, dtype=torch.long, device=device) for _ in range(2))


def _tokens(cfg: HFAutoConfig, sample_id: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = seeded_generator(seed, sample_id)
    tokens = torch.randint(3, cfg.vocab_size, (cfg.seq_len,), generator=g)
    if cfg.task == "masked-lm":
        masked = torch.rand(cfg.seq_len, generator=g) < 0.15
        masked[0] = True
        return tokens, torch.where(masked, tokens, torch.full_like(tokens, -100))
    if cfg.task == "seq2seq-lm":
        return tokens, torch.randint(3, cfg.vocab_size, (cfg.seq_len,), generator=g)
    return tokens, tokens.clone()


def make_batch(cfg: HFAutoConfig, sample_ids: Sequence[int], seed: int) -> tuple[torch.Tensor, ...]:
    if cfg.task == "image-classification":
        channels = int(cfg.attrs.get("num_channels", 3))
        return image_batch(channels, cfg.image_size, cfg.num_labels, getattr(torch, cfg.dtype), sample_ids, seed)
    pairs = [_tokens(cfg, i, seed) for i in sample_ids]
    if not pairs:
        empty = torch.zeros(0, cfg.seq_len, dtype=torch.long)
        return empty, empty.clone()
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def spec(ref: str, model_type: str, overrides: dict[str, str]) -> ModelSpec:
    """The ModelSpec of `hf:<model_type>[,k=v...]` (registered as the `hf` model resolver)."""
    if not model_type:
        raise ModelRefError("hf:<model_type> needs a HuggingFace model type, e.g. hf:llama or hf:t5")
    try:
        cfg = resolve(model_type, overrides)
    except ValidationError as err:
        raise config_error(ref, err) from None
    except ValueError as err:
        raise ModelRefError(str(err)) from None
    return ModelSpec(ref=ref, name=f"hf:{model_type}", config=cfg, _build=lambda: build(cfg),
                     _inputs=lambda device: example_inputs(cfg, device),
                     _batch=lambda ids, seed: make_batch(cfg, ids, seed))
