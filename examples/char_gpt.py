"""A character-level GPT trained on Python's own standard-library sources, with hetsynth.

    python examples/char_gpt.py plan -o plan.json [--cluster configs/clusters/local-emulated.toml] [--size tiny]
                                  [--precision fp32|bf16|fp16|auto]
    hetsynth launch plan.json examples/char_gpt.py train --steps 200 [--losses losses.json]

`plan` captures the model with a batch of example inputs and synthesizes a plan for the
cluster; `train` runs on every rank of it (hetsynth launch sets HETSYNTH_PLAN): the same
seeded model on each rank, `hetsynth.parallelize`, each rank's rows of every batch from
`hetsynth.data.loader`, and an ordinary AdamW loop with a warmup + cosine schedule.
"""

import argparse
import json
import math
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZES = {  # layers, hidden, heads, sequence length, global batch size
    "tiny": dict(num_layers=2, hidden=64, num_heads=4, seq_len=64, batch_size=32),
    "small": dict(num_layers=4, hidden=128, num_heads=4, seq_len=128, batch_size=64),
}
VOCAB = 128  # ASCII; anything else reads as '?'
SOURCES = ("textwrap.py", "argparse.py", "functools.py", "dataclasses.py", "inspect.py")


class Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.num_heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharGPT(nn.Module):
    """forward(ids[B, S], targets[B, S]) -> mean next-character cross-entropy."""

    def __init__(self, num_layers: int, hidden: int, num_heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, num_heads) for _ in range(num_layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make(size: str = "tiny") -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model and a batch of example inputs (also the model reference of the plan)."""
    cfg = SIZES[size]
    model = CharGPT(cfg["num_layers"], cfg["hidden"], cfg["num_heads"], cfg["seq_len"])
    ids = torch.zeros(cfg["batch_size"], cfg["seq_len"], dtype=torch.long)
    return model, (ids, ids.clone())


class Windows(Dataset):
    """Item i: (text[i*S : (i+1)*S], text[i*S+1 : (i+1)*S+1]) of a long tensor of characters."""

    def __init__(self, text: torch.Tensor, seq_len: int) -> None:
        self.text, self.seq_len = text, seq_len

    def __len__(self) -> int:
        return (len(self.text) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def stdlib_text() -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in SOURCES)
    return torch.tensor(list(text.encode("ascii", "replace")), dtype=torch.long)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def plan(args: argparse.Namespace) -> None:
    import hetsynth

    model, inputs = make(args.size)
    ref = f"{os.path.relpath(__file__)}:make,size={args.size}"
    made = hetsynth.plan(model, inputs, hetsynth.load_cluster(args.cluster), model_ref=ref, precision=args.precision)
    hetsynth.save_plan(made, args.output)
    print(f"{args.output}: {made.cluster.num_devices} devices, precision {made.precision_policy().describe()}, "
          f"predicted step {made.predicted.step_time_s * 1e3:.1f} ms")


def train(args: argparse.Namespace) -> None:
    import hetsynth
    from hetsynth.data import loader
    from hetsynth.instruction_set.files import write_atomic

    the_plan = hetsynth.load_plan(os.environ["HETSYNTH_PLAN"])
    size = dict(kv.split("=") for kv in the_plan.model.ref.split(",")[1:])["size"]  # examples/char_gpt.py:make,size=...
    torch.manual_seed(0)  # every rank starts from the same weights
    model, _ = make(size)
    pm = hetsynth.parallelize(model, the_plan)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    text, seq_len = stdlib_text(), SIZES[size]["seq_len"]
    split = int(0.9 * len(text))  # the last tenth is held out
    train_set, held_out = Windows(text[:split], seq_len), Windows(text[split:], seq_len)

    flat = {n for n, p in model.named_parameters() if p.dim() < 2}  # biases and norms: no weight decay
    params = list(pm.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params if n not in flat], "weight_decay": 0.1},
                             {"params": [p for n, p in params if n in flat], "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, args.steps // 10), args.steps))

    data, losses, times, epoch = loader(train_set, the_plan, shuffle=True, seed=0), [], [], 0
    while len(losses) < args.steps:
        data.set_epoch(epoch)
        for batch in data:
            start = time.perf_counter()
            loss = pm(*batch)
            pm.scaler.scale(loss).backward()  # the plan's loss scaler: a no-op unless a device computes in fp16
            pm.scaler.unscale_(opt)
            pm.clip_grad_norm_(1.0)
            lr = sched.get_last_lr()[0]
            pm.scaler.step(opt)
            pm.scaler.update()
            sched.step()
            opt.zero_grad()
            losses.append(pm.global_loss(loss))
            times.append((time.perf_counter() - start) * 1e3)
            if rank0 and (len(losses) % args.log_every == 0 or len(losses) == 1):
                print(f"step {len(losses):5d}  loss {losses[-1]:.4f}  lr {lr:.2e}  {times[-1]:.1f} ms/step")
            if len(losses) == args.steps:
                break
        epoch += 1

    with torch.no_grad():
        held = [pm.global_loss(pm(*batch)) for batch in loader(held_out, the_plan)]
    if rank0:
        ms, held_out_loss = statistics.median(times[1:] or times), sum(held) / len(held)
        print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}  median {ms:.1f} ms/step")
        print(f"held-out loss {held_out_loss:.4f} over {len(held)} batches")
        if args.losses:
            write_atomic(args.losses, json.dumps({"losses": losses, "ms_per_step": ms, "held_out_loss": held_out_loss,
                                                  "size": size, "cluster": the_plan.cluster.name}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the model for a cluster")
    p.add_argument("-o", "--output", default="plan.json")
    p.add_argument("--cluster", default="configs/clusters/local-emulated.toml")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16", "auto"), default="fp32",
                   help="what each device kind computes in (bf16/fp16 under autocast, float32 master weights)")
    t = sub.add_parser("train", help="train under the plan in $HETSYNTH_PLAN (hetsynth launch)")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--losses", help="write the loss curve here (JSON)")
    args = parser.parse_args()
    plan(args) if args.command == "plan" else train(args)


if __name__ == "__main__":
    main()
