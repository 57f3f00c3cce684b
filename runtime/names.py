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


def start_ticks(pid: int) -> int | None:
    """When a process started (field 22 of /proc/<pid>/stat); None when it is gone. With the
    pid it identifies a process across pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[19])
