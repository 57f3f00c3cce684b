"""One rank of `hetsynth launch`: a user's script under torchrun
(`python -m hetsynth.runtime.script_runner SCRIPT [ARGS...]`).

What runtime.rank.run_rank does for the project's own workers, less the process group (the
script creates its own, or hetsynth.parallelize does): die with this rank's agent
(PR_SET_PDEATHSIG SIGKILL, runtime.agent), keep this rank's heartbeat (runtime.heartbeat: the
status file the launcher watches, so that a stopped or killed rank is named), join this
rank's emulated device when there is one (runtime.emulation), and log the project's records
with the rank in front (runtime.logs). Then the script runs as `python SCRIPT ARGS` would run
it: `runpy.run_path(SCRIPT, run_name="__main__")` with `sys.argv == [SCRIPT, *ARGS]` and the
script's directory first on sys.path. Its stdout and stderr lines get `rank N ` in front (the
launcher merges every rank's output into one stream).

The exit status is the script's: 0 when it returns or calls `sys.exit(0)`; `sys.exit(n)`
exits n and `sys.exit("message")` prints the message and exits 1, as Python does. Any other
exception is the rank's failure: `<Type>: <message>` goes into the status file (the
launcher's failure line, `rank N failed: ...`), the traceback of the script's own frames is
printed, and the exit status is 1.

Nothing here imports torch: a script that does not need it starts in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from types import TracebackType
from typing import TextIO

from hetsynth.runtime.quick_exit import freeze_at_exit
from hetsynth.runtime.parent import die_with_agent
from hetsynth.runtime.emulation import join_device, leave_device
from hetsynth.runtime.heartbeat import Heartbeat
from hetsynth.runtime.logs import configure_rank_logging

log = logging.getLogger("hetsynth.runtime.script_runner")  # not __name__: this module runs as __main__
USAGE = "usage: python -m hetsynth.runtime.script_runner SCRIPT [ARGS...]"


class RankPrefixed:
    """A text stream that puts `rank N ` in front of every line written to `stream`. Whole
    lines are written at once (a pipe shared by the ranks keeps them whole); a partial line
    waits for its end or for flush(), which writes it (its end then goes on without a second
    prefix). Anything else (fileno, encoding, ...) is the stream's."""

    def __init__(self, stream: TextIO, rank: int) -> None:
        self._stream, self._prefix = stream, f"rank {rank} "
        self._partial, self._mid_line = "", False  # a line's start not yet written; or written by flush()

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            first = lines[0] if self._mid_line else self._prefix + lines[0]
            self._stream.write("".join([f"{first}\n", *(f"{self._prefix}{line}\n" for line in lines[1:])]))
            self._mid_line = False
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._stream.write(self._partial if self._mid_line else self._prefix + self._partial)
            self._partial, self._mid_line = "", True
        self._stream.flush()

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def exit_message(code: object) -> tuple[int, str | None]:
    """(exit status, failure message or None) of `SystemExit(code)`, as Python's own exit
    treats the code: None and 0 succeed, an int is the status, anything else is printed and 1."""
    if code is None or code == 0:
        return 0, None
    if isinstance(code, int):
        return code, f"exited with status {code} (sys.exit)"
    return 1, f"SystemExit: {code}"


def script_traceback(err: BaseException, script: str) -> TracebackType | None:
    """The traceback of `err` from the script's first frame on (the runner's and runpy's
    frames are noise to the user); the whole one when the script's file is not in it."""
    tb = err.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return tb or err.__traceback__


def run_script(script: str, args: list[str]) -> tuple[int, str | None]:
    """Run the script as `python SCRIPT ARGS` would (module docstring); (exit status,
    failure message or None)."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status, message = exit_message(exit_.code)
        if status and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
        return status, message
    except BaseException as err:  # the user's script may raise anything; Ctrl-C included
        message = f"{type(err).__name__}: {err}"
        sys.stderr.write("".join(traceback.format_exception(type(err), err, script_traceback(err, script))))
        return (130 if isinstance(err, KeyboardInterrupt) else 1), message
    return 0, None


def _prefixed_run(rank: int, script: str, args: list[str]) -> tuple[int, str | None]:
    """run_script with this rank's stdout and stderr lines prefixed (RankPrefixed)."""
    sys.stdout, sys.stderr = RankPrefixed(sys.stdout, rank), RankPrefixed(sys.stderr, rank)
    try:
        return run_script(script, args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not os.path.isfile(argv[0]):
        print(f"{USAGE}\nerror: script {argv[0] if argv else None!r} is not a file", file=sys.stderr)
        return 2
    die_with_agent()
    rank = int(os.environ.get("RANK", "0"))
    configure_rank_logging(rank)  # before the streams are wrapped: its lines carry the rank already
    beat = Heartbeat(rank).start()
    try:
        join_device()
    except Exception as err:  # the emulated device could not be joined: this rank's failure, named
        status, message = 1, f"{type(err).__name__}: {err}"
    else:
        status, message = _prefixed_run(rank, os.path.abspath(argv[0]), argv[1:])
        leave_device()
    beat.finish("failed" if status else "done", message)
    if message:
        log.error("failed: %s", message)
    return status


if __name__ == "__main__":
    sys.exit(main())
