"""Files written whole or not at all: every file hetsynth writes (plans, checkpoints, traces,
reports, profiles) goes through `atomic_file` or `write_atomic`.

The bytes go to a new temporary file in the target's directory (created with O_EXCL under an
unpredictable name, so nothing else can be writing it), are flushed and fsynced, and the file
is renamed over the target with os.replace, which is atomic within one file system: a reader
sees the old file or the new one, never a partial or empty one, and a failed write (a full
disk, a quota, an interrupted run) removes the temporary file and leaves the old file as it
was. The directory is fsynced after the rename, so the new name survives a crash.

A target that is a symbolic link is written through (its destination is replaced; the link
stays). A target with other hard links gets a new inode: the other names keep the old bytes.
The new file takes the old file's permission bits, or 0o666 less the umask when there was none.
A target that exists and is not a regular file (/dev/null, a named pipe), or any path under
/dev or /proc (/dev/stdout resolves to whatever file the process's stdout is), is written in
place: renaming over it would replace the device, the pipe or another program's file.

An OSError while writing, anywhere in the exception chain (torch.save reports a failed write
as a RuntimeError whose context is the OSError), raises WriteError naming the path and the
operating system's reason.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, NoReturn


class WriteError(ValueError):
    """A file that could not be written; the previous file at that path, if any, is intact."""


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (str: UTF-8) to `path` whole or not at all (see the module docstring)."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file object whose bytes replace `path` when the block exits normally; on any
    exception the temporary file is removed and `path` is left as it was."""
    if is_special(path):
        with _in_place(path) as f:
            yield f
        return
    target = Path(os.path.realpath(os.fspath(path)))
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise _write_error(path, err) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException as err:
        _remove(tmp)
        _reraise(path, err)
    _fsync_dir(target.parent)


def is_special(path: str | Path) -> bool:
    """Whether `path` is written in place, not replaced (see the module docstring)."""
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return True
    target = Path(os.path.realpath(path))
    return target.exists() and not target.is_file()


@contextmanager
def _in_place(path: str | Path) -> Iterator[BinaryIO]:
    try:
        with open(path, "wb") as f:
            yield f
    except BaseException as err:
        _reraise(path, err)


def _reraise(path: str | Path, err: BaseException) -> NoReturn:
    """`err` as a WriteError when an OSError caused it, else `err` itself."""
    cause = _os_error(err)
    if cause is None:
        raise err
    raise _write_error(path, cause) from err


def _write_error(path: str | Path, err: OSError) -> WriteError:
    existed = os.path.exists(path)
    kept = "the previous file is unchanged" if existed else "nothing was written"
    return WriteError(f"cannot write {str(path)!r}: {err.strerror or err} ({kept})")


def _os_error(err: BaseException) -> OSError | None:
    """The OSError that caused `err` (itself, its cause or its context), if any."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return None


def _mode_for(target: Path) -> int:
    """The permission bits the new file takes: the old file's, or those open() would give."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where /proc tells it (other threads may
    be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass  # already gone: nothing left behind either way


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; some file systems cannot fsync a directory (nothing to do)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
