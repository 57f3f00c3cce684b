"""The run state directory and records (runtime.runstate, runtime.record_check) as untrusted
input: a directory someone else owns or can write is refused, nothing planted at a
predictable name is followed, and a crafted record neither deletes nor kills while the good
records after it are still cleaned. Also the plan hand-off (runtime.plan_handoff)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

import hetsynth
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.runtime import heartbeat, names, runstate
from hetsynth.runtime.emulation import CGROUP_CPU
from hetsynth.runtime.plan_handoff import PLAN_ENV, PlanChanged, load_rank_plan, plan_digest, validated_digest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HETSYNTH_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetsynth", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | (env or {}), timeout=120)


def test_new_state_dir_is_private(state: Path) -> None:
    record = runstate.RunRecord.open()
    record.close()
    assert state.stat().st_mode & 0o777 == 0o700


@pytest.mark.slow
def test_world_writable_state_dir_is_refused(state: Path) -> None:
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(runstate.StateDirError, match=f"{state} is writable by other users .*mode 0777"):
        runstate.RunRecord.open()
    out = cli("cleanup", env={"HETSYNTH_STATE_DIR": str(state)})
    assert out.returncode == 2 and out.stderr.startswith(f"error: run state directory {state}"), out.stderr
    assert "HETSYNTH_STATE_DIR" in out.stderr and list(state.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_foreign_owned_state_dir_is_refused(state: Path) -> None:
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    with pytest.raises(runstate.StateDirError, match=f"{state} belongs to another user .owner uid 65534"):
        runstate.RunRecord.open()
    with pytest.raises(runstate.StateDirError):
        runstate.remove_dead_runs()
    assert list(state.iterdir()) == []


def test_linked_state_dir_is_refused(state: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    state.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(runstate.StateDirError, match="is a symbolic link"):
        runstate.RunRecord.open()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_links_at_predictable_names_are_not_followed(state: Path, tmp_path: Path) -> None:
    """Links planted at the next record names, at their old temporary names, at the lock and at
    a heartbeat's status file names: the victim file is never written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    state.mkdir(mode=0o700)
    first = runstate.RunRecord.open()
    number = int(first.path.stem.split("-")[1])
    for n in range(number + 1, number + 4):
        for suffix in (".json", ".tmp"):
            (state / f"{os.getpid()}-{n}{suffix}").symlink_to(victim)
    record = runstate.RunRecord.open()
    record.add("tempdir", "/nonexistent")
    assert not record.path.is_symlink()
    assert json.loads(record.path.read_text())["created"] == [["tempdir", "/nonexistent"]]
    (state / ".lock").symlink_to(victim)
    with pytest.raises(OSError):
        runstate.remove_dead_runs()
    status = tmp_path / "status"
    status.mkdir()
    for name in ("rank0.tmp", "rank0.json"):
        (status / name).symlink_to(victim)
    beat = heartbeat.Heartbeat(0, str(status)).start()
    beat.finish("done")
    assert victim.read_text() == "precious" and json.loads((status / "rank0.json").read_text())["state"] == "done"
    for r in (first, record):
        r.close()


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _sleeper(env: dict | None = None, cgroup: Path | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                            env=os.environ | (env or {}))
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
    return proc


def _session(proc: subprocess.Popen, shift: int = 0) -> str:
    return f"{proc.pid}:{runstate.start_ticks(proc.pid) + shift}"


@pytest.fixture
def victim_cgroups() -> Iterator[list[Path]]:
    """Two cgroups hetsynth did not make for this record: one of another name, one named
    like another run's emulation (empty without root or a cgroup v1 cpu controller)."""
    if os.geteuid() != 0 or not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        yield []
        return
    groups = [CGROUP_CPU / f"hetsynth-test-victim-{secrets.token_hex(4)}", CGROUP_CPU / f"hse{os.getpid()}"]
    for g in groups:
        g.mkdir()
    yield groups
    for g in groups:
        runstate.remove_cgroup(str(g))


