"""The emulated cluster is real: shaped links deliver the spec's bandwidth (within 15%), CPU
quotas give the spec's compute ratio (within 20%), and nothing is left behind. Skipped with
the reason where this machine cannot emulate (not root, no cgroup v1 cpu controller)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.cluster import cluster_from_dict, load_cluster
from runtime.emulation import Emulation, assign_cpus, leftovers, unavailable

ROOT = Path(__file__).resolve().parents[1]
SPEC = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")
needs_root = pytest.mark.skipif(unavailable() is not None, reason=f"cannot emulate: {unavailable()}")

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 29611)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); total = 0; start = None
while True:
    data = c.recv(1 << 20)
    if not data: break
    if start is None: start = time.perf_counter()
    total += len(data)
print(total * 8 / (time.perf_counter() - start) / 1e6)
"""

CLIENT = """
import socket, time, sys
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], 29611)); break
    except OSError: time.sleep(0.1)
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])): c.sendall(block)
c.close()
"""

BURN = """
import os, json, time, torch
from runtime.emulation import join_device
join_device(); torch.set_num_threads(1)
a = torch.randn(256, 256); n = 0; start = time.perf_counter()
while time.perf_counter() - start < 3.0:
    a @ a; n += 1
print(n / (time.perf_counter() - start))
"""


def test_cpu_assignment_balances_quotas() -> None:
    assert assign_cpus([0.5, 0.5, 0.25, 0.25], 2) == [0, 1, 0, 1]


@needs_root
def test_shaped_bandwidth_matches_spec() -> None:
    mbit = SPEC.links.inter_node_bandwidth_gbps * 1000
    megabytes = max(4, int(mbit / 8 * 3))  # about 3 seconds of traffic
    with Emulation(SPEC) as emu:
        server = subprocess.Popen(emu.in_node(1, [sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        subprocess.run(emu.in_node(0, [sys.executable, "-c", CLIENT, emu.address(1), str(megabytes)]),
                       check=True, timeout=120)
        measured = float(server.communicate(timeout=60)[0].strip())
    assert abs(measured / mbit - 1) < 0.15, f"{measured:.1f} Mbit/s measured, {mbit:.1f} specified"


@needs_root
def test_compute_ratio_matches_quotas() -> None:
    with Emulation(SPEC) as emu:
        env = {"HETSYNTH_EMULATION": emu.rank_env(), "PYTHONPATH": str(ROOT)}
        procs = {rank: subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True,
                                        env={**__import__("os").environ, **env, "RANK": str(rank)}, cwd=ROOT)
                 for rank in range(SPEC.num_devices)}
        rates = {rank: float(p.communicate(timeout=120)[0]) for rank, p in procs.items()}
    fast = (rates[0] + rates[1]) / 2
    slow = (rates[2] + rates[3]) / 2
    expected = SPEC.emulation.cpu_quota["cpu-fast"] / SPEC.emulation.cpu_quota["cpu-slow"]
    assert abs(fast / slow / expected - 1) < 0.2, (rates, fast / slow, expected)


@needs_root
def test_nothing_left_behind_even_on_errors() -> None:
    before = leftovers()
    with pytest.raises(RuntimeError):
        with Emulation(SPEC):
            raise RuntimeError("a worker failed")
    assert leftovers() == before


@needs_root
def test_missing_quota_is_an_error_and_cleans_up() -> None:
    raw = SPEC.model_dump(mode="json")
    raw["emulation"]["cpu_quota"] = {"cpu-fast": 0.5}
    with pytest.raises(Exception, match="cpu-slow"):
        Emulation(cluster_from_dict(raw)).start()
    assert leftovers() == {"namespaces": [], "cgroups": []}
