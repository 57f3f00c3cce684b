"""The names hetsynth gives what it creates outside its own memory, in one place below every
module that creates, records or removes them (runtime.emulation, runtime.heartbeat,
runtime.runstate, runtime.record_check), so that the check of a record (which names a run may
have made) and the code that makes them cannot drift apart, and no import runs in a circle.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PREFIX = "hse"  # network namespaces, veths and cgroups of an emulated cluster: hse<pid>...
STATUS_ENV = "HETSYNTH_STATUS"  # a launched process's heartbeat file (runtime.heartbeat)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the state on (field 3 of proc(5) is [0], the start
    time, field 22, is [19]); None when the process is gone. The command name before them may
    hold spaces and parentheses, so the split starts after its last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """When a process started (field 22 of /proc/<pid>/stat); None when it is gone. With the
    pid it identifies a process across pid reuse."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def process_state(pid: int, start: int | None = None) -> str | None:
    """The kernel's state letter of a process (R, S, D, T stopped, ...); None when it is gone
    (a zombie: exited, not yet reaped; or its pid now names a process started at another
    time than `start`)."""
    fields = stat_fields(pid)
    if fields is None or (start is not None and int(fields[19]) != start):
        return None
    return None if fields[0] in "ZX" else fields[0]