def test_crafted_records_neither_delete_nor_kill(state: Path, tmp_path: Path, victim_cgroups: list[Path]) -> None:
    """Records of a dead owner listing a directory outside hetsynth's temporary root, a link
    with a hetsynth name, cgroups hetsynth did not make for that run, a process whose start
    time differs, and one that hetsynth did not start: each is set aside with a note, nothing
    is deleted or killed; an unreadable record too; the good record after them is cleaned."""
    state.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = Path(tempfile.gettempdir()) / f"hetsynth-run-{secrets.token_hex(4)}"
    linked.symlink_to(outside)
    (outside / "keep").write_text("x")
    dead, procs = _dead_pid(), []
    try:
        good = runstate.RunRecord.open()  # the last by name: "<pid>-<n>" sorts after the "0-..." below
        good_dir = runstate.tempdir(good, "hetsynth-test-good-")
        procs.append(_sleeper({heartbeat.ENV: str(good_dir / "status")}))
        good.add("session", _session(procs[-1]))
        good.path.write_text(json.dumps(json.loads(good.path.read_text()) | {"pid": dead}))
        other_dir, start_dir = (Path(tempfile.gettempdir()) / f"hetsynth-run-{secrets.token_hex(4)}" for _ in "ab")
        procs.append(_sleeper({heartbeat.ENV: str(other_dir / "status")}))  # another run's process
        procs.append(_sleeper({heartbeat.ENV: str(linked / "status")}, victim_cgroups[0] if victim_cgroups else None))
        procs.append(_sleeper({heartbeat.ENV: str(start_dir / "status")}))
        crafted = {"outside": [["tempdir", str(outside)]], "linked": [["tempdir", str(linked)]],
                   "foreign": [["tempdir", str(start_dir)], ["session", _session(procs[1])]],
                   "unrelated": [["session", _session(procs[2])]],
                   **{f"cgroup{i}": [["cgroup", str(g)]] for i, g in enumerate(victim_cgroups)},
                   "cgroup-name": [["cgroup", f"{CGROUP_CPU}/hse{dead}/../victim"]]}
        for name, created in crafted.items():
            (state / f"0-{name}.json").write_text(json.dumps({"pid": dead, "start": 1, "created": created}))
        (state / "0-garbage.json").write_text("{not json")
        (state / "0-start.json").write_text(json.dumps({"pid": dead, "start": 1, "created": [
            ["tempdir", str(start_dir)], ["session", _session(procs[3], 1)]]}))  # a valid record, pid reused
        lines = runstate.remove_dead_runs()
        skipped = [line for line in lines if line.startswith("skipped the run record")]
        assert len(skipped) == len(crafted) + 1, lines
        removed = [line for line in lines if not line.startswith("skipped the run record")]
        assert removed == [f"removed what a dead run (pid {dead}) left: 1 temporary directory, 1 process group"] * 2
        assert procs[0].wait(timeout=10) == -signal.SIGKILL and not good_dir.exists()
        assert all(p.poll() is None for p in procs[1:]), "a crafted record killed a process"
        assert (outside / "keep").exists() and linked.is_symlink()
        assert all(g.is_dir() for g in victim_cgroups) and not list(state.glob("0-*.json"))
        assert len(list(state.glob("0-*.rejected"))) == len(crafted) + 1
    finally:
        for p in procs:
            p.kill()
        linked.unlink()


@pytest.mark.slow
def test_rank_refuses_a_changed_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    plan = hetsynth.plan("gpt:tiny", cluster=str(ROOT / "configs" / "clusters" / "local-emulated.toml"),
                         ratios=[0.5, 0.5], num_devices=2)
    hetsynth.save_plan(plan, path)
    digest = validated_digest(plan, str(path))
    monkeypatch.setenv(PLAN_ENV, json.dumps({str(path): digest}))
    assert load_rank_plan(str(path)) == plan
    path.write_text(path.read_text() + "\n")  # the same plan, other bytes
    changed = plan_digest(path.read_bytes())
    with pytest.raises(PlanChanged, match=f"sha256 {changed} now, {digest} validated"):
        load_rank_plan(str(path))
    hetsynth.save_plan(hetsynth.plan("gpt:tiny", cluster=str(ROOT / "configs" / "clusters" / "local-emulated.toml"),
                                     ratios=[0.7, 0.3], num_devices=2), path)
    with pytest.raises(PlanChanged, match="changed after it was validated"):
        validated_digest(plan, str(path))


