"""A small CNN on scikit-learn's bundled handwritten digits (8 x 8 images, 10 classes), with hetsynth.

    python examples/digits_cnn.py plan -o plan.json [--cluster configs/clusters/local-emulated.toml]
    hetsynth launch plan.json examples/digits_cnn.py train --steps 200

The module's forward returns the loss, as hetsynth captures it; the test accuracy at the end
is measured on rank 0 with the plain model, after loading the trained weights into it
(`pm.state_dict(rank0_only=True)`).
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

BATCH_SIZE = 64


class CNN(nn.Module):
    """forward(images[B, 1, 8, 8], labels[B]) -> mean cross-entropy; `logits(images)` for evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)       # 32 x 2 x 2
        return self.fc(x.flatten(1))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


def make() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model and a batch of example inputs (also the model reference of the plan)."""
    return CNN(), (torch.zeros(BATCH_SIZE, 1, 8, 8), torch.zeros(BATCH_SIZE, dtype=torch.long))


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The train and test splits (80 / 20, fixed seed), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    def tensors(x, y) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y))
    return tensors(x_train, y_train), tensors(x_test, y_test)


def plan(args: argparse.Namespace) -> None:
    import hetsynth

    model, inputs = make()
    made = hetsynth.plan(model, inputs, hetsynth.load_cluster(args.cluster),
                         model_ref=f"{os.path.relpath(__file__)}:make")
    hetsynth.save_plan(made, args.output)
    print(f"{args.output}: {made.cluster.num_devices} devices, "
          f"predicted step {made.predicted.step_time_s * 1e3:.1f} ms")


def train(args: argparse.Namespace) -> None:
    import hetsynth
    from hetsynth.data import loader

    the_plan = hetsynth.load_plan(os.environ["HETSYNTH_PLAN"])
    torch.manual_seed(0)  # every rank starts from the same weights
    model, _ = make()
    pm = hetsynth.parallelize(model, the_plan)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    train_set, test_set = digits()
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / args.steps)

    data, losses, times, epoch = loader(train_set, the_plan, shuffle=True, seed=0), [], [], 0
    while len(losses) < args.steps:
        data.set_epoch(epoch)
        for batch in data:
            start = time.perf_counter()
            loss = pm(*batch)
            loss.backward()
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
        model.load_state_dict(state)
        images, labels = test_set.tensors
        with torch.no_grad():
            accuracy = (model.logits(images).argmax(1) == labels).float().mean().item()
        print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}  "
              f"median {statistics.median(times[1:] or times):.1f} ms/step")
        print(f"test accuracy {accuracy:.3f} on {len(labels)} images")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the model for a cluster")
    p.add_argument("-o", "--output", default="plan.json")
    p.add_argument("--cluster", default="configs/clusters/local-emulated.toml")
    t = sub.add_parser("train", help="train under the plan in $HETSYNTH_PLAN (hetsynth launch)")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=1e-2)
    t.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    plan(args) if args.command == "plan" else train(args)


if __name__ == "__main__":
    main()
