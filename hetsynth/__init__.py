"""hetsynth: plan and run SPMD training of PyTorch models on heterogeneous GPU clusters.

Public API (see README):

    graph = hetsynth.capture_model("gpt:tiny")              # reference graph
    cluster = hetsynth.load_cluster("configs/clusters/a100-t4.toml")
    plan = hetsynth.plan("gpt:tiny", cluster=cluster)       # or plan(module, example_inputs, cluster)
    hetsynth.save_plan(plan, "plan.json")
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from cost_models.cluster import ClusterSpec, load_cluster
from instruction_set.graph import ReferenceGraph
from instruction_set.plan import Plan, load_plan, save_plan

__version__ = "0.1.0"


def capture_model(model: str | nn.Module, example_inputs: Sequence[torch.Tensor] | None = None, *,
                  allow_replicate_fallback: bool = False) -> ReferenceGraph:
    """Capture a model reference (`gpt:tiny`) or a module with its example inputs."""
    from hetsynth.models import parse_model_ref
    from planner.capture import capture

    if isinstance(model, str):
        spec = parse_model_ref(model)
        return capture(spec.build("meta"), spec.example_inputs("meta"), model_ref=spec.ref,
                       allow_replicate_fallback=allow_replicate_fallback)
    if example_inputs is None:
        raise ValueError("capture_model(module, example_inputs): example_inputs are required for a module")
    return capture(model, example_inputs, model_ref=type(model).__name__,
                   allow_replicate_fallback=allow_replicate_fallback)


def plan(model: str | nn.Module, example_inputs: Sequence[torch.Tensor] | None = None,
         cluster: ClusterSpec | str | None = None, *, batch_size: int | None = None,
         num_devices: int | None = None, ratios: Sequence[float] | None = None,
         allow_replicate_fallback: bool = False, progress: bool = False,
         measure_ops: bool = False, data_parallel: bool = False) -> Plan:
    """Synthesize a Plan for a model reference or a module with its example inputs.
    `measure_ops` times the model's ops on this machine (planner.op_profile): for clusters of
    this machine's CPUs, such as the emulated one (a model reference is then also timed on
    the emulated devices, runtime.model_timing). `data_parallel` searches only data-parallel
    programs (the batch split, parameters replicated); the ratios, the collective variants and
    SFB are still the cost model's choices."""
    from hetsynth.models import parse_model_ref, with_overrides
    from planner.feasibility import check_training_state_fits
    from planner.planner import DP_SEED, make_plan

    if cluster is None:
        raise ValueError("plan() needs a cluster (a ClusterSpec or a spec file path)")
    spec = load_cluster(cluster) if isinstance(cluster, str) else cluster
    if num_devices is not None:
        spec = spec.first(num_devices)
    if isinstance(model, str):
        ref = parse_model_ref(model)
        if batch_size is not None:
            ref = with_overrides(ref, batch_size=batch_size)
        graph = capture_model(ref.ref, allow_replicate_fallback=allow_replicate_fallback)
        check_training_state_fits(graph, spec)  # before timing anything
        if measure_ops:
            graph = capture_measured(ref.ref, allow_replicate_fallback=allow_replicate_fallback, cluster=spec)
    else:
        if example_inputs is None:
            raise ValueError("plan(module, example_inputs, cluster): example_inputs are required")
        if batch_size is not None:
            raise ValueError("batch_size applies to model references; slice example_inputs instead")
        graph = capture_model(model, example_inputs, allow_replicate_fallback=allow_replicate_fallback)
        check_training_state_fits(graph, spec)
        if measure_ops:
            if any(t.is_meta for t in example_inputs):
                raise ValueError("measure_ops needs real example inputs (not on the meta device)")
            graph = _measured(graph, model, example_inputs)
    return make_plan(graph, spec, ratios=ratios, progress=progress,
                     restrictions=DP_SEED if data_parallel else None)


def capture_measured(ref: str, *, allow_replicate_fallback: bool = False,
                     cluster: ClusterSpec | None = None) -> ReferenceGraph:
    """capture_model(ref) with the model's ops and optimizer step timed on this machine, on
    its own initialisation and first batch (planner.op_profile; `hetsynth plan --measure-ops`).
    With a `cluster` that is emulated here, the model is also timed on its devices
    (runtime.model_timing) and the graph records each device kind's factor."""
    from hetsynth.models import parse_model_ref

    spec = parse_model_ref(ref)
    graph = capture_model(spec.ref, allow_replicate_fallback=allow_replicate_fallback)
    module, batch = spec.build("cpu"), spec.make_batch(range(spec.batch_size), seed=1)
    graph = _measured(graph, module, batch)
    if cluster is not None and cluster.emulation is not None:
        graph = with_device_scales(graph, spec.ref, cluster, module, batch)
    return graph


def with_device_scales(graph: ReferenceGraph, ref: str, cluster: ClusterSpec, module: nn.Module,
                       batch: Sequence[torch.Tensor]) -> ReferenceGraph:
    """The timed graph with device_scales from timing `ref` on the emulated devices of
    `cluster` against this machine on the same rows of `batch` (unchanged, with a note,
    where this machine cannot emulate)."""
    from planner.op_profile import model_seconds, one_thread
    from runtime import emulation
    from runtime.model_timing import device_scales, time_on_cluster

    reason = emulation.unavailable()
    if reason is not None:
        print(f"note: not timing {ref} on the emulated devices ({reason}); device speeds from their "
              f"matmul rates", flush=True)
        return graph
    records = time_on_cluster(ref, cluster)
    with one_thread():
        reference = {rows: model_seconds(module, [t[:rows] for t in batch], 1.0)
                     for rows in sorted({r["rows"] for r in records if r["rows"] > 0})}
    scales = device_scales(records, reference)
    print(f"timed {ref} on the emulated devices: " + ", ".join(
        f"{kind} {scales[kind]:.2f}x this machine on the same rows "
        f"({graph.reference_flops / cluster.device_kinds[kind].throughput_flops:.2f}x by matmul rate)"
        for kind in sorted(scales)), flush=True)
    return graph.model_copy(update={"device_scales": scales})


def _measured(graph: ReferenceGraph, module: nn.Module, inputs: Sequence[torch.Tensor]) -> ReferenceGraph:
    from planner.op_profile import measure_ops

    torch.manual_seed(0)
    return measure_ops(graph, module, inputs)


__all__ = ["ClusterSpec", "Plan", "ReferenceGraph", "capture_measured", "capture_model", "load_cluster", "load_plan",
           "plan", "save_plan", "__version__"]
