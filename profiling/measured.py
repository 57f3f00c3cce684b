"""A reference graph with measured costs: its ops and optimizer step timed on this machine
(profiling.op_profile) and, on an emulated cluster, each device kind's factor from timing the
whole model there (profiling.model_timing)."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import nn

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.models import parse_model_ref
from hetsynth.planner.capture import capture_spec
from hetsynth.profiling.model_timing import device_scales, time_on_cluster
from hetsynth.profiling.op_profile import measure_ops, model_seconds, one_thread
from hetsynth.runtime import emulation

log = logging.getLogger(__name__)


def capture_measured(ref: str, *, allow_replicate_fallback: bool = False,
                     cluster: ClusterSpec | None = None) -> ReferenceGraph:
    """The captured graph of `ref` with its ops timed on its own initialisation and first
    batch; with a `cluster` that is emulated here, also timed on its devices."""
    spec = parse_model_ref(ref)
    graph = capture_spec(spec, allow_replicate_fallback=allow_replicate_fallback)
    module, batch = spec.build("cpu"), spec.make_batch(range(spec.batch_size), seed=1)
    graph = measured(graph, module, batch)
    if cluster is not None and cluster.emulation is not None:
        graph = with_device_scales(graph, spec.ref, cluster, module, batch)
    return graph


def with_device_scales(graph: ReferenceGraph, ref: str, cluster: ClusterSpec, module: nn.Module,
                       batch: Sequence[torch.Tensor]) -> ReferenceGraph:
    """The timed graph with device_scales from timing `ref` on the emulated devices of
    `cluster` against this machine on the same rows of `batch` (unchanged, with a warning,
    where this machine cannot emulate)."""
    reason = emulation.unavailable()
    if reason is not None:
        log.warning("note: not timing %s on the emulated devices (%s); device speeds from their "
                    "matmul rates", ref, reason)
        return graph
    records = time_on_cluster(ref, cluster)
    with one_thread():
        reference = {rows: model_seconds(module, [t[:rows] for t in batch], 1.0)
                     for rows in sorted({r["rows"] for r in records if r["rows"] > 0})}
    scales = device_scales(records, reference)
    log.info("timed %s on the emulated devices: %s", ref, ", ".join(
        f"{kind} {scales[kind]:.2f}x this machine on the same rows "
        f"({graph.reference_flops / cluster.device_kinds[kind].throughput_flops:.2f}x by matmul rate)"
        for kind in sorted(scales)))
    return graph.model_copy(update={"device_scales": scales})


def measured(graph: ReferenceGraph, module: nn.Module, inputs: Sequence[torch.Tensor]) -> ReferenceGraph:
    """`graph` with each op's seconds measured on `module` and `inputs` (seeded)."""
    torch.manual_seed(0)
    return measure_ops(graph, module, inputs)


def measure_at(spec_ref: str, full: ReferenceGraph) -> Callable[[ReferenceGraph, int], ReferenceGraph]:
    """For pipeline micro-batches (planner.microbatch.micro_graphs): the graph of `spec_ref` at
    batch size b with its ops timed on the first b samples, as `measured` times the whole
    batch, and `full`'s device kind factors (timed on the emulated devices at the whole batch:
    a factor is a ratio of two machines at the same rows, not a time)."""
    spec = parse_model_ref(spec_ref)

    def at(graph: ReferenceGraph, b: int) -> ReferenceGraph:
        module = spec.build("cpu")
        timed = measured(graph, module, spec.make_batch(range(b), seed=1))
        return timed.model_copy(update={"device_scales": full.device_scales})
    return at
