"""Which run records (runtime.runstate) the cleanup may act on: only names hetsynth itself makes.

A dead run's record is read by a later, unrelated command, so it is checked as input before
anything it lists is removed; one failing check sets the whole record aside untouched.

- `tempdir`: `<tmp>/hetsynth-<words>-<8 hex>` directly under this process's temporary root
  (tempfile.gettempdir()); when it exists, a real directory (not a link) of the effective user.
- `netns`: `hse<pid>[b-z](sw|n<i>)`, `veth`: `hse<pid>[b-z]a<i>`, `cgroup`:
  `<cgroup cpu root>/hse<pid>[b-z]` or a `r<i>` / `c<i>` child of it (runtime.emulation's
  names), where `<pid>` is the record's own pid: a record names only its own run's emulation.
- `session` (`<pgid>:<start ticks>`): whose leader, when alive with that start time, carries
  HETSYNTH_STATUS (runtime.heartbeat) inside one of the record's own temporary directories in
  its environment: the launcher gives it to every agent and worker it starts, and nothing else
  has it. A leader that is gone or started at another time is nothing to act on (kill_session
  then does nothing), not a fault of the record.
"""

from __future__ import annotations

import os
import re
import time
import stat
import tempfile
from pathlib import Path
from typing import Any

from hetsynth.runtime.names import CGROUP_CPU, PREFIX, STATUS_ENV, process_state, start_ticks

TEMPDIR_NAME = re.compile(r"hetsynth-[a-z]+(-[a-z]+)*-[0-9a-f]{8}")


def problem(data: Any) -> str | None:
    """Why the record `data` (a parsed state file) must not be acted on, or None."""
    shape = shape_problem(data)
    if shape:
        return shape
    tempdirs = [Path(name) for kind, name in data["created"] if kind == "tempdir"]
    for kind, name in data["created"]:
        why = CHECKS[kind](name, data["pid"], tempdirs)
        if why:
            return f"{kind} {name!r}: {why}"
    return None


def shape_problem(data: Any) -> str | None:
    """Why `data` is not a run record at all (pid, start, [kind, name] pairs of known kinds), or None."""
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int) or data["pid"] <= 0:
        return "not a run record (no positive integer 'pid')"
    if not (data.get("start") is None or isinstance(data["start"], int)):
        return f"'start' {data['start']!r} is not a number of clock ticks"
    created = data.get("created")
    if not isinstance(created, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in created):
        return "'created' is not a list of [kind, name] pairs"
    unknown = sorted({kind for kind, _ in created} - set(CHECKS))
    return f"unknown kind(s) {unknown} (known: {sorted(CHECKS)})" if unknown else None


def _tempdir(name: str, pid: int, tempdirs: list[Path]) -> str | None:
    path, root = Path(name), Path(tempfile.gettempdir())
    if path.parent != root or not TEMPDIR_NAME.fullmatch(path.name):
        return f"not a hetsynth temporary directory (hetsynth-<words>-<8 hex> directly in {root})"
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory (a link or a file is never removed)"
    return None if st.st_uid == os.geteuid() else f"owned by uid {st.st_uid}, not by uid {os.geteuid()}"


def _run_name(pid: int) -> str:
    return rf"{PREFIX}{pid}[b-z]?"


def _netns(name: str, pid: int, tempdirs: list[Path]) -> str | None:
    ok = re.fullmatch(rf"{_run_name(pid)}(sw|n\d+)", name)
    return None if ok else f"not a network namespace of this record's emulation ({_run_name(pid)}sw or ...n<i>)"


def _veth(name: str, pid: int, tempdirs: list[Path]) -> str | None:
    ok = re.fullmatch(rf"{_run_name(pid)}[ab]\d+", name)
    return None if ok else f"not a veth of this record's emulation ({_run_name(pid)}a<i>)"


def _cgroup(name: str, pid: int, tempdirs: list[Path]) -> str | None:
    if not re.fullmatch(rf"{re.escape(str(CGROUP_CPU))}/{_run_name(pid)}(/[rc]\d+)?", name):
        return f"not a cgroup of this record's emulation ({CGROUP_CPU}/{_run_name(pid)}[/r<i> or /c<i>])"
    return "a symbolic link" if Path(name).is_symlink() else None


def _session(name: str, pid: int, tempdirs: list[Path]) -> str | None:
    if not re.fullmatch(r"[1-9]\d*:\d+", name) or name.startswith("1:"):
        return "not <process group id>:<start ticks>"
    pgid, start = (int(x) for x in name.split(":"))
    if start_ticks(pgid) != start:
        return None
    status = _status_dir(pgid)
    if status is None and _exiting(pgid, start):
        return None  # the run's own process, dying with its launcher: nothing left to kill
    if status is None or not any(status.is_relative_to(d) for d in tempdirs):
        return (f"process {pgid} is not one this run started (its environment has no {STATUS_ENV} "
                f"inside the record's temporary directories)")
    return None



def _exiting(pid: int, start: int, wait_s: float = 2.0) -> bool:
    """Whether process `pid` (started at `start`) is gone, a zombie, or exiting within
    `wait_s`. A process that is exiting has released its memory, so its environment reads as
    empty; a command started right after a launcher was killed meets its ranks in that state
    (they die with it, by PR_SET_PDEATHSIG) and must not take them for someone else's."""
    deadline = time.monotonic() + wait_s
    while True:
        if process_state(pid, start) is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _status_dir(pid: int) -> Path | None:
    """HETSYNTH_STATUS in a process's environment (None: absent or unreadable)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{STATUS_ENV}=".encode()
    found = [e[len(prefix):] for e in environ if e.startswith(prefix)]
    return Path(os.path.normpath(found[0].decode(errors="replace"))) if found else None


CHECKS = {"session": _session, "tempdir": _tempdir, "netns": _netns, "veth": _veth, "cgroup": _cgroup}
