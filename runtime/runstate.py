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
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Callable

_numbers = count()


def state_dir() -> Path:
    """Where this user's run records live (one directory per user: a shared /tmp must not let
    one user's directory stop another's runs)."""
    return Path(os.environ.get("HETSYNTH_STATE_DIR") or Path(tempfile.gettempdir()) / f"hetsynth-runs-{os.geteuid()}")


def start_ticks(pid: int) -> int | None:
    """When a process started (field 22 of /proc/<pid>/stat); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[19])


@dataclass
class RunRecord:
    """This process's record of one run (see the module docstring)."""

    path: Path
    pid: int = field(default_factory=os.getpid)
    created: list[list[str]] = field(default_factory=list)

    @staticmethod
    def open() -> "RunRecord":
        directory = state_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = RunRecord(directory / f"{os.getpid()}-{next(_numbers)}.json")
        record._write()
        return record

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": self.pid, "start": start_ticks(self.pid), "created": self.created}))
        os.replace(tmp, self.path)

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
        if not path.exists():
            record.add("tempdir", str(path))
            path.mkdir(mode=0o755)
            return path
    raise FileExistsError(f"no free temporary directory name {prefix}* in {tempfile.gettempdir()}")


def kill_session(name: str) -> None:
    """Kill process group `name` ("<pgid>:<leader start ticks>"): every process still in it,
    unless the leader's pid now belongs to another process (a group id is not reused while
    any member lives, so members without a leader are the run's)."""
    pgid, start = (int(x) for x in name.split(":"))
    leader = start_ticks(pgid)
    if leader is not None and leader != start:
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


def _rmdir(group: Path) -> None:
    for _ in range(50):  # killed processes leave their cgroup asynchronously
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    raise OSError(errno.EBUSY, f"cannot remove cgroup {group}: still busy")


def remove_cgroup(path: str) -> None:
    """Kill the processes in a cgroup and remove it (its children first)."""
    group = Path(path)
    for child in sorted(group.glob("r*"), reverse=True) if group.is_dir() else []:
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
    """Remove what runs whose process is gone left behind; one line per run removed."""
    directory = state_dir()
    if not directory.is_dir():
        return []
    done = []
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in sorted(directory.glob("*.json")):
            if path.stat().st_uid != os.geteuid():
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if _dead(data):
                remove(data["created"])
                path.unlink(missing_ok=True)
                done.append(f"removed what a dead run (pid {data['pid']}) left: {_summary(data)}")
    return done


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
    out: set[str] = set()
    for path in state_dir().glob("*.json") if state_dir().is_dir() else []:
        try:
            out |= {name for _, name in json.loads(path.read_text())["created"]}
        except (OSError, ValueError, KeyError):
            continue
    return out


def live_runs() -> list[str]:
    """One line per run of this user whose process is alive (left alone by the cleanup)."""
    out = []
    for path in sorted(state_dir().glob("*.json")) if state_dir().is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _dead(data):
            out.append(f"left alone: the live run of pid {data['pid']}: {_summary(data)}")
    return out
