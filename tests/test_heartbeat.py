"""Which rank the launcher names (runtime.heartbeat.diagnose), from status files alone: a
stalled rank before the timeouts it caused, a signal death before its peers' broken
connections (but not the SIGTERM an agent sends after a failure), a rank that never started,
else the earliest error; and a rank's heartbeat file itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hetsynth.runtime.heartbeat import Heartbeat, RankStatus, diagnose, read_status
from hetsynth.runtime.runstate import start_ticks

ALIVE = os.getpid()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def status(rank: int, state: str, beat: float, pid: int = ALIVE, error: str | None = None) -> RankStatus:
    return RankStatus(rank, pid, start_ticks(pid) if pid == ALIVE else None, state, beat - 5, beat, error,
                      beat if state != "running" else None)


def test_stalled_rank_is_named_before_the_timeouts_it_caused() -> None:
    now = time.time()
    found = diagnose({0: status(0, "failed", now, error="RuntimeError: Timed out waiting 10000ms"),
                      1: status(1, "running", now - 10), 2: status(2, "running", now - 0.3)},
                     now, world_size=3, timeout_s=10)
    assert found.rank == 1 and "no heartbeat for 10.0 s" in found.why


def test_signal_death_before_peer_errors_but_not_sigterm() -> None:
    now, dead = time.time(), _dead_pid()
    statuses = {0: status(0, "failed", now - 0.5, error="RuntimeError: Connection reset by peer"),
                1: status(1, "running", now - 0.6, pid=dead)}
    assert diagnose(statuses, now, world_size=2, timeout_s=60, signals={1: "SIGKILL"}).why == "killed by SIGKILL"
    assert diagnose(statuses, now, world_size=2, timeout_s=60, signals={1: "SIGTERM"}).rank == 0


def test_never_started_and_earliest_error() -> None:
    now = time.time()
    found = diagnose({0: status(0, "failed", now, error="DistStoreError: timed out")}, now + 0.1, world_size=2,
                     timeout_s=10)
    assert (found.rank, found.kind) == (1, "stalled") and "never started" in found.why
    found = diagnose({0: status(0, "failed", now, error="B"), 1: status(1, "failed", now - 1, error="A: first")},
                     now, world_size=2, timeout_s=10)
    assert (found.rank, found.why) == (1, "A: first")


def test_heartbeat_file_beats_then_records_the_error(tmp_path: Path) -> None:
    beat = Heartbeat(3, str(tmp_path)).start()
    first = read_status(tmp_path)[3].beat
    time.sleep(0.7)
    assert read_status(tmp_path)[3].beat > first and read_status(tmp_path)[3].state == "running"
    beat.finish("failed", "ValueError: bad")
    got = read_status(tmp_path)[3]
    assert (got.state, got.error, got.pid) == ("failed", "ValueError: bad", os.getpid())


def test_a_gone_rank_waits_for_its_agents_record(tmp_path: Path) -> None:
    """The launcher keeps waiting (runtime.launch._unrecorded) while a rank's process went
    away while running and no agent's failure record names it: without the record it could
    not be named as killed, and a peer's closed connection would be named instead."""
    from hetsynth.runtime.launch import _unrecorded

    now = time.time()
    statuses = {0: status(0, "running", now, pid=_dead_pid()), 1: status(1, "failed", now, error="closed"),
                2: status(2, "running", now)}
    assert _unrecorded(statuses, tmp_path) == [0]
    (tmp_path / "failures0.json").write_text('{"0": {"exitcode": -9, "signal": "SIGKILL"}}')
    assert _unrecorded(statuses, tmp_path) == []
