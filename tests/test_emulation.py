"""The emulated cluster is real: shaped links deliver the spec's bandwidth (within 15%), CPU
quotas give the spec's compute ratio (within 20%), and nothing is left behind. Skipped with
the reason where this machine cannot emulate (not root, no cgroup v1 cpu controller)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hetsynth.instruction_set.cluster import cluster_from_dict, load_cluster
from hetsynth.runtime.emulation import Emulation, assign_cpus, leftovers, shaper, unavailable

ROOT = Path(__file__).resolve().parents[1]
SPEC = load_cluster(ROOT / "configs" / "clusters" / "local-emulated.toml")
NOTHING = {"namespaces": [], "cgroups": [], "veths": []}
# timings and "nothing left anywhere" checks: these need the machine to themselves
pytestmark = pytest.mark.serial
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
from hetsynth.runtime.emulation import join_device
join_device(); torch.set_num_threads(1)
a = torch.randn(256, 256); n = 0; start = time.perf_counter()
while time.perf_counter() - start < 3.0:
    a @ a; n += 1
print(n / (time.perf_counter() - start))
"""


def test_cpu_assignment_balances_quotas() -> None:
    assert assign_cpus([0.5, 0.5, 0.25, 0.25], 2) == [0, 1, 0, 1]


def test_shaper_commands_follow_the_link_queue() -> None:
    """"priority": an htb tree at the rate and bucket whose u32 filter sends IP packets under
    128 bytes to the first class; "tbf": the single tbf of 20 ms."""
    emulation = SPEC.emulation
    prio = shaper(emulation, 50.0, "eth0")
    assert prio[0][:8] == ("qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb")
    rates = [c[c.index("rate") + 1] for c in prio if "rate" in c]
    assert rates == ["50.000mbit"] * 3 and all(c[c.index("burst") + 1] == f"{emulation.burst_kib}kb"
                                                for c in prio if "burst" in c)
    assert prio[-1][-7:] == ("u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10")
    tbf = shaper(emulation.model_copy(update={"link_queue": "tbf"}), 50.0, "eth0")
    assert tbf == [("qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50.000mbit", "burst",
                    f"{emulation.burst_kib}kb", "latency", "20ms")]


