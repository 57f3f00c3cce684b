"""Outputs never destroy inputs or old files (issue 36): an output naming an input or another
output, however spelt (`a/../`, a symbolic link, a hard link), is `error: ...` before any work;
a write that fails (a full disk) leaves the old file intact and nothing behind; a reader never
sees a partial file; a damaged checkpoint is refused naming the tensor."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import threading
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

from hetsynth.cli import main
from hetsynth.instruction_set.files import WriteError, atomic_file, write_atomic
from hetsynth.instruction_set.plan import Plan, save_plan
from hetsynth.runtime.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from hetsynth.runtime.runstate import remove_dead_runs
from test_checkpoint import FIRST, REF, save_worker
from test_parity import make

ROOT = Path(__file__).resolve().parents[1]
EMULATED = ROOT / "configs" / "clusters" / "local-emulated.toml"
MODEL = "import torch\ndef factory(**kw):\n    return torch.nn.Linear(4, 1), (torch.zeros(2, 4),)\n"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make(REF, [0.7, 0.3])


@pytest.fixture(scope="module")
def checkpoint(pools, plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint `run --save` would write (two ranks, three steps)."""
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    pools.get(2).run(save_worker, plan, FIRST, str(path))
    return path


def _inputs(t: Path, plan: Plan) -> None:
    """A plan, a cluster spec, a model file, a checkpoint and a trace in `t`, and aliases of
    the plan: a symbolic link, a hard link, a dangling link to out.pt, and sub/ for sub/../."""
    save_plan(plan, t / "plan.json")
    shutil.copy(EMULATED, t / "spec.toml")
    (t / "m.py").write_text(MODEL)
    (t / "ck.pt").write_bytes(b"checkpoint bytes")
    (t / "m.json").write_text("{}")
    (t / "sub").mkdir()
    (t / "link.json").symlink_to(t / "plan.json")
    os.link(t / "plan.json", t / "hard.json")
    (t / "out-link.pt").symlink_to(t / "out.pt")


P = "{t}/plan.json"
RUN = ["run", P, "--steps", "2"]

# (id, argv with {t} for the directory of _inputs, text the error must contain)
ONTO_INPUTS: list[tuple[str, list[str], str]] = [
    ("trace -o PLAN", ["trace", P, "-o", P], "-o '{t}/plan.json' would overwrite the input PLAN"),
    ("trace -o sub/../PLAN", ["trace", P, "-o", "{t}/sub/../plan.json"], "would overwrite the input PLAN"),
    ("trace -o symlink", ["trace", P, "-o", "{t}/link.json"], "would overwrite the input PLAN"),
    ("trace -o hard link", ["trace", P, "-o", "{t}/hard.json"], "(hard links to one file)"),
    ("report -o symlink", ["report", P, "-o", "{t}/link.json"], "would overwrite the input PLAN"),
    ("report -o --measured", ["report", P, "--measured", "{t}/m.json", "-o", "{t}/sub/../m.json"],
     "would overwrite the input --measured '{t}/m.json'"),
    ("plan -o --cluster", ["plan", "--model", "gpt:tiny", "--cluster", "{t}/spec.toml", "-o", "{t}/spec.toml"],
     "would overwrite the input --cluster"),
    ("plan -o model file", ["plan", "--model", "{t}/m.py:factory", "--cluster", "{t}/spec.toml", "-o",
                            "{t}/sub/../m.py"], "would overwrite the input --model '{t}/m.py'"),
    ("run --save PLAN", RUN + ["--save", P], "--save '{t}/plan.json' would overwrite the input PLAN"),
    ("run --save hard link", RUN + ["--save", "{t}/hard.json"], "would overwrite the input PLAN"),
    ("run --save --resume", RUN + ["--resume", "{t}/ck.pt", "--save", "{t}/sub/../ck.pt"],
     "would overwrite the input --resume"),
    ("run --report symlink", RUN + ["--report", "{t}/link.json"], "--report '{t}/link.json' would overwrite"),
    ("run --trace PLAN", RUN + ["--trace", "{t}/sub/../plan.json"], "--trace '{t}/sub/../plan.json' would overwrite"),
    ("run --save = --report (..)", RUN + ["--save", "{t}/out.pt", "--report", "{t}/sub/../out.pt"],
     "name the same file"),
    ("run --save = --report (link)", RUN + ["--save", "{t}/out.pt", "--report", "{t}/out-link.pt"],
     "name the same file"),
    ("profile -o --cluster", ["profile", "--cluster", "{t}/spec.toml", "-o", "{t}/sub/../spec.toml"],
     "would overwrite the input --cluster"),
    ("profile --records --cluster", ["profile", "--cluster", "{t}/spec.toml", "--records", "{t}/spec.toml"],
     "--records '{t}/spec.toml' would overwrite the input --cluster"),
    ("demo --out onto --cluster", ["demo", "--cluster", P, "--out", "{t}"], "--out (plan)"),
]


def _snapshot(t: Path) -> dict[str, bytes | str]:
    return {str(p): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir")
            for p in sorted(t.rglob("*"))}


