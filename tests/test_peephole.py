"""The cross-entropy peephole (runtime.peephole): the decomposed per-row loss of
planner.decompose becomes one F.cross_entropy call where a rank holds whole rows of the
logits, with the same loss and gradients in float64, and is left alone otherwise."""

from __future__ import annotations

import copy

import torch
from torch import fx

from hetsynth.planner.decompose import MEAN, _emit_cross_entropy
from hetsynth.runtime.peephole import fuse_cross_entropy

aten = torch.ops.aten


def decomposed(ignore: int = -100) -> fx.GraphModule:
    g = fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("t")
    x.meta["val"] = torch.empty(1, 1, dtype=torch.float64)
    g.output(_emit_cross_entropy(g, x, t, MEAN, ignore))
    return fx.GraphModule(torch.nn.Module(), g)


def loss_and_grad(gm: fx.GraphModule, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    loss = gm(x, t)
    loss.backward()
    return loss.detach(), x.grad


def test_rewrite_keeps_loss_and_gradients_in_float64() -> None:
    gm = decomposed()
    fused = copy.deepcopy(gm)
    merged = fuse_cross_entropy(fused.graph)
    assert len(merged) == 9 and len(set(merged.values())) == 1
    fused.recompile()
    targets = {n.target for n in fused.graph.nodes}
    assert torch.nn.functional.cross_entropy in targets and aten.exp.default not in targets
    torch.manual_seed(0)
    x = torch.randn(37, 11, dtype=torch.float64) * 5
    t = torch.randint(0, 11, (37,))
    t[[3, 8]] = -100  # ignored labels
    (l0, g0), (l1, g1) = loss_and_grad(gm, x, t), loss_and_grad(fused, x, t)
    assert torch.allclose(l0, l1, rtol=1e-12, atol=0) and torch.allclose(g0, g1, rtol=1e-10, atol=1e-14)
    assert torch.allclose(l1, torch.nn.functional.cross_entropy(x, t), rtol=1e-12, atol=0)


def test_chain_broken_by_another_op_is_left_alone() -> None:
    """A collective between the pieces (the logits split by classes: Pmax of the row max)
    stands in the chain: nothing is rewritten."""
    gm = decomposed()
    amax = next(n for n in gm.graph.nodes if n.target is aten.amax.default)
    with gm.graph.inserting_after(amax):
        reduced = gm.graph.call_function(aten.clone.default, (amax,))
    amax.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
    assert fuse_cross_entropy(gm.graph) == {}
    gm2 = decomposed()
    extra = next(n for n in gm2.graph.nodes if n.target is aten.exp.default)
    out = next(n for n in gm2.graph.nodes if n.op == "output")
    with gm2.graph.inserting_before(out):
        gm2.graph.call_function(aten.sum.default, (extra,))  # another reader of exp(z)
    assert fuse_cross_entropy(gm2.graph) == {}
