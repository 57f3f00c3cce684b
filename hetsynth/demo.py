"""`make demo`: capture GPT small-cpu and show the emulated cluster it will be planned for."""

from __future__ import annotations

import argparse
import time

from cost_models.cluster import load_cluster
from hetsynth import capture_model
from hetsynth.report import cluster_summary, cluster_summary_text, graph_summary_text
from planner.capture import summarize


def run_demo(args: argparse.Namespace) -> int:
    print(cluster_summary_text(cluster_summary(load_cluster(args.cluster))))
    start = time.perf_counter()
    graph = capture_model(args.model)
    print(f"\ncaptured {args.model} in {time.perf_counter() - start:.2f} s\n")
    print(graph_summary_text(summarize(graph)))
    return 0
