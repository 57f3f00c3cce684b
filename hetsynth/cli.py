"""The `hetsynth` command line (COMMANDS). User errors (and inputs that cannot be read) print
`error: ...` and exit with status 2; a run that fails prints `error: ...` naming the failed
rank and exits with status 1. Every command first removes what dead runs left behind
(runtime.runstate)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from hetsynth.commands import COMMANDS
from hetsynth.checkpoint_commands import COMMANDS as _CHECKPOINT_COMMANDS

COMMANDS = {**COMMANDS, **_CHECKPOINT_COMMANDS}


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
    logger = logging.getLogger("hetsynth")  # every module of the project logs below it
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    from hetsynth.runtime.emulation import EmulationError
    from hetsynth.runtime.run_errors import RunFailed
    from hetsynth.runtime.quick_exit import freeze_at_exit

    freeze_at_exit()
    args = build_parser().parse_args(argv)
    show_progress()
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][1]
    if args.command != "cleanup":
        remove_dead_runs()
    try:
        return run(args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RunFailed, EmulationError) as err:  # the run failed, not the user: status 1
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an input this user may not read, or one that is not a file
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RecursionError:
        print("error: an input file nests too deeply to read", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def remove_dead_runs() -> None:
    """What runs killed before they could clean up left behind (runtime.runstate), removed
    before every command; a note says what."""
    from hetsynth.runtime.runstate import remove_dead_runs as remove

    try:
        for line in remove():
            print(f"note: {line}", file=sys.stderr)
    except OSError as err:
        print(f"note: could not remove what dead runs left ({err}); see `hetsynth cleanup`", file=sys.stderr)
