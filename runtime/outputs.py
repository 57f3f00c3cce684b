"""Output paths, checked before any work starts: a bad `--save`, `--report` or `-o` must not
cost a finished synthesis, a profile or a training run, and must not destroy an input.

`check_outputs({flag: path}, inputs={flag: path})` checks every given output path (None: not
asked for), that no two outputs name the same file and that no output names one of the
command's inputs (the plan, a cluster spec, a model file, a checkpoint to resume from, a
trace to read); `check_output_file(path, flag)` checks one output:

- the path is not a directory, and its directory exists and is a directory;
- a file can be created in that directory (every file is written to a temporary file there
  and renamed into place: instruction_set.files): a temporary file is created and removed at
  once; a device, a pipe or a path under /dev or /proc (/dev/stdout), written in place, is
  opened for appending instead. Permission bits are not enough: root passes every `os.access` check, and /proc or a
  read-only file system still refuse the file.

"The same file" is decided on what the paths resolve to, not how they are spelt: `a/../x`,
a symbolic link and a hard link (same device and inode) to a file all name that file.

Failures raise OutputPathError (a ValueError: the CLI prints `error: ...` and exits 2) naming
the flags, the paths and what is wrong. Nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping

from hetsynth.instruction_set.files import is_special

Paths = Mapping[str, "str | Path | None"]


class OutputPathError(ValueError):
    """An output path that cannot be written, or that names an input or another output."""


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
    """Create and remove a temporary file where the atomic write will create its own."""
    if is_special(target):
        with open(target, "ab"):
            return
    fd, tmp = tempfile.mkstemp(dir=Path(os.path.realpath(target)).parent, prefix=f".{target.name}.",
                               suffix=".probe")
    os.close(fd)
    os.unlink(tmp)


def check_outputs(outputs: Paths, inputs: Paths | None = None) -> dict[str, Path]:
    """Check every given output path, that no two outputs name the same file and that no
    output names an input; {flag: absolute path} of the outputs given."""
    checked = {flag: check_output_file(path, flag) for flag, path in outputs.items() if path is not None}
    given = {flag: Path(path).expanduser() for flag, path in (inputs or {}).items() if path is not None}
    seen: list[tuple[str, Path]] = []
    for flag, path in checked.items():
        for other, known in seen:
            if same_file(path, known):
                raise OutputPathError(f"{other} {str(known)!r} and {flag} {str(path)!r} name the same file"
                                      f"{_how(path, known)}; give each its own")
        for other, known in given.items():
            if same_file(path, known):
                raise OutputPathError(f"{flag} {str(path)!r} would overwrite the input {other} {str(known)!r}"
                                      f"{_how(path, known)}; write the output to another file")
        seen.append((flag, path))
    return checked


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: the same path once `..` and symbolic links are
    resolved, or the same device and inode (hard links)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): only its path can tell
        return False


def _how(path: Path, other: Path) -> str:
    """How two spellings name one file, when they differ."""
    real = os.path.realpath(path)
    if real != os.path.realpath(other):
        return " (hard links to one file)"
    return f" ({real!r})" if real != str(path) or real != str(other) else ""


def model_file(ref: str | None) -> str | None:
    """The Python file a model reference `path/file.py:factory[,k=v...]` imports, or None
    (a zoo or hf reference); the grammar is instruction_set.models.parse_model_ref's."""
    if ref is None:
        return None
    head = ref.partition(",")[0]
    name, sep, _ = head.rpartition(":")
    name = name if sep else head
    return name if name.endswith(".py") else None
