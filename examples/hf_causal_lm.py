"""A HuggingFace causal language model (GPT-2 or Llama, from a small config) trained with hetsynth
on Python's standard-library sources, one byte per token, and saved back as a plain HF model.

    python examples/hf_causal_lm.py plan -o plan.json [--arch gpt2|llama] [--cluster CLUSTER.toml]
    hetsynth launch plan.json examples/hf_causal_lm.py train --steps 200 [--save-pretrained out/]

hetsynth captures a forward that returns the loss, so the HF model is wrapped in `LM`, whose
forward passes labels and returns `.loss` (the model shifts the labels itself). The config
turns off what capture cannot use or compare: dropout and the KV cache.
"""

import argparse
import math
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, SEQ_LEN, BATCH_SIZE = 256, 64, 32  # bytes
SOURCES = ("textwrap.py", "argparse.py", "functools.py", "dataclasses.py", "inspect.py")


def hf_model(arch: str) -> nn.Module:
    import transformers

    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                         bos_token_id=0, eos_token_id=0)
    elif arch == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=SEQ_LEN, use_cache=False,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        raise ValueError(f"arch {arch!r}: use gpt2 or llama")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name maps to no loss: transformers would warn
    return model


class LM(nn.Module):
    """forward(ids[B, S], labels[B, S]) -> the HF model's mean next-token cross-entropy."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids, labels=labels).loss


def make(arch: str = "gpt2") -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The wrapped model and a batch of example inputs (also the model reference of the plan)."""
    ids = torch.zeros(BATCH_SIZE, SEQ_LEN, dtype=torch.long)
    return LM(hf_model(arch)), (ids, ids.clone())


class Windows(Dataset):
    """Item i: the bytes text[i*S : (i+1)*S] as both input and labels."""

    def __init__(self, text: torch.Tensor) -> None:
        self.text = text

    def __len__(self) -> int:
        return len(self.text) // SEQ_LEN

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i * SEQ_LEN: (i + 1) * SEQ_LEN]
        return chunk, chunk.clone()


def stdlib_bytes() -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return torch.tensor(list(b"".join((stdlib / name).read_bytes() for name in SOURCES)), dtype=torch.long)


def plan(args: argparse.Namespace) -> None:
    import hetsynth

    model, inputs = make(args.arch)
    ref = f"{os.path.relpath(__file__)}:make,arch={args.arch}"
    made = hetsynth.plan(model, inputs, hetsynth.load_cluster(args.cluster), model_ref=ref)
    hetsynth.save_plan(made, args.output)
    print(f"{args.output}: {made.cluster.num_devices} devices, "
          f"predicted step {made.predicted.step_time_s * 1e3:.1f} ms")


def train(args: argparse.Namespace) -> None:
    import hetsynth
    from hetsynth.data import loader

    the_plan = hetsynth.load_plan(os.environ["HETSYNTH_PLAN"])
    arch = dict(kv.split("=") for kv in the_plan.model.ref.split(",")[1:])["arch"]  # examples/...py:make,arch=...
    torch.manual_seed(0)  # every rank starts from the same weights
    model, _ = make(arch)
    pm = hetsynth.parallelize(model, the_plan)
    rank0 = int(os.environ.get("RANK", "0")) == 0

    flat = {n for n, p in model.named_parameters() if p.dim() < 2}  # biases and norms: no weight decay
    params = list(pm.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params if n not in flat], "weight_decay": 0.1},
                             {"params": [p for n, p in params if n in flat], "weight_decay": 0.0}], lr=args.lr)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))

    data, losses, times, epoch = loader(Windows(stdlib_bytes()), the_plan, shuffle=True, seed=0), [], [], 0
    while len(losses) < args.steps:
        data.set_epoch(epoch)
        for batch in data:
            start = time.perf_counter()
            loss = pm(*batch)
            loss.backward()
            pm.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(pm.global_loss(loss))
            times.append((time.perf_counter() - start) * 1e3)
            if rank0 and (len(losses) % args.log_every == 0 or len(losses) == 1):
                print(f"step {len(losses):5d}  loss {losses[-1]:.4f}  {times[-1]:.1f} ms/step")
            if len(losses) == args.steps:
                break
        epoch += 1

    state = pm.state_dict(rank0_only=True)  # every rank takes part; rank 0 gets the whole tensors
    if rank0:
        print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}  "
              f"median {statistics.median(times[1:] or times):.1f} ms/step")
        if args.save_pretrained:
            model.hf.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, strict=True)
            model.hf.save_pretrained(args.save_pretrained)
            print(f"saved the trained {arch} model to {args.save_pretrained}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the model for a cluster")
    p.add_argument("-o", "--output", default="plan.json")
    p.add_argument("--cluster", default="configs/clusters/local-emulated.toml")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    t = sub.add_parser("train", help="train under the plan in $HETSYNTH_PLAN (hetsynth launch)")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--save-pretrained", metavar="DIR", help="save the trained model here (save_pretrained)")
    args = parser.parse_args()
    plan(args) if args.command == "plan" else train(args)


if __name__ == "__main__":
    main()
