"""Emulated device memory (runtime.emulation, `emulation.memory_scale`): a rank that allocates
past its limit is killed by the kernel and named by the launcher as out of memory with its rank
and limit (not as a hang, not as the peers' closed connections), the measured peak of every rank
is read back from its memory group, and no memory group survives the run. Skipped where this
machine cannot emulate (not root, no cgroup v1 memory controller)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetsynth.instruction_set.cluster import cluster_from_dict, load_cluster
from hetsynth.runtime.emulation import CGROUP_MEMORY, Emulation, leftovers, unavailable
from hetsynth.runtime.launch import MEMORY_FILE, launch_in, recorded_run

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 128
# timings and "nothing left anywhere" checks: these need the machine to themselves
pytestmark = pytest.mark.serial
needs_memory = pytest.mark.skipif(unavailable() is not None or not (CGROUP_MEMORY / "memory.limit_in_bytes").exists(),
                                  reason=f"cannot emulate device memory: {unavailable() or 'no cgroup v1 memory'}")

ALLOCATE = """
import sys, time, torch
from hetsynth.runtime.rank import run_rank

def body(rank, device):
    mib = int(sys.argv[1 + rank])
    block = torch.ones(mib * 2**20 // 4)  # touched: charged to the rank's memory group
    time.sleep(0.5)

sys.exit(run_rank(body, timeout_s=30, device=torch.device("cpu")))
"""

HOST_BUILD = """
import sys, torch
from hetsynth.runtime.emulation import host_memory
from hetsynth.runtime.rank import run_rank

def body(rank, device):
    with host_memory():  # the whole model, built on the host
        whole = torch.ones(int(sys.argv[1]) * 2**20 // 4)
    part = whole[: int(sys.argv[2]) * 2**20 // 4].clone()  # the rank's part, placed on its device
    del whole
    assert float(part.sum()) == part.numel()

sys.exit(run_rank(body, timeout_s=30, device=torch.device("cpu")))
"""


def small_cluster():
    """Two devices on one emulated node, LIMIT_MIB each (memory_gib 1 scaled by LIMIT_MIB / 1024)."""
    raw = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml").first(2).model_dump(mode="json")
    raw["emulation"]["memory_scale"] = LIMIT_MIB / 1024
    for kind in raw["device_kinds"].values():
        kind["memory_gib"] = 1
    return cluster_from_dict(raw)


def run_allocating(tmp_path: Path, mib: tuple[int, int], source: str = ALLOCATE) -> tuple[int, object, dict]:
    script = tmp_path / "allocate.py"
    script.write_text(source)
    before = leftovers()
    with recorded_run() as (record, workdir):
        rc, failure = launch_in(record, workdir, small_cluster(), [str(script), *map(str, mib)], timeout_s=30,
                                env={"PYTHONPATH": str(ROOT)})
        usage = json.loads((workdir / MEMORY_FILE).read_text())
    assert leftovers() == before
    return rc, failure, {int(r): u for r, u in usage.items()}


@needs_memory
def test_limit_is_the_scaled_memory() -> None:
    before = leftovers()  # other engineers' runs may be up on this machine
    with Emulation(small_cluster()) as emu:
        assert emu.memory_limits() == [LIMIT_MIB * 2**20] * 2
        assert int((emu.memory_cgroup(1) / "memory.limit_in_bytes").read_text()) == LIMIT_MIB * 2**20
    assert leftovers() == before


@needs_memory
@pytest.mark.slow
def test_rank_over_its_limit_is_out_of_memory(tmp_path: Path) -> None:
    rc, failure, usage = run_allocating(tmp_path, (16, 3 * LIMIT_MIB))
    assert rc != 0
    assert failure.rank == 1, failure
    assert "out of memory" in failure.why and f"{LIMIT_MIB} MiB" in failure.why, failure
    assert usage[1]["oom_kills"] >= 1 and usage[0]["oom_kills"] == 0


@needs_memory
@pytest.mark.slow
def test_measured_peak_is_read_back(tmp_path: Path) -> None:
    rc, failure, usage = run_allocating(tmp_path, (16, 64))
    assert rc == 0, failure
    assert 64 * 2**20 <= usage[1]["peak_bytes"] <= LIMIT_MIB * 2**20
    assert 16 * 2**20 <= usage[0]["peak_bytes"] < usage[1]["peak_bytes"]
    assert all(u["limit_bytes"] == LIMIT_MIB * 2**20 and u["oom_kills"] == 0 for u in usage.values())


@needs_memory
@pytest.mark.slow
def test_what_is_built_on_the_host_is_not_the_devices(tmp_path: Path) -> None:
    """A model built whole past the device's limit under host_memory, then its part placed:
    no rank is killed, and each device's peak is its part, not the whole."""
    rc, failure, usage = run_allocating(tmp_path, (3 * LIMIT_MIB, 16), HOST_BUILD)
    assert rc == 0, failure
    for u in usage.values():
        assert 16 * 2**20 <= u["peak_bytes"] < 48 * 2**20, u
        assert u["oom_kills"] == 0
