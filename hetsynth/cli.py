"""The `hetsynth` command line: inspect, demo (plan, run, explain and profile come with their
issues). User errors print `error: ...` and exit with status 2."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from hetsynth.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetsynth", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (register, _) in COMMANDS.items():
        register(sub.add_parser(name, help=register.__doc__))
    return parser


class _Stderr(logging.Handler):
    """Prints library log records on the current sys.stderr (tests replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  {self.format(record)}", file=sys.stderr, flush=True)


def show_progress() -> None:
    """Library code logs what takes long (planning rounds, search progress) at INFO; the CLI
    prints those lines on stderr."""
    for name in ("planner", "hetsynth"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _Stderr) for h in logger.handlers):
            logger.addHandler(_Stderr())
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    show_progress()
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][1]
    try:
        return run(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130




