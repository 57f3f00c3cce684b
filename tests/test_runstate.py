"""Run records (runtime.runstate): what a dead owner's record lists is removed (its processes
killed, its directories deleted) and the record with it; a live owner's record is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetsynth.runtime import runstate


def test_dead_runs_are_removed_live_ones_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETSYNTH_STATE_DIR", str(tmp_path / "state"))
    live = runstate.RunRecord.open()
    kept = runstate.tempdir(live, "hetsynth-test-live-")
    dead = runstate.RunRecord.open()
    gone = runstate.tempdir(dead, "hetsynth-test-dead-")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                               env=os.environ | {"HETSYNTH_STATUS": str(gone / "status")})  # as the launcher's
    dead.add("session", f"{sleeper.pid}:{runstate.start_ticks(sleeper.pid)}")
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    owner.wait()
    data = json.loads(dead.path.read_text()) | {"pid": owner.pid}  # as if a process now gone had written it
    dead.path.write_text(json.dumps(data))
    try:
        removed = runstate.remove_dead_runs()
        assert removed == [f"removed what a dead run (pid {owner.pid}) left: 1 temporary directory, 1 process group"]
        assert sleeper.wait(timeout=10) != 0 and not gone.exists() and not dead.path.exists()
        assert kept.exists() and live.path.exists()
        assert runstate.live_runs() == [f"left alone: the live run of pid {live.pid}: 1 temporary directory"]
    finally:
        sleeper.kill()
        runstate.remove(live.created)
        live.close()
    assert not kept.exists() and runstate.remove_dead_runs() == []


def test_unknown_kind_fails_loudly() -> None:
    with pytest.raises(ValueError, match="unknown kind 'disk'"):
        runstate.remove([["disk", "/dev/sda"]])


def test_a_record_that_cannot_be_cleaned_blocks_no_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first dead record's removal fails (a busy cgroup, say): it is kept for the next
    try with a line saying why, and the record after it is still cleaned."""
    monkeypatch.setenv("HETSYNTH_STATE_DIR", str(tmp_path / "state"))
    records = [runstate.RunRecord.open() for _ in range(2)]
    dirs = [runstate.tempdir(r, "hetsynth-test-dead-") for r in records]
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    owner.wait()
    for r in records:
        r.path.write_text(json.dumps(json.loads(r.path.read_text()) | {"pid": owner.pid}))
    real = runstate.REMOVERS["tempdir"]

    def busy_first(name: str) -> None:
        if name == str(dirs[0]):
            raise OSError(16, f"cannot remove {name}: still busy")
        real(name)

    monkeypatch.setitem(runstate.REMOVERS, "tempdir", busy_first)
    lines = runstate.remove_dead_runs()
    failed = [line for line in lines if line.startswith(f"could not remove all that a dead run (pid {owner.pid}) left")]
    assert len(failed) == 1 and "busy" in failed[0] and str(records[0].path) in failed[0], lines
    assert [line for line in lines if line not in failed] == [
        f"removed what a dead run (pid {owner.pid}) left: 1 temporary directory"]
    assert records[0].path.exists() and dirs[0].exists() and not records[1].path.exists() and not dirs[1].exists()
    monkeypatch.setitem(runstate.REMOVERS, "tempdir", real)
    assert runstate.remove_dead_runs() == [f"removed what a dead run (pid {owner.pid}) left: 1 temporary directory"]
    assert not dirs[0].exists()


def test_a_dying_process_of_the_run_is_not_taken_for_another() -> None:
    """A rank killed with its launcher is a zombie (or exiting, its environment unreadable)
    when the next command cleans up: record_check takes it as gone, not as a process this
    run did not start; a live process is not."""
    from hetsynth.runtime.names import start_ticks
    from hetsynth.runtime.record_check import _exiting

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = start_ticks(child.pid)
        assert start is not None and not _exiting(child.pid, start, wait_s=0.2)
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)  # not reaped yet: a zombie
        assert _exiting(child.pid, start, wait_s=0.2)
    finally:
        child.kill()
        child.wait()
    assert _exiting(child.pid, start, wait_s=0.2)  # reaped: gone
