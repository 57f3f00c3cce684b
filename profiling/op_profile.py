"""Measured op times for planning on CPUs like this machine's (`hetsynth plan --measure-ops`).

A FLOP count and one throughput per device do not predict CPU kernels well: the first
convolutions of a CIFAR-size VGG run at a tenth of the matmul rate, the middle ones faster.
HAP profiles the ops; so does this: the reference graph runs once forward on real data (the
model's own initialisation and batch), then every op with work is timed forward and
backward on those inputs, sustained, on one thread; ops with equal signatures (repeated
layers) are timed once. The graph keeps each op's seconds and this machine's matmul rate
(`reference_flops`); the compute cost then charges device i `measured_s * reference_flops /
throughput_i` of an op's whole work, scaled by its share (cost_models.compute). The optimizer
step is timed the same way (`update_s`: seconds per parameter tensor and per byte). The op
times are finally scaled to add up to the whole model's forward and backward, timed too. Meaningful
when the planned devices are this machine's CPUs (the emulated cluster) or have its kind.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from hetsynth.cost_models.compute import FREE_OPS
from hetsynth.instruction_set.graph import Node, ReferenceGraph
from hetsynth.instruction_set.interpret import call_node, graph_inputs
from hetsynth.profiling.measure import matmul_throughput, sustained_seconds
from hetsynth.runtime.rank_state import scale_grads, squared_norm


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

    return steady_seconds(step, seconds)


def steady_seconds(fn: Any, seconds: float, repeats: int = 3) -> float:
    """The least of `repeats` sustained timings: one timing of a short op varies by a quarter
    from run to run on a shared machine, and other work only ever adds time, so the least is
    the closest to the op's own (the median let a planning run on a loaded machine time the
    emulated devices, whose quotas shield them, against a slowed reference: device factors
    and sharding ratios off by 4% in one run)."""
    return min(sustained_seconds(fn, seconds) for _ in range(repeats))


def measure_ops(graph: ReferenceGraph, module: nn.Module, inputs: Sequence[torch.Tensor], *,
                seconds: float = 0.05) -> ReferenceGraph:
    """The graph with measured_s on every op with work and this machine's reference_flops."""
    with one_thread():
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
        nodes = calibrate_to_model(nodes, model_seconds(module, inputs, 4 * seconds))
        reference = matmul_throughput(torch.device("cpu"), 0.3)
        update = measure_update([p for p in module.parameters() if p.requires_grad], seconds=4 * seconds)
    return graph.model_copy(update={"nodes": tuple(nodes), "reference_flops": reference,
                                     "update_s": update})


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the block (as every emulated device runs), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def model_seconds(module: nn.Module, inputs: Sequence[torch.Tensor], seconds: float) -> float:
    """Sustained seconds of the whole model's forward and backward on these inputs."""
    def step() -> None:
        module(*inputs).backward()
        module.zero_grad(set_to_none=True)

    return steady_seconds(step, seconds)


def calibrate_to_model(nodes: list[Node], whole_s: float) -> list[Node]:
    """Scale the op times so that they add up to the whole model's time. Timed alone, an op
    finds its inputs in cache; inside the model it does not (the activations of a CIFAR VGG
    at batch 384 exceed the caches), so the sum of isolated timings falls short of the
    model's step, by 10-30% here, more for models with big activations."""
    total = sum(n.measured_s or 0.0 for n in nodes)
    if total <= 0:
        return nodes
    factor = whole_s / total
    return [n.model_copy(update={"measured_s": n.measured_s * factor}) if n.measured_s is not None else n
            for n in nodes]


def _update_seconds(params: Sequence[torch.Tensor], seconds: float) -> float:
    """Sustained seconds of the runtime's step tail on these parameters (update_step)."""
    return steady_seconds(update_step(params)[0], seconds)


def update_step(params: Sequence[torch.Tensor]) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """The runtime's step tail on copies of `params` with random gradients: bucket flatten and
    copy-back of the gradients, the float64 global norm and the clipping rescale as the runtime
    computes them (runtime.rank_state: foreach norms, not a float64 copy of every gradient,
    which took longer than AdamW itself), AdamW; and the gradients it steps on."""
    leaves = [p.detach().clone().requires_grad_() for p in params]
    for p in leaves:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(leaves, lr=1e-6)

    def step() -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in leaves])
        offset = 0
        for p in leaves:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        grads = [p.grad for p in leaves]
        norm = float(squared_norm(grads).sqrt())
        # a rescale below 1 (so that it runs) that keeps the gradients' magnitude: repeated
        # clipping by max_norm / norm sank them into denormals within a few steps, where
        # AdamW runs several times slower than on real gradients
        scale_grads(grads, 1.0 - 1e-6 * min(1.0, norm))
        optimizer.step()

    return step, [p.grad for p in leaves]


def measure_update(params: Sequence[torch.Tensor], *, seconds: float = 0.2) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per byte) of the optimizer step: the model's
    parameters timed against as many one-element ones, the difference per byte."""
    whole = _update_seconds(params, seconds)
    tiny = _update_seconds([torch.zeros(1, dtype=p.dtype) for p in params], seconds)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return tiny / len(params), max(whole - tiny, 0.0) / max(nbytes, 1)