@pytest.mark.parametrize("argv, needle", [(c[1], c[2]) for c in ONTO_INPUTS], ids=[c[0] for c in ONTO_INPUTS])
def test_output_onto_an_input_is_refused(argv: list[str], needle: str, plan: Plan, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _inputs(tmp_path, plan)
    before = _snapshot(tmp_path)
    remove_dead_runs()  # a run an earlier test killed would otherwise put its clean-up note first
    assert main([a.replace("{t}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle.replace("{t}", str(tmp_path)) in err, err
    assert "Traceback" not in err
    assert _snapshot(tmp_path) == before  # every input intact, nothing written or left behind


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (only root may mount one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _fill(mnt: Path) -> None:
    """Write until the file system is full."""
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == 28, err  # ENOSPC


def _only(mnt: Path, *names: str) -> None:
    assert sorted(p.name for p in mnt.iterdir()) == sorted(names + ("filler",))  # no temporary file left


def test_full_disk_keeps_the_old_checkpoint(small_fs: Path) -> None:
    path = small_fs / "ck.pt"
    small = {"w": torch.arange(6.0)}
    write_checkpoint(path, model_ref="m", step=1, model=small, optimizer={"kind": "sgd", "state": {}})
    before = path.read_bytes()
    _fill(small_fs)
    with pytest.raises(WriteError, match=f"cannot write '{path}': No space left on device"):
        write_checkpoint(path, model_ref="m", step=2, model={"w": torch.zeros(2**20)},
                         optimizer={"kind": "sgd", "state": {}})
    assert path.read_bytes() == before
    assert read_checkpoint(path)["step"] == 1
    _only(small_fs, "ck.pt")


@pytest.mark.slow
def test_full_disk_keeps_the_old_plan_and_trace(small_fs: Path, plan: Plan,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    save_plan(plan, small_fs / "plan.json")
    (small_fs / "trace.json").write_text('{"old": "trace"}')
    before = _snapshot(small_fs)
    _fill(small_fs)
    remove_dead_runs()
    assert main(["trace", str(small_fs / "plan.json"), "-o", str(small_fs / "trace.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write '{small_fs}/trace.json': No space left on device"), err
    assert main(["plan", "--model", "gpt:tiny", "--cluster", str(EMULATED), "--devices", "2", "--ratios", "0.5,0.5",
                 "-o", str(small_fs / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write '{small_fs}/plan.json': No space left on device (the previous file is unchanged)" in err
    assert "Traceback" not in err
    after = _snapshot(small_fs)
    del after[str(small_fs / "filler")]
    assert after == before
    _only(small_fs, "plan.json", "trace.json")


@pytest.mark.slow
def test_a_reader_never_sees_a_partial_plan(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    stop, bad, reads = threading.Event(), [], [0]

    def poll() -> None:
        while not stop.is_set():
            text = path.read_text()
            reads[0] += 1
            try:
                json.loads(text)["version"]
            except (ValueError, KeyError) as err:
                bad.append(f"{len(text)} bytes: {err}")

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for _ in range(100):
            save_plan(plan, path)
    finally:
        stop.set()
        reader.join()
    assert reads[0] > 10 and not bad, (reads, bad[:3])
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_failed_write_leaves_the_old_file_and_keeps_links(tmp_path: Path) -> None:
    target, link = tmp_path / "out.json", tmp_path / "link.json"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target)
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(link) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "out.json"]
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o640


def test_a_device_is_written_in_place_not_replaced() -> None:
    write_atomic("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # as root, a rename would make it a plain file


def _flip_tensor_byte(src: Path, dst: Path) -> None:
    """Copy `src` with one bit flipped in the middle of its largest tensor's bytes."""
    shutil.copy(src, dst)
    with zipfile.ZipFile(dst) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(dst, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _changed(a: Path, b: Path) -> list[str]:
    """The model tensors that differ between two checkpoints (read without checks)."""
    x, y = (torch.load(p, weights_only=True) for p in (a, b))
    return [k for k in x["model"] if not torch.equal(x["model"][k], y["model"][k])]


def test_a_flipped_checkpoint_byte_is_refused(checkpoint: Path, plan: Plan, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert read_checkpoint(checkpoint)["step"] == FIRST.steps  # the intact file is accepted
    bad = tmp_path / "flipped.pt"
    _flip_tensor_byte(checkpoint, bad)
    changed = _changed(checkpoint, bad)
    assert changed, "the flipped byte should land in a model tensor"
    with pytest.raises(CheckpointError, match="bytes differ") as err:
        read_checkpoint(bad)
    assert any(f"model/{name}" in str(err.value) for name in changed), (changed, err.value)
    save_plan(plan, tmp_path / "plan.json")
    remove_dead_runs()
    assert main(["run", str(tmp_path / "plan.json"), "--steps", "5", "--resume", str(bad)]) == 2
    out = capsys.readouterr().err
    assert out.startswith("error: --resume") and "do not match the checksums" in out, out


@pytest.mark.parametrize("step", [-1, "3", 2.5, True])
def test_a_bad_step_is_refused(step: object, checkpoint: Path, tmp_path: Path) -> None:
    ckpt = torch.load(checkpoint, weights_only=True)
    torch.save(ckpt | {"step": step}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=rf"step {step!r} is not a number of steps trained"):
        read_checkpoint(tmp_path / "bad.pt")


def test_format_1_is_still_read(checkpoint: Path, tmp_path: Path) -> None:
    ckpt = torch.load(checkpoint, weights_only=True)
    del ckpt["checksums"]
    torch.save(ckpt | {"format": 1}, tmp_path / "old.pt")
    assert read_checkpoint(tmp_path / "old.pt")["step"] == FIRST.steps

