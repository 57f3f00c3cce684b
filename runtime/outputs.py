"""Output paths, checked before any work starts: a bad `--save`, `--report` or `-o` must not
cost a finished synthesis, a profile or a training run.

`check_outputs({flag: path})` checks every given path (None: not asked for) and that no two
flags name the same file; `check_output_file(path, flag)` checks one:

- the path is not a directory, and its directory exists and is a directory;
- a file can be written there: an existing file is opened for appending (its contents are
  untouched); otherwise a temporary file is created in the directory and removed at once.
  Permission bits are not enough: root passes every `os.access` check, and /proc or a
  read-only file system still refuse the file.

Failures raise OutputPathError (a ValueError: the CLI prints `error: ...` and exits 2) naming
the flag, the path and what is wrong. Nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written."""


def check_output_file(path: str | Path, flag: str) -> Path:
    """The absolute path of a writable output file (see the module docstring)."""
    where = f"{flag} {str(path)!r}"
    if not str(path).strip():
        raise OutputPathError(f"{flag}: empty path; give a file name")
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise OutputPathError(f"{where}: is a directory; give a file name inside it")
    parent = target.parent
    if not parent.exists():
        raise OutputPathError(f"{where}: directory {str(parent)!r} does not exist (create it first)")
    if not parent.is_dir():
        raise OutputPathError(f"{where}: {str(parent)!r} is not a directory")
    try:
        _probe(target)
    except OSError as err:
        raise OutputPathError(f"{where}: cannot write there ({err.strerror or err})") from None
    return target


def _probe(target: Path) -> None:
    if target.exists():
        with open(target, "ab"):
            return
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".probe")
    os.close(fd)
    os.unlink(tmp)


def check_outputs(paths: dict[str, str | Path | None]) -> dict[str, Path]:
    """Check every given output path, and that no two flags name the same file."""
    checked = {flag: check_output_file(path, flag) for flag, path in paths.items() if path is not None}
    seen: dict[Path, str] = {}
    for flag, path in checked.items():
        if path in seen:
            raise OutputPathError(f"{seen[path]} and {flag} name the same file {str(path)!r}; give each its own")
        seen[path] = flag
    return checked
