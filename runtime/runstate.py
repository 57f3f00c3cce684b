"""What a run creates outside its own memory, written down first, so that what a dead run
left behind can be removed.

Every launch (runtime.launch) and every emulated cluster (runtime.emulation) records each
thing it creates, *before* creating it, in a state file `<tmp>/hetsynth-runs-<uid>/<pid>-<n>.json`:

    {"pid": owner pid, "start": the owner's start time (clock ticks after boot, against pid
     reuse), "created": [[kind, name], ...]}

Kinds (REMOVERS, each with its remover here): `session` (a process group: a torchrun agent,
or a worker, which torchrun starts in a session of its own), `netns` (its processes are
killed first), `veth`, `cgroup` (its processes killed first, its children removed first),
`tempdir`. A run that ends removes what it created, then its file. A run
that was killed (SIGKILL cannot be caught) leaves its file behind: `remove_dead_runs()`,
which every `hetsynth` command calls first (and `hetsynth cleanup`), removes what the files
of dead owners list (processes first, then the rest in reverse order of creation) and the
files. Only this user's files are read, and nothing unrecorded is touched: another user's
run, or a run of an older hetsynth, is never disturbed.

The directory is trusted only when it is this effective user's own, a real directory (not a
link) that no one else can write (`checked_state_dir`: StateDirError otherwise): a shared
/tmp lets anyone create `hetsynth-runs-<uid>` first. Files in it are written under new,
unpredictable names (O_EXCL|O_NOFOLLOW) and renamed into place, and read with O_NOFOLLOW. A
dead run's record is still checked before it is acted on (runtime.record_check: only names
hetsynth makes, processes only with their recorded start time); one that fails is set aside
(`<name>.rejected`) with a note, untouched, and one record that cannot be cleaned never stops
the others.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Callable

from hetsynth.runtime.names import start_ticks

_numbers = count()


def state_dir() -> Path:
    """Where this user's run records live (one directory per user: a shared /tmp must not let
    one user's directory stop another's runs)."""
    return Path(os.environ.get("HETSYNTH_STATE_DIR") or Path(tempfile.gettempdir()) / f"hetsynth-runs-{os.geteuid()}")


class StateDirError(ValueError, OSError):
    """The run state directory cannot be trusted. A ValueError (`error: ...`, exit 2) and an
    OSError: the cleanup before every command (hetsynth.cli) notes it and goes on."""


def checked_state_dir(*, create: bool) -> Path | None:
    """state_dir(), made (mode 0700) when missing and `create`; None when missing otherwise.
    Raises StateDirError when it is a link, not a directory, not the effective user's or
    writable by group or others."""
    directory = state_dir()
    if create:
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return None
    why = _untrusted(st)
    if why:
        raise StateDirError(
            f"run state directory {directory} {why} (owner uid {st.st_uid}{_user(st.st_uid)}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}); hetsynth keeps the records of what its runs create there and uses only "
            f"a directory of its own user (uid {os.geteuid()}{_user(os.geteuid())}) that no one else can write: "
            f"remove it if it is not yours, or set HETSYNTH_STATE_DIR to a directory of your own")
    return directory


def _untrusted(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return "belongs to another user"
    return "is writable by other users" if st.st_mode & 0o022 else None


def _user(uid: int) -> str:
    try:
        return f" {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return ""


def write_replacing(path: Path, text: str, mode: int = 0o600) -> None:
    """Write `path` whole (a reader never sees half a file) through a new file under an
    unpredictable name beside it (O_EXCL|O_NOFOLLOW: nothing planted there is followed),
    renamed over `path` (a link at `path` is replaced, not followed)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_own(path: Path) -> str:
    """The text of a regular file of the effective user, not through a link (OSError
    otherwise, ValueError when it is another user's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a regular file of uid {os.geteuid()}")
        return f.read()


@dataclass
class RunRecord:
    """This process's record of one run (see the module docstring)."""

    path: Path
    pid: int = field(default_factory=os.getpid)
    created: list[list[str]] = field(default_factory=list)

    @staticmethod
    def open() -> "RunRecord":
        directory = checked_state_dir(create=True)
        assert directory is not None
        record = RunRecord(directory / f"{os.getpid()}-{next(_numbers)}.json")
        record._write()
        return record

    def _write(self) -> None:
        data = {"pid": self.pid, "start": start_ticks(self.pid), "created": self.created}
        write_replacing(self.path, json.dumps(data))

    def add(self, kind: str, name: str) -> None:
        """Record `name` before creating it."""
        assert kind in REMOVERS, kind
        self.created.append([kind, name])
        self._write()

    def forget(self, kind: str, name: str) -> None:
        """`name` was removed by its owner."""
        if [kind, name] in self.created:
            self.created.remove([kind, name])
            self._write()

    def close(self) -> None:
        """Everything recorded was removed: drop the file."""
        self.path.unlink(missing_ok=True)


