"""A heterogeneous cluster emulated on one Linux machine (needs root).

From a cluster spec with an `emulation` section:

- every node is a network namespace `<run>n<i>` with an interface `eth0` (10.77.0.<i+1>/24)
  plugged into a bridge in a switch namespace `<run>sw` by a veth pair; both ends of every
  veth are shaped with tbf to the node's NIC speed (the spec's inter-node bandwidth):
  `tc qdisc add dev <veth> root tbf rate <R>mbit burst 256kb latency 20ms`. Ranks of one node
  share its namespace and talk over loopback (intra-node);
- every device is a cgroup v1 CPU group `/sys/fs/cgroup/cpu/<run>/r<rank>` with
  `cpu.cfs_period_us` = the spec's period (10 ms: much shorter than a step, so quotas act
  within a step) and `cpu.cfs_quota_us` = quota * period (0.5 CPU = 5000 us); a worker joins
  its group and pins itself to one CPU (the CPUs are assigned so that the quotas on each add
  up evenly), with one torch thread.

`Emulation.start()` builds it, `stop()` removes everything (processes in its cgroups are
killed first); use it as a context manager so that happens on errors, Ctrl-C and SIGTERM too.
`cleanup_stale()` removes what runs that died left behind. Without root, `unavailable()`
says why, and callers run plain local processes instead (correctness only).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cost_models.cluster import ClusterSpec

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PREFIX = "hse"
IFACE = "eth0"
ENV = "HETSYNTH_EMULATION"


class EmulationError(RuntimeError):
    """The emulated cluster could not be built; the message has the failing command."""


def unavailable() -> str | None:
    """Why this machine cannot emulate a cluster, or None if it can."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces and cgroups need root)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (install {package})"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise EmulationError(f"{' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def assign_cpus(quotas: list[float], num_cpus: int) -> list[int]:
    """Greedy balance: the largest quota first, each to the least loaded CPU."""
    load = [0.0] * num_cpus
    out = [0] * len(quotas)
    for rank in sorted(range(len(quotas)), key=lambda r: -quotas[r]):
        cpu = min(range(num_cpus), key=lambda c: (load[c], c))
        out[rank] = cpu
        load[cpu] += quotas[rank]
    return out


@dataclass
class Emulation:
    spec: ClusterSpec
    run: str = field(default_factory=lambda: f"{PREFIX}{os.getpid() % 100000}")
    created_ns: list[str] = field(default_factory=list)
    created_cgroups: list[Path] = field(default_factory=list)

    # -- description ------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        return [f"{self.run}n{i}" for i in range(len(self.spec.nodes))]

    @property
    def switch(self) -> str:
        return f"{self.run}sw"

    def address(self, node: int) -> str:
        return f"10.77.0.{node + 1}"

    def quotas(self) -> list[float]:
        assert self.spec.emulation is not None
        quota = self.spec.emulation.cpu_quota
        missing = sorted({d.kind for d in self.spec.devices} - set(quota))
        if missing:
            raise EmulationError(f"emulation.cpu_quota has no entry for device kind(s) {missing}")
        return [quota[d.kind] for d in self.spec.devices]

    def cgroup(self, rank: int) -> Path:
        return CGROUP_CPU / self.run / f"r{rank}"

    def rank_env(self) -> str:
        """What a worker needs to join its device: {rank: [cgroup dir, cpu]} as JSON."""
        cpus = assign_cpus(self.quotas(), os.cpu_count() or 1)
        return json.dumps({r: [str(self.cgroup(r)), cpus[r]] for r in range(self.spec.num_devices)})

    def nic_mbit(self, node: int) -> float:
        n = self.spec.nodes[node]
        return (n.nic_bandwidth_gbps or self.spec.links.inter_node_bandwidth_gbps) * 1000

    # -- building and removing ----------------------------------------------------------------
    def start(self) -> "Emulation":
        reason = unavailable()
        if reason:
            raise EmulationError(f"cannot emulate {self.spec.name!r}: {reason}")
        try:
            self._network()
            self._cgroups()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        sw = self.switch
        sh("ip", "netns", "add", sw)
        self.created_ns.append(sw)
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._node(i, ns)

    def _node(self, i: int, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created_ns.append(ns)
        a, b = f"{self.run}a{i}", f"{self.run}b{i}"
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", a, "netns", ns)
        sh("ip", "link", "set", b, "netns", self.switch)
        sh("ip", "-n", ns, "link", "set", a, "name", IFACE)
        sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
        for link in (IFACE, "lo"):
            sh("ip", "-n", ns, "link", "set", link, "up")
        sh("ip", "-n", self.switch, "link", "set", b, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", b, "up")
        if self.spec.emulation is not None and self.spec.emulation.shape_links:
            rate = f"{self.nic_mbit(i):.3f}mbit"
            for where, dev in ((ns, IFACE), (self.switch, b)):
                sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", "256kb", "latency", "20ms")

    def _cgroups(self) -> None:
        assert self.spec.emulation is not None
        period = self.spec.emulation.period_us
        root = CGROUP_CPU / self.run
        root.mkdir(exist_ok=True)
        self.created_cgroups.append(root)
        for rank, quota in enumerate(self.quotas()):
            group = self.cgroup(rank)
            group.mkdir(exist_ok=True)
            self.created_cgroups.insert(0, group)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(quota * period))))

    def stop(self) -> None:
        for group in self.created_cgroups:
            _kill_members(group)
        for group in self.created_cgroups:
            _rmdir(group)
        for ns in reversed(self.created_ns):
            sh("ip", "netns", "del", ns, check=False)
        self.created_cgroups.clear()
        self.created_ns.clear()

    def __enter__(self) -> "Emulation":
        self._handlers = _exit_on_signals()
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in getattr(self, "_handlers", {}).items():
                signal.signal(sig, handler)

    def in_node(self, node: int, cmd: list[str]) -> list[str]:
        """Run `cmd` in a node's network namespace. nsenter switches only the network
        namespace (`ip netns exec` also remounts /sys, hiding the cgroup hierarchy)."""
        return ["nsenter", f"--net=/var/run/netns/{self.namespaces[node]}", *cmd]


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_signals() -> dict[int, object]:
    """SIGTERM and SIGHUP raise SystemExit while an emulation is up (as Ctrl-C raises
    KeyboardInterrupt), so `finally` removes it; returns the previous handlers (none off
    the main thread, where handlers cannot be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _kill_members(group: Path) -> None:
    procs = group / "cgroup.procs"
    if not procs.exists():
        return
    for line in procs.read_text().split():
        try:
            os.kill(int(line), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rmdir(group: Path) -> None:
    for _ in range(50):  # killed processes leave their cgroup asynchronously
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    raise EmulationError(f"cannot remove cgroup {group}: still busy")


def join_device() -> None:
    """In a worker: join this rank's cgroup and CPU, if the launcher asked for it."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    group, cpu = json.loads(spec)[os.environ["RANK"]]
    (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    os.sched_setaffinity(0, {cpu})


def leftovers() -> dict[str, list[str]]:
    """Namespaces and cgroups of emulations, for checks that nothing is left behind."""
    ns = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line]
    groups = [p.name for p in CGROUP_CPU.glob(f"{PREFIX}*")] if CGROUP_CPU.exists() else []
    return {"namespaces": [n for n in ns if n.startswith(PREFIX)], "cgroups": groups}


def cleanup_stale() -> list[str]:
    """Remove the resources of emulations whose process is gone; returns what was removed."""
    removed = []
    live = {f"{PREFIX}{pid % 100000}" for pid in _pids()}
    found = leftovers()
    for ns in found["namespaces"]:
        run = ns[: ns.rfind("n") if ns[-2:] != "sw" else -2]
        if run not in live:
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for name in found["cgroups"]:
        if name not in live:
            root = CGROUP_CPU / name
            for group in list(root.glob("r*")) + [root]:
                _kill_members(group)
                _rmdir(group)
            removed.append(str(root))
    return removed


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]
