"""Measured op times for planning on CPUs like this machine's (`hetsynth plan --measure-ops`).

A FLOP count and one throughput per device do not predict CPU kernels well: the first
convolutions of a CIFAR-size VGG run at a tenth of the matmul rate, the middle ones faster.
HAP profiles the ops; so does this: the reference graph runs once forward on real data (the
model's own initialisation and batch), then every op with work is timed forward and
backward on those inputs, sustained, on one thread; ops with equal signatures (repeated
layers) are timed once. The graph keeps each op's seconds and this machine's matmul rate
(`reference_flops`); the compute cost then charges device i `measured_s * reference_flops /
throughput_i` of an op's whole work, scaled by its share (cost_models.compute). Meaningful
when the planned devices are this machine's CPUs (the emulated cluster) or have its kind.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
from torch import nn

from cost_models.compute import FREE_OPS
from cost_models.measure import matmul_throughput, sustained_seconds
from instruction_set.graph import Node, ReferenceGraph
from instruction_set.interpret import call_node, graph_inputs


def _signature(node: Node, env: dict[str, Any]) -> str:
    shapes = [[list(env[t].shape), str(env[t].dtype)] if torch.is_tensor(env[t]) else t for t in node.inputs]
    return json.dumps([node.target, shapes, node.args, node.kwargs], default=str, sort_keys=True)


def _time_op(node: Node, env: dict[str, Any], graph: ReferenceGraph, seconds: float) -> float:
    """Sustained seconds of the op forward plus backward (when a gradient flows)."""
    leaves = {}
    for t in node.inputs:
        value = env[t]
        needs = torch.is_tensor(value) and value.is_floating_point() and graph.node(t).out.requires_grad
        leaves[t] = value.detach().requires_grad_(needs) if torch.is_tensor(value) else value
    grad_in = [v for v in leaves.values() if torch.is_tensor(v) and v.requires_grad]

    def step() -> None:
        out = call_node(node, leaves, torch.device("cpu"))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if torch.is_tensor(o) and o.requires_grad]
        if outs and grad_in:
            torch.autograd.grad(outs, grad_in, [torch.ones_like(o) for o in outs], allow_unused=True)

    return sustained_seconds(step, seconds)


def measure_ops(graph: ReferenceGraph, module: nn.Module, inputs: Sequence[torch.Tensor], *,
                seconds: float = 0.05) -> ReferenceGraph:
    """The graph with measured_s on every op with work and this machine's reference_flops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        env: dict[str, Any] = {k: v.detach() for k, v in graph_inputs(graph, module, tuple(inputs)).items()}
        with torch.no_grad():
            for node in graph.calls:
                env[node.name] = call_node(node, env, torch.device("cpu"))
        timed: dict[str, float] = {}
        nodes = []
        for node in graph.nodes:
            if node.op != "call" or node.target in FREE_OPS:
                nodes.append(node)
                continue
            key = _signature(node, env)
            if key not in timed:
                timed[key] = _time_op(node, env, graph, seconds)
            nodes.append(node.model_copy(update={"measured_s": timed[key]}))
        reference = matmul_throughput(torch.device("cpu"), 0.3)
    finally:
        torch.set_num_threads(threads)
    return graph.model_copy(update={"nodes": tuple(nodes), "reference_flops": reference})