def tempdir(record: RunRecord, prefix: str) -> Path:
    """A new temporary directory (mode 0755: workers may run as another user), recorded in
    `record` before it is made."""
    for _ in range(100):
        path = Path(tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            record.add("tempdir", str(path))
            try:
                path.mkdir(mode=0o755)  # fails on anything planted meanwhile, a link included
                return path
            except FileExistsError:
                record.forget("tempdir", str(path))
    raise FileExistsError(f"no free temporary directory name {prefix}* in {tempfile.gettempdir()}")


def kill_session(name: str) -> None:
    """Kill process group `name` ("<pgid>:<leader start ticks>"): every process in it, while
    its leader is the process that started at those ticks (a leader that is gone or whose pid
    now names another process leaves the group alone: a record's start time is what ties it
    to the run)."""
    pgid, start = (int(x) for x in name.split(":"))
    if start_ticks(pgid) != start:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tempdir(name: str) -> None:
    shutil.rmtree(name, ignore_errors=True)


def _kill_members(group: Path) -> None:
    procs = group / "cgroup.procs"
    if not procs.exists():
        return
    for line in procs.read_text().split():
        try:
            os.kill(int(line), signal.SIGKILL)
        except ProcessLookupError:
            pass


RMDIR_WAIT_S = 15.0  # a killed rank of a loaded machine took over 2.5 s to leave its cgroup


def _rmdir(group: Path) -> None:
    """Remove an emptied cgroup: killed processes leave it asynchronously (a large one on a
    loaded machine takes seconds to exit), and a member forked after the kill is killed on the
    next try."""
    deadline = time.monotonic() + RMDIR_WAIT_S
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                break
            _kill_members(group)
            time.sleep(0.05)
    raise OSError(errno.EBUSY, f"cannot remove cgroup {group}: processes still in it after {RMDIR_WAIT_S:g} s")


def remove_cgroup(path: str) -> None:
    """Kill the processes in a cgroup and remove it (its children first)."""
    group = Path(path)
    children = [*group.glob("r[0-9]*"), *group.glob("c[0-9]*")] if group.is_dir() else []
    for child in sorted(children, reverse=True):
        remove_cgroup(str(child))
    _kill_members(group)
    _rmdir(group)


def remove_namespace(name: str) -> None:
    """Kill the processes in a network namespace (torchrun agents live there) and delete it."""
    for pid in _ip("netns", "pids", name).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name)


def remove_link(name: str) -> None:
    """Delete a veth still in this namespace (it is moved into a node's namespace right after
    it is made, and goes with that namespace)."""
    if _ip("link", "show", name).returncode == 0:
        _ip("link", "del", name)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


REMOVERS: dict[str, Callable[[str], None]] = {
    "session": kill_session, "tempdir": _remove_tempdir,
    "netns": remove_namespace, "veth": remove_link, "cgroup": remove_cgroup,
}


def remove(created: list[list[str]]) -> None:
    """Remove what a run created: its processes first, then the rest, newest first."""
    ordered = [c for c in created if c[0] == "session"] + [c for c in reversed(created) if c[0] != "session"]
    for kind, name in ordered:
        if kind not in REMOVERS:
            raise ValueError(f"run state: unknown kind {kind!r} (known: {sorted(REMOVERS)})")
        REMOVERS[kind](name)


def _dead(data: dict) -> bool:
    return start_ticks(data["pid"]) != data["start"]


def remove_dead_runs() -> list[str]:
    """Remove what runs whose process is gone left behind; one line per record acted on or
    set aside (see the module docstring)."""
    directory = checked_state_dir(create=False)
    if directory is None:
        return []
    lock = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return [line for path in sorted(directory.glob("*.json")) for line in _clean(path)]
    finally:
        os.close(lock)


def _clean(path: Path) -> list[str]:
    """Remove what the record at `path` lists if its run is dead and the record passes
    runtime.record_check; else set it aside or leave it. The lines to note."""
    from hetsynth.runtime.record_check import problem, shape_problem

    try:
        data = json.loads(read_own(path))
    except (OSError, ValueError) as err:
        return [_set_aside(path, f"unreadable: {err}")]
    if shape_problem(data) is None and not _dead(data):
        return []  # a live run's record: checked only once its run is gone
    why = problem(data)
    if why is not None:
        return [_set_aside(path, why)]
    try:
        remove(data["created"])
    except OSError as err:
        return [f"could not remove all that a dead run (pid {data['pid']}) left ({err}); its record {path} is kept "
                f"for the next try"]
    path.unlink(missing_ok=True)
    return [f"removed what a dead run (pid {data['pid']}) left: {_summary(data)}"]


SKIPPED = "skipped the run record"


def _set_aside(path: Path, why: str) -> str:
    aside = path.with_name(f"{path.stem}.rejected")
    try:
        os.replace(path, aside)
    except OSError as err:
        return f"{SKIPPED} {path} ({why}; could not move it aside: {err}): nothing it lists was touched"
    return f"{SKIPPED} {path} ({why}): nothing it lists was touched; it is now {aside}"


def _records() -> list[dict]:
    """This user's run records (live and dead), those that cannot be read left out."""
    directory = checked_state_dir(create=False)
    out = []
    for path in sorted(directory.glob("*.json")) if directory is not None else []:
        try:
            data = json.loads(read_own(path))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("created"), list):
            out.append(data)
    return out


def _summary(data: dict) -> str:
    """How many things of each kind a record lists."""
    kinds: dict[str, int] = {}
    for kind, _ in data["created"]:
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} {WORDS[k][n > 1]}" for k, n in kinds.items()) or "nothing"


WORDS = {"session": ("process group", "process groups"), "netns": ("network namespace", "network namespaces"),
         "veth": ("veth", "veths"), "cgroup": ("cgroup", "cgroups"),
         "tempdir": ("temporary directory", "temporary directories")}


def recorded() -> set[str]:
    """Every name this user's state files list (live and dead runs alike)."""
    return {c[1] for data in _records() for c in data["created"] if isinstance(c, list) and len(c) == 2}


def live_runs() -> list[str]:
    """One line per run of this user whose process is alive (left alone by the cleanup)."""
    from hetsynth.runtime.record_check import shape_problem

    return [f"left alone: the live run of pid {data['pid']}: {_summary(data)}"
            for data in _records() if shape_problem(data) is None and not _dead(data)]
