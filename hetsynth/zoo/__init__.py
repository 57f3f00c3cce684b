"""The model zoo: plain-PyTorch benchmark models, each a factory with named presets.

Every model's `forward(*inputs)` returns the training loss. Presets share override names where
they apply (`num_layers`, `hidden`, `num_heads`, `ffn_hidden`, `seq_len`, `vocab_size`,
`batch_size`, `num_experts`, plus `dtype`); each model has a `tiny` preset for tests. Models
are referenced as `NAME:PRESET[,key=value...]` (see instruction_set.models). Each entry of `ZOO`
is registered as a model family when this package loads (the `hetsynth.models` entry point).
"""

from __future__ import annotations

from hetsynth.zoo import bert, gpt, hf, hf_auto, moe, resnet, torch_layers, vgg, vit
from hetsynth.instruction_set.models import ModelFamily as ZooModel
from hetsynth.instruction_set.models import ModelResolver, register_family, register_resolver


ZOO: dict[str, ZooModel] = {
    "gpt": ZooModel("gpt", "decoder-only transformer, causal attention, tied embeddings",
                    gpt.GPTConfig, gpt.PRESETS, gpt.build, gpt.example_inputs, gpt.make_batch),
    "bert": ZooModel("bert", "BERT-style encoder with a masked-LM head",
                     bert.BERTConfig, bert.PRESETS, bert.build, bert.example_inputs, bert.make_batch),
    "vit": ZooModel("vit", "vision transformer: patch conv, class token",
                    vit.ViTConfig, vit.PRESETS, vit.build, vit.example_inputs, vit.make_batch),
    "vgg": ZooModel("vgg", "VGG19, CIFAR-size input, 25088x4096 classifier",
                    vgg.VGGConfig, vgg.PRESETS, vgg.build, vgg.example_inputs, vgg.make_batch),
    "moe": ZooModel("moe", "transformer with top-2 gated mixture-of-experts FFNs",
                    moe.MoEConfig, moe.PRESETS, moe.build, moe.example_inputs, moe.make_batch),
    "resnet": ZooModel("resnet", "ResNet with BatchNorm in training mode, in-place residual adds",
                       resnet.ResNetConfig, resnet.PRESETS, resnet.build, resnet.example_inputs, resnet.make_batch),
    "torch": ZooModel("torch", "small models of torch.nn layer families (transformer, RNN, norms, convs)",
                      torch_layers.TorchLayersConfig, torch_layers.PRESETS, torch_layers.build,
                      torch_layers.example_inputs, torch_layers.make_batch),
    "hf-gpt2": ZooModel("hf-gpt2", "HuggingFace GPT2LMHeadModel from a config (needs transformers)",
                        hf.HFConfig, hf.PRESETS, hf.build_gpt2, hf.example_inputs, hf.make_gpt2_batch),
    "hf-bert": ZooModel("hf-bert", "HuggingFace BertForMaskedLM from a config (needs transformers)",
                        hf.HFConfig, hf.PRESETS, hf.build_bert, hf.example_inputs, hf.make_bert_batch),
}

for _family in ZOO.values():
    register_family(_family)
register_resolver(ModelResolver("hf", "hf:<model_type>", hf_auto.spec))

__all__ = ["ZOO", "ZooModel"]
