"""Run a reference graph on one device: the single-device semantics that every plan must match.

`run_graph(graph, values)` evaluates the graph's ops in order on real tensors, given the
values of its params, buffers and inputs by node name, and returns the loss.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from hetsynth.instruction_set.args import decode_arg
from hetsynth.instruction_set.graph import Node, ReferenceGraph


def resolve_target(target: str) -> Any:
    """'aten.linear.default' -> torch.ops.aten.linear.default; 'getitem' -> operator.getitem."""
    if target == "getitem":
        return operator.getitem
    namespace, op, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def copy_into(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """aten.copy (the functional form of `self.copy_(src)`, which torch.export records for a
    slice assignment such as `x[..., :d] = y`): `src` broadcast to self's shape, in self's dtype
    and on its device. aten.copy has no autograd formula ("derivative for aten::copy is not
    implemented"); this form's gradient is the same: d/d src is the incoming gradient summed
    over the broadcast dims (cast back), d/d self is zero (self's values are overwritten)."""
    return src.to(dtype=self.dtype, device=self.device, non_blocking=non_blocking).expand(self.shape).clone()


# Views run as reshapes: the graph records `view` where the traced tensor's strides allowed
# it, but strides are not part of the graph, and a kernel may lay out its output otherwise at
# run time (sdpa's output on another device or dtype); reshape views when it can, else copies.
RUN_AS = {"aten.view.default": torch.ops.aten.reshape.default,
          "aten._unsafe_view.default": torch.ops.aten.reshape.default,
          "aten.copy.default": copy_into}


def run_target(target: str) -> Any:
    """The callable that runs a graph node's op (RUN_AS, else the op itself)."""
    return RUN_AS.get(target) or resolve_target(target)


def call_node(node: Node, env: Mapping[str, Any], device: torch.device) -> Any:
    args = decode_arg(list(node.args), env.__getitem__, device)
    kwargs = {k: decode_arg(v, env.__getitem__, device) for k, v in node.kwargs.items()}
    return run_target(node.target)(*args, **kwargs)


def run_graph(graph: ReferenceGraph, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    env: dict[str, Any] = dict(values)
    device = next(iter(values.values())).device if values else torch.device("cpu")
    for node in graph.calls:
        env[node.name] = call_node(node, env, device)
    return env[graph.loss]


def constant(node: Node, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor of a constant node (a buffer with a value)."""
    return torch.tensor(node.value, dtype=getattr(torch, node.out.dtype), device=device).reshape(node.out.shape)


def graph_inputs(graph: ReferenceGraph, module: torch.nn.Module,
                 inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Values of the graph's params, buffers (by fully-qualified name) and user inputs."""
    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    user = iter(inputs)
    out = {}
    for node in graph.nodes:
        if node.value is not None:
            out[node.name] = constant(node)
        elif node.op in ("param", "buffer"):
            out[node.name] = state[node.fqn]
        elif node.op == "input":
            out[node.name] = next(user)
    return out