LOCAL = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml").first(2).model_copy(
    update={"emulation": None})


@pytest.fixture(scope="module")
def local_plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GPT tiny on two plain local processes (no emulation section: not emulated as root)."""
    path = tmp_path_factory.mktemp("local") / "plan.json"
    hetsynth.save_plan(hetsynth.plan("gpt:tiny", cluster=LOCAL), path)
    return str(path)


def _run_processes(tmp_root: Path) -> dict[int, dict[str, str]]:
    """pid -> environment of the agents and ranks of the runs whose work directory is in `tmp_root`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        except (OSError, UnicodeDecodeError):
            continue
        if env.get(heartbeat.ENV, "").startswith(f"{tmp_root}/"):
            out[int(pid)] = env
    return out


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the TCP sockets `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return [fields[1] for table in ("/proc/net/tcp", "/proc/net/tcp6")
            for fields in (line.split() for line in Path(table).read_text().splitlines()[1:])
            if fields[3] == "0A" and fields[9] in inodes]


def _loopback(address: str) -> bool:
    host = address.split(":")[0]
    return host.endswith("7F") and (len(host) == 8 or host.startswith("0000000000000000FFFF0000")) \
        or host == "00000000000000000000000001000000"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_local_run_listens_on_loopback_and_dies_with_its_launcher(local_plan: str, tmp_path: Path) -> None:
    """While a 2-rank run trains, every socket its agent and ranks listen on is on loopback and
    torchrun logs under the work directory; SIGKILL the launcher with rank 1 stopped: agent
    and ranks are gone within seconds (not torchrun's 30 s), and the next command leaves no
    work directory and no torchelastic_* directory in the temporary root."""
    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    env = {"TMPDIR": str(tmp_root), "HETSYNTH_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([sys.executable, "-m", "hetsynth", "run", local_plan, "--steps", "100000",
                             "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=os.environ | env)
    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if "step    2/" in line:
                break
        assert "step    2/" in seen, seen
        processes = _run_processes(tmp_root)
        assert len(processes) == 3, processes.keys()  # the agent and two ranks
        addresses = [a for pid in processes for a in _listening(pid)]
        assert addresses and all(_loopback(a) for a in addresses), addresses
        assert list(tmp_root.glob("hetsynth-run-*/plan/torchelastic0/*")) and not list(tmp_root.glob("torchelastic_*"))
        ranks = heartbeat.read_status(next(iter(processes.values()))[heartbeat.ENV])
        os.kill(ranks[1].pid, signal.SIGSTOP)
        proc.kill()
        killed = time.monotonic()
        while any(names.process_state(pid) is not None for pid in processes) and time.monotonic() - killed < 20:
            time.sleep(0.1)
        assert time.monotonic() - killed < 5, [names.process_state(pid) for pid in processes]
    finally:
        proc.kill()
        proc.wait()
    out = cli("cleanup", env=env)
    assert out.returncode == 0 and "removed what a dead run" in out.stdout, out.stdout + out.stderr
    assert not [p.name for p in tmp_root.iterdir() if p.name.startswith(("hetsynth-run-", "torchelastic_"))]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_ranks_refuse_a_plan_changed_after_launch(local_plan: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher hands the ranks the digest it validated; a file whose bytes differ (here:
    another digest handed over) is refused by the ranks, naming both digests; the run ends
    leaving no work directory and no torchelastic_* directory."""
    from hetsynth.runtime.config import TrainConfig
    from hetsynth.runtime.launch import RunOptions, launch, worker_args

    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_root))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_root))
    monkeypatch.setenv("HETSYNTH_STATE_DIR", str(tmp_path / "state"))
    validated = "0" * 64
    rc, failure = launch(LOCAL, worker_args(local_plan, RunOptions(train=TrainConfig(steps=1)), "/dev/null", None),
                         timeout_s=30, plans={local_plan: validated})
    now = plan_digest(Path(local_plan).read_bytes())
    assert rc != 0 and failure is not None, failure
    assert f"changed after the launcher validated it: sha256 {now} now, {validated} validated" in failure.why, failure
    assert not [p.name for p in tmp_root.iterdir() if p.name.startswith(("hetsynth-run-", "torchelastic_"))]
