"""A pipeline's random draws, made whole once a step, so every micro-batch gets one device's values.

An SPMD rank program draws a random op's whole tensor where the op runs and keeps its window
(instruction_set.local.draw_whole). A pipeline cannot: its micro-batches run the op at their
own size, on the ranks of one stage, where one device draws the whole batch's tensor once,
after every draw of the model before it (torch's CPU generator has no offsets: a value's
position in the stream is fixed by all the draws before it). So at the start of each step
every rank makes the draws of the whole model (`Draws.make`): each random op of the
full-batch graph, in its order, at its shape, from the rank's generator (in one device's state
on every rank: the same seed and the same draws before), keeping those of its own stage's ops
(random ops, and attention with dropout: its weights' mask).
Micro-batch m, samples [o_m, o_m + b_m), reads its op's rows of them: along the dim whose
length is `b_m * k` at its size and `B * k` at the whole batch's (k rows per sample: a batch
dim folded with others), rows [o_m * k, (o_m + b_m) * k), and within them its SPMD window.
Every rank's generator ends the step where one device's does.

Cost: every rank draws every random op of the model at full batch size once a step (an SPMD
rank draws its program's ops whole too); dropout with p = 0 draws nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.local import (MAY_DRAW, SDPA, attention_drawn, attention_weights_shape, decoded, draws,
                                            on_window, sdpa_dropout, whole_draw)


class DrawShapeError(ValueError):
    """A micro-batch's random op is not a slice of the whole batch's along one dim."""


class Draws(nn.Module):
    """The whole draws of a step, for the ranks of one pipeline stage (module docstring).
    `offset`: the first sample of the micro-batch running now (the trainer sets it before each
    forward and backward action, so a recomputed block reads its own micro-batch's rows)."""

    def __init__(self, full: ReferenceGraph, batch: int, keep: set[str], device: torch.device) -> None:
        super().__init__()
        self.batch, self.device = batch, device
        self.made: list[tuple[Node, str, tuple[int, ...], torch.dtype, tuple, dict[str, Any]]] = []
        for node in full.calls:
            if node.target not in MAY_DRAW:
                continue
            a, k = decoded(node, [None] * len(node.inputs), device)
            if draws(node, a, k):
                self.made.append((node, *_whole_draw_of(full, node, a, k)))
        self.keep = keep & {node.name for node, *_ in self.made}
        self.whole = {node.name: node.outputs[0].shape for node, *_ in self.made}
        self.targets = {node.name: node.target for node, *_ in self.made}
        self.drawn: dict[str, Any] = {}
        self.offset = 0
        self._folds: dict[tuple[str, tuple[int, ...]], tuple[int, int] | None] = {}

    def holds(self, name: str) -> bool:
        """Whether node `name` of this stage draws (its values come from here)."""
        return name in self.keep

    def make(self) -> None:
        """This step's draws: every draw of the model, in order, whole; this stage's kept."""
        self.drawn = {}
        for node, target, whole, dtype, args, kwargs in self.made:
            drawn = whole_draw(target, whole, dtype, self.device, args, kwargs)
            if node.name in self.keep:
                self.drawn[node.name] = drawn

    def fold(self, name: str, micro_shape: Sequence[int]) -> tuple[int, int] | None:
        """(dim, rows per sample) of the batch in `name`'s output at a micro-batch size, None
        where its shape is the whole batch's; DrawShapeError where it is no such slice."""
        key = (name, tuple(micro_shape))
        if key not in self._folds:
            self._folds[key] = _fold(name, self.whole[name], tuple(micro_shape), self.batch)
        return self._folds[key]

    def forward(self, name: str, micro_shape: Sequence[int], starts: Sequence[int], *args: Any,
                **kwargs: Any) -> Any:
        """Node `name` on this rank's window (`starts` in its micro-batch's output) of this
        step's draw; `args`, `kwargs` the node's own."""
        fold = self.fold(name, micro_shape)
        starts = list(starts)
        if fold is not None:
            dim, per_sample = fold
            starts[dim] += self.offset * per_sample
        if self.targets[name] == SDPA:  # the weights' window: the output's, every key
            return attention_drawn(self.drawn[name], (*starts[:-1], 0), *args, **kwargs)
        return on_window(self.targets[name], self.drawn[name], starts, args[0])


def _whole_draw_of(full: ReferenceGraph, node: Node, a: tuple, k: dict[str, Any]
                   ) -> tuple[str, tuple[int, ...], torch.dtype, tuple, dict[str, Any]]:
    """(op drawn, whole shape, dtype, its arguments after the tensor, kwargs) of a node that
    draws, as the rank program would draw it in one go (instruction_set.local)."""
    dtype = getattr(torch, full.node(node.inputs[0]).out.dtype)
    if node.target == SDPA:
        whole = attention_weights_shape(node.outputs[0].shape, full.node(node.inputs[1]).out.shape[-2])
        return "aten.dropout.default", whole, dtype, (sdpa_dropout(a, k), True), {}
    return node.target, tuple(node.outputs[0].shape), dtype, tuple(a[1:]), k


def _fold(name: str, whole: Sequence[int], micro: Sequence[int], batch: int) -> tuple[int, int] | None:
    differ = [d for d, (w, m) in enumerate(zip(whole, micro)) if w != m]
    if not differ:
        return None
    d = differ[0]
    if len(differ) > 1 or len(whole) != len(micro) or whole[d] % batch:
        raise DrawShapeError(f"random op {name}: its output is {tuple(micro)} in a micro-batch and {tuple(whole)} "
                             f"for the whole batch of {batch}: not a slice of one dim, so the micro-batches cannot "
                             f"read one device's draws; pipeline it with one micro-batch")
    return d, whole[d] // batch
