"""Subcommands of the CLI: each is (add_arguments, run) in COMMANDS."""

from __future__ import annotations

import argparse
import json

from hetsynth import capture_model
from hetsynth.report import cluster_summary, cluster_summary_text, graph_summary_text


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


def inspect_args(p: argparse.ArgumentParser) -> None:
    """validate a cluster spec or capture a model and print its summary"""
    p.add_argument("--model", help="model reference, e.g. gpt:tiny or vit:paper,num_layers=24")
    p.add_argument("--cluster", help="cluster spec (.toml or .json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--allow-replicate-fallback", action="store_true",
                   help="accept ops without a sharding rule as replicated-only ops")


def inspect_run(args: argparse.Namespace) -> int:
    from cost_models.cluster import load_cluster
    from planner.capture import summarize

    if not args.model and not args.cluster:
        raise ValueError("inspect needs --model REF and/or --cluster FILE")
    out: dict = {}
    if args.cluster:
        out["cluster"] = cluster_summary(load_cluster(args.cluster))
    if args.model:
        graph = capture_model(args.model, allow_replicate_fallback=args.allow_replicate_fallback)
        out["model"] = summarize(graph)
    if args.json:
        _print_json(out)
        return 0
    texts = [cluster_summary_text(out["cluster"])] if "cluster" in out else []
    texts += [graph_summary_text(out["model"])] if "model" in out else []
    print("\n\n".join(texts))
    return 0


def demo_args(p: argparse.ArgumentParser) -> None:
    """the README demo: capture a zoo model for the local emulated cluster"""
    p.add_argument("--model", default="gpt:small-cpu")
    p.add_argument("--cluster", default="configs/clusters/local-emulated.toml")


def demo_run(args: argparse.Namespace) -> int:
    from hetsynth.demo import run_demo

    return run_demo(args)


COMMANDS = {
    "inspect": (inspect_args, inspect_run),
    "demo": (demo_args, demo_run),
}
