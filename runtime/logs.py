"""Logging on a rank: every record of the project's loggers printed with the rank in front,
`rank 1 failed: ValueError: ...`, `rank 0 step    3/20  loss ...`. Information goes to stdout,
warnings and errors to stderr (the launcher merges both into its own output). Only process
entry points call `configure_rank_logging` (runtime.rank.run_rank, which every torchrun worker
goes through); library code only logs."""

from __future__ import annotations

import logging
import sys

PROJECT_LOGGERS = ("hetsynth",)  # every module of the project logs below it (hetsynth.runtime.train ...)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def configure_rank_logging(rank: int, *, level: int = logging.INFO) -> None:
    """Print the project's log records of `level` and above on this rank, prefixed `rank N`."""
    fmt = logging.Formatter(f"rank {rank} %(message)s")
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(_Below(logging.WARNING))
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(fmt)
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [out, err]
        logger.setLevel(level)
        logger.propagate = False