@needs_root
@pytest.mark.slow
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
@pytest.mark.parametrize("cluster", ["local-emulated", "slow-link-emulated"])
@pytest.mark.slow
def test_both_directions_at_once_each_get_the_link(cluster: str) -> None:
    """A full-duplex link: with link_queue = "priority" (the default), a stream each way at
    once each gets the spec's bandwidth (within 15%): a direction's acknowledgements do not
    queue behind the other direction's data, and nothing is dropped (with one 20 ms tbf FIFO a
    direction lost 12-23% of its rate on the 50 Mbit/s link and 14% of the packets were
    dropped at the sender)."""
    spec = load_cluster(ROOT / "configs" / "clusters" / f"{cluster}.toml")
    mbit = spec.links.inter_node_bandwidth_gbps * 1000
    megabytes = max(4, int(mbit / 8 * 3))
    with Emulation(spec) as emu:
        servers = [subprocess.Popen(emu.in_node(n, [sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True)
                   for n in (0, 1)]
        assert [s.stdout.readline().strip() for s in servers] == ["ready", "ready"]
        clients = [subprocess.Popen(emu.in_node(n, [sys.executable, "-c", CLIENT, emu.address(1 - n), str(megabytes)]))
                   for n in (0, 1)]
        assert [c.wait(timeout=120) for c in clients] == [0, 0]
        measured = [float(s.communicate(timeout=60)[0].strip()) for s in servers]
        stats = subprocess.run(["ip", "netns", "exec", emu.namespaces[0], "tc", "-s", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout
    assert all(abs(m / mbit - 1) < 0.15 for m in measured), f"{measured} Mbit/s measured at once, {mbit:.1f} specified"
    drops = [int(n) for n in re.findall(r"dropped (\d+)", stats)]
    assert drops and not any(drops), stats


@needs_root
@pytest.mark.slow
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


THREADS = """
import os, threading, time
from hetsynth.runtime.emulation import join_device, leave_device
engine = join_device()
stop = threading.Event()
worker = threading.Thread(target=stop.wait)   # a thread made after joining, as gloo's are
worker.start()
time.sleep(0.3)
def group(tid): return open(f"/proc/self/task/{tid}/cgroup").read()
print(repr(engine is not None), group(os.getpid()).count("/r0"), group(worker.native_id).count("/c0"),
      sorted(os.sched_getaffinity(worker.native_id)) == sorted(range(os.cpu_count())), len(os.sched_getaffinity(0)))
leave_device()
print(group(os.getpid()).count("/r0"), group(worker.native_id).count("/hse"), len(os.sched_getaffinity(0)) == os.cpu_count())
stop.set()
"""


@needs_root
@pytest.mark.parametrize("engine", ["separate", "shared"])
@pytest.mark.slow
def test_communication_threads_leave_the_device_quota(engine: str) -> None:
    """comm_engine = "separate": a thread the worker makes after joining its device (gloo's, in
    a run) moves to the rank's communication cgroup, on any CPU, while the main thread stays in
    the device's quota, on its one CPU; "shared": no communication group, nothing moves. After
    leave_device() (the work done) every thread is in the root group, on any CPU."""
    raw = SPEC.model_dump(mode="json")
    raw["emulation"]["comm_engine"] = engine
    with Emulation(cluster_from_dict(raw)) as emu:
        env = {**__import__("os").environ, "HETSYNTH_EMULATION": emu.rank_env(), "PYTHONPATH": str(ROOT),
               "RANK": "0"}
        out = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=60)
    assert out.returncode == 0, out.stderr
    separate = engine == "separate"
    assert out.stdout.split() == [str(separate), "1", "1" if separate else "0", str(separate), "1",
                                  "0", "0", "True"], out.stdout


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
    assert leftovers() == NOTHING


@needs_root
@pytest.mark.slow
def test_emulated_training_run_matches_and_leaves_nothing(tmp_path: Path) -> None:
    """hetsynth's plan, DP-EV, hetsynth's plan in a user's loop (hetsynth.parallelize's module)
    and torch DDP of GPT tiny train interleaved on the emulated cluster (runtime.compare, as
    `make demo` does); all match single-device losses and no namespace or cgroup survives
    the run."""

    from hetsynth import capture_model
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.instruction_set.plan import save_plan
    from hetsynth.planner import baselines
    from hetsynth.planner.planner import make_plan
    from hetsynth.runtime.launch import launch
    from hetsynth.runtime.config import TrainConfig
    from hetsynth.runtime.train import reference_training

    ref = "gpt:tiny,dtype=float64"
    graph = capture_model(ref)
    plans = {"het": make_plan(graph, SPEC, progress=False, with_baselines=False),
             "ev": make_plan(graph, SPEC, ratios=baselines.even(SPEC), restrictions=baselines.DP,
                             progress=False, with_baselines=False)}
    for name, plan in plans.items():
        save_plan(plan, tmp_path / f"{name}.json")
    report = tmp_path / "report.json"
    rc, failure = launch(SPEC, ["-m", "hetsynth.runtime.compare", "--plans", *(str(tmp_path / f"{n}.json") for n in plans),
                                "--names", *plans, "--ddp", f"ddp=weighted:{tmp_path / 'ev.json'}",
                                "--user", f"user={tmp_path / 'het.json'}",
                                "--warmup", "1", "--rounds", "1", "--steps", "2",
                                "--report", str(report)])
    assert rc == 0, failure
    assert leftovers() == NOTHING
    measured = json.loads(report.read_text())
    spec = parse_model_ref(ref)
    expected, _ = reference_training(spec, spec.batch_size, TrainConfig(steps=3))
    for name in (*plans, "user", "ddp"):
        assert len(measured[name]["losses"]) == 3
        for got, want in zip(measured[name]["losses"], expected):
            assert abs(got - want) <= 1e-9 * abs(want), (name, got, want)


CGROUP_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from hetsynth.runtime.emulation import join_device
join_device()
cpu = [f[2] for f in (line.strip().split(":", 2) for line in open("/proc/self/cgroup")) if "cpu" in f[1].split(",")][0]
with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"]), "w") as out:
    json.dump([cpu, sorted(os.sched_getaffinity(0))], out)
"""


@needs_root
@pytest.mark.slow
def test_a_one_node_emulated_cluster_is_emulated(tmp_path: Path) -> None:
    """A cluster of one node with an `emulation` section runs its workers in their devices'
    cgroups, each on one CPU (it ran them as plain processes at a whole CPU each before)."""
    from hetsynth.runtime.launch import launch

    raw = SPEC.model_dump(mode="json")
    raw["devices"] = [{"name": "n/0", "kind": "cpu-fast"}, {"name": "n/1", "kind": "cpu-fast"}]
    raw["nodes"] = [{"name": "n", "devices": ["n/0", "n/1"]}]
    script = tmp_path / "probe.py"
    script.write_text(CGROUP_PROBE)
    rc, failure = launch(cluster_from_dict(raw), [str(script), str(ROOT), str(tmp_path)], timeout_s=120)
    assert rc == 0, failure
    seen = [json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert [group.rsplit("/", 1)[-1] for group, _ in seen] == ["r0", "r1"], seen
    assert all(len(cpus) == 1 for _, cpus in seen), seen
    assert leftovers() == NOTHING


HOLD = """
import time
from hetsynth.instruction_set.cluster import load_cluster
from hetsynth.runtime.emulation import Emulation
with Emulation(load_cluster("configs/clusters/local-emulated.toml")):
    print("up", flush=True)
    time.sleep(60)
"""


@needs_root
def test_sigterm_removes_the_emulation() -> None:
    import signal

    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "up"
    assert leftovers()["namespaces"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert leftovers() == NOTHING


@needs_root
@pytest.mark.slow
def test_model_timed_on_the_emulated_devices() -> None:
    """hetsynth.profiling.model_timing: every device times its rows (throughput-proportional, adding up
    to the batch); per row the slow kind (a quarter CPU) takes at least about the quota ratio
    longer than the fast one (half a CPU); nothing is left behind."""
    from hetsynth.profiling.model_timing import time_on_cluster

    before = leftovers()
    records = time_on_cluster("gpt:tiny,batch_size=96", SPEC, seconds=0.2)
    assert [r["name"] for r in records] == [d.name for d in SPEC.devices]
    assert sum(r["rows"] for r in records) == 96 and all(r["seconds"] > 0 for r in records)
    per_row = {k: statistics.mean(r["seconds"] / r["rows"] for r in records if r["kind"] == k) for k in SPEC.device_kinds}
    expected = SPEC.emulation.cpu_quota["cpu-fast"] / SPEC.emulation.cpu_quota["cpu-slow"]
    assert 0.8 * expected < per_row["cpu-slow"] / per_row["cpu-fast"] < 2.5 * expected, records
    assert leftovers() == before


def test_name_of_a_leftover_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead run's namespace or veth with this process's name (pid reuse, older versions)
    makes the emulation take the next name instead of failing with `File exists`."""
    import os

    from hetsynth.runtime import emulation

    pid = os.getpid()
    monkeypatch.setattr(emulation, "leftovers", lambda: {"namespaces": [f"hse{pid}n1"], "cgroups": [],
                                                         "veths": [f"hse{pid}ba0"]})
    assert emulation.free_name(2) == f"hse{pid}c"
