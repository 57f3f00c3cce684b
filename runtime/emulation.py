"""A heterogeneous cluster emulated on one Linux machine (needs root).

From a cluster spec with an `emulation` section:

- every node is a network namespace `<run>n<i>` with an interface `eth0` (10.77.0.<i+1>/24)
  plugged into a bridge in a switch namespace `<run>sw` by a veth pair; both ends of every
  veth are shaped to the node's NIC speed R (the spec's inter-node bandwidth) with a bucket of
  B, the spec's `burst_kib` (256 unless set: at 50 Mbit/s a 256 KiB bucket lets a 128 KiB
  message through in no time after an idle spell, where a link would take 21 ms), by
  `shaper()`: with `link_queue = "priority"` (the default) an htb class at R whose packets
  under 128 bytes (TCP acknowledgements) leave before the queued data, both queues 100 000
  packets; with "tbf", `tbf rate R burst B latency 20ms`. Why: with tbf, one FIFO of 20 ms
  (125 KB at 50 Mbit/s) per direction, a sender's TCP (which may queue 4 MB per socket,
  net.ipv4.tcp_limit_output_bytes) lost 14% of its packets at its own qdisc, and a
  direction's acknowledgements waited behind the other direction's data: the pipeline's
  activations and gradients, which cross the link both ways at once, ran 12-23% below the
  link's rate (eager-1F1B's step 1.52 s against 1.30-1.34 s with "priority", its 1F1B 1.71
  against 1.62-1.77). A NIC is full duplex and does not drop what its own host queues. Ranks
  of one node share its namespace and talk over loopback (intra-node);
- every device is a cgroup v1 CPU group `/sys/fs/cgroup/cpu/<run>/r<rank>` with
  `cpu.cfs_period_us` = the spec's period (10 ms: much shorter than a step, so quotas act
  within a step) and `cpu.cfs_quota_us` = quota * period (0.5 CPU = 5000 us); a worker joins
  its group and pins itself to one CPU (the CPUs are assigned so that the quotas on each add
  up evenly), with one torch thread;
- with `comm_engine = "separate"` (the default) every device also has a communication group
  `/sys/fs/cgroup/cpu/<run>/c<rank>`, without a quota, on any CPU, and `cpu.shares` 8192 against
  the device groups' 1024 (a woken transfer thread runs at once, as a NIC would; it uses little
  CPU, taken mostly from what the quotas leave idle): the worker's threads other than
  its main one (gloo's transport and collective threads, which copy, sum and send the bytes;
  the heartbeat) move there as they appear (`CommEngine`, a thread that looks every 50 ms).
  Why: in one quota, a collective's threads are throttled with the compute once the period's
  quota is spent, so every message of an asynchronous collective waited up to 7.5 ms (0.25 CPU)
  for its thread to run, and its CPU slowed the compute it was meant to hide under; on a GPU
  the NIC and the copy engines move the bytes beside the SMs. (Measured with the shared quota:
  GPT small-cpu's gradient buckets took 150 ms for 1.9 MB over a 25 MB/s link, 75 ms of
  wire, and a ring step inside a node could not hide under a matmul at all.) The main thread
  (the device) still sends the first part of a point-to-point message itself: gloo writes what
  the socket takes at once on the posting thread.
- with `memory_scale` set, every device is also a cgroup v1 memory group
  `/sys/fs/cgroup/memory/<run>/r<rank>` whose `memory.limit_in_bytes` is its kind's
  `memory_gib` * memory_scale: a device's memory is finite, and a rank that needs more is
  killed by the kernel's OOM killer (counted in the group's `memory.oom_control` `oom_kill`),
  which the launcher reports as out of memory, with the rank and its limit. A worker joins
  its group after importing torch (v1 charges a page to the group of the process that first
  touches it, and does not move old charges): the limit holds the training's own memory
  (tensors, allocator slack, the communication buffers), not the interpreter. The group's
  `memory.max_usage_in_bytes` is the measured peak (`memory_usage()`). These groups are not
  in the run state file (runtime.record_check accepts CPU groups only): `stop()` removes them,
  and after a SIGKILLed run `remove_unrecorded()` removes those whose run is gone. The workers
  of such a cluster run with MEMORY_ENV: glibc's malloc raises its mmap threshold after a large
  block is freed (up to 32 MiB), after which freed tensors stay in its heap and keep their pages;
  measured on GPT with 13.6 M parameters on 4 gloo ranks, FSDP2's resident peak grew by 369 MiB
  with glibc's default and by 170 with a fixed threshold (DDP: 354 and 325). A fixed 64 KiB threshold
  gives a tensor's pages back when it is freed, as a GPU's allocator makes freed blocks reusable,
  so the limit and the measured peak are about tensors, not about malloc's history.

`Emulation.start()` builds it, `stop()` removes everything (processes in its cgroups and
namespaces are killed first); use it as a context manager so that happens on errors, Ctrl-C
and SIGTERM too. Every namespace, veth and cgroup is recorded in a run state file before it
is created (runtime.runstate), so what a SIGKILLed run leaves is removed by the next
`hetsynth` command. The run's name is `hse<pid>` (a letter appended while that name is
taken), so a leftover of an older run never collides with a new one. Without root,
`unavailable()` says why, and callers run plain local processes instead (correctness only).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hetsynth.instruction_set.cluster import ClusterSpec, Emulation as EmulationSpec
from hetsynth.runtime.names import CGROUP_CPU, PREFIX
from hetsynth.runtime.runstate import RunRecord, recorded, remove, remove_cgroup, remove_namespace

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # workers under memory limits (module docstring)
IFACE = "eth0"
ENV = "HETSYNTH_EMULATION"
COMM_SHARES = 8192   # cpu.shares of a communication group, against the device groups' 1024


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


ACK_BYTES = 128   # IP packets shorter than this (TCP acknowledgements, no payload) go first


def shaper(emulation: EmulationSpec, mbit: float, dev: str) -> list[tuple[str, ...]]:
    """The tc commands that shape one end of a link to `mbit` (module docstring: `link_queue`).

    priority: htb root; class 1:1 at the rate with the spec's bucket; under it 1:10 (IP packets
    shorter than ACK_BYTES, by a u32 filter on the IP total length; htb prio 0) and 1:20
    (everything else, prio 1), each borrowing up to the full rate, each a 100 000-packet pfifo."""
    rate, burst = f"{mbit:.3f}mbit", f"{emulation.burst_kib}kb"
    if emulation.link_queue == "tbf":
        return [("qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "20ms")]
    out = [("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"),
           ("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
            "burst", burst, "cburst", burst, "quantum", "1514")]
    for leaf, prio in (("10", "0"), ("20", "1")):
        out += [("class", "add", "dev", dev, "parent", "1:1", "classid", f"1:{leaf}", "htb", "rate", rate, "ceil",
                 rate, "burst", burst, "cburst", burst, "prio", prio, "quantum", "1514"),
                ("qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "pfifo", "limit", "100000")]
    mask = f"0x{(0xFFFF & ~(ACK_BYTES - 1)):04x}"
    return out + [("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "u16",
                   "0x0000", mask, "at", "2", "flowid", "1:10")]


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
    record: RunRecord | None = None  # where to record what it creates (default: its own)
    run: str = ""
    created: list[tuple[str, str]] = field(default_factory=list)
    memory_groups: list[Path] = field(default_factory=list)  # made, outside the record (module docstring)
    _own_record: bool = False

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

    def memory_limits(self) -> list[int] | None:
        """Each rank's memory limit in bytes (memory_gib * memory_scale), or None: no limits."""
        assert self.spec.emulation is not None
        scale = self.spec.emulation.memory_scale
        if scale is None:
            return None
        return [int(self.spec.device_kinds[d.kind].memory_gib * scale * 2**30) for d in self.spec.devices]

    def worker_env(self) -> dict[str, str]:
        """Environment every worker needs: rank_env, and MEMORY_ENV under memory limits."""
        assert self.spec.emulation is not None
        return {ENV: self.rank_env()} | (MEMORY_ENV if self.spec.emulation.memory_scale is not None else {})

    def memory_cgroup(self, rank: int) -> Path | None:
        """The rank's memory group, or None where the spec sets no memory limit."""
        assert self.spec.emulation is not None
        return None if self.spec.emulation.memory_scale is None else CGROUP_MEMORY / self.run / f"r{rank}"

    def comm_cgroup(self, rank: int) -> Path | None:
        """The group of the rank's communication threads, or None where they share its quota."""
        assert self.spec.emulation is not None
        return CGROUP_CPU / self.run / f"c{rank}" if self.spec.emulation.comm_engine == "separate" else None

    def rank_env(self) -> str:
        """What a worker needs to join its device: {rank: [cgroup dir, cpu, comm cgroup dir or
        null, memory cgroup dir or null]} as JSON."""
        cpus = assign_cpus(self.quotas(), os.cpu_count() or 1)
        comm = [self.comm_cgroup(r) for r in range(self.spec.num_devices)]
        memory = [self.memory_cgroup(r) for r in range(self.spec.num_devices)]
        return json.dumps({r: [str(self.cgroup(r)), cpus[r], comm[r] and str(comm[r]), memory[r] and str(memory[r])]
                           for r in range(self.spec.num_devices)})

    def nic_mbit(self, node: int) -> float:
        n = self.spec.nodes[node]
        return (n.nic_bandwidth_gbps or self.spec.links.inter_node_bandwidth_gbps) * 1000

    # -- building and removing ----------------------------------------------------------------
    def start(self) -> "Emulation":
        reason = unavailable()
        if reason:
            raise EmulationError(f"cannot emulate {self.spec.name!r}: {reason}")
        self.quotas()  # a spec without a quota for some device kind fails before anything exists
        if self.record is None:
            self.record, self._own_record = RunRecord.open(), True
        self.run = self.run or free_name(len(self.spec.nodes))
        try:
            self._network()
            self._cgroups()
            self._memory_cgroups()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self, kind: str, name: str, *commands: tuple[str, ...]) -> None:
        """Record `name`, then run the commands that create it."""
        assert self.record is not None
        self.record.add(kind, name)
        self.created.append((kind, name))
        for cmd in commands:
            sh(*cmd)

    def _network(self) -> None:
        sw = self.switch
        self._create("netns", sw, ("ip", "netns", "add", sw))
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._node(i, ns)

    def _node(self, i: int, ns: str) -> None:
        self._create("netns", ns, ("ip", "netns", "add", ns))
        a, b = f"{self.run}a{i}", f"{self.run}b{i}"
        self._create("veth", a, ("ip", "link", "add", a, "type", "veth", "peer", "name", b))
        sh("ip", "link", "set", a, "netns", ns)
        sh("ip", "link", "set", b, "netns", self.switch)
        sh("ip", "-n", ns, "link", "set", a, "name", IFACE)
        sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
        for link in (IFACE, "lo"):
            sh("ip", "-n", ns, "link", "set", link, "up")
        sh("ip", "-n", self.switch, "link", "set", b, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", b, "up")
        if self.spec.emulation is not None and self.spec.emulation.shape_links:
            for where, dev in ((ns, IFACE), (self.switch, b)):
                for command in shaper(self.spec.emulation, self.nic_mbit(i), dev):
                    sh("ip", "netns", "exec", where, "tc", *command)

    def _cgroups(self) -> None:
        assert self.spec.emulation is not None
        period = self.spec.emulation.period_us
        root = CGROUP_CPU / self.run
        self._create("cgroup", str(root))
        root.mkdir()
        for rank, quota in enumerate(self.quotas()):
            group = self.cgroup(rank)
            self._create("cgroup", str(group))
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(round(quota * period)))  # >= 1 ms: Emulation
            comm = self.comm_cgroup(rank)
            if comm is not None:
                self._create("cgroup", str(comm))
                comm.mkdir()
                (comm / "cpu.shares").write_text(str(COMM_SHARES))

    def _memory_cgroups(self) -> None:
        """The memory groups with their limits (module docstring); none without memory_scale."""
        limits = self.memory_limits()
        if limits is None:
            return
        if not (CGROUP_MEMORY / "memory.limit_in_bytes").exists():
            raise EmulationError(f"emulation.memory_scale is set but there is no cgroup v1 memory controller "
                                 f"at {CGROUP_MEMORY}")
        self._memory_group(CGROUP_MEMORY / self.run)
        for rank, limit in enumerate(limits):
            group = self._memory_group(CGROUP_MEMORY / self.run / f"r{rank}")
            (group / "memory.limit_in_bytes").write_text(str(limit))
            (group / "memory.swappiness").write_text("0")

    def _memory_group(self, group: Path) -> Path:
        self.memory_groups.append(group)
        group.mkdir()
        return group

    def memory_usage(self) -> dict[int, dict[str, int]]:
        """rank -> {"limit_bytes", "peak_bytes" (memory.max_usage_in_bytes), "failcnt" (allocations
        refused at the limit), "oom_kills" (processes the OOM killer ended in the group)}; {}
        without memory groups. Read before `stop()`."""
        out = {}
        for rank in range(self.spec.num_devices):
            group = self.memory_cgroup(rank)
            if group is not None and group.is_dir():
                out[rank] = read_memory_group(group)
        return out

    def stop(self) -> None:
        """Remove everything created (processes in it killed first), newest first."""
        try:
            remove([[k, n] for k, n in self.created])
        finally:
            for group in reversed(self.memory_groups):
                remove_cgroup(str(group))
            self.memory_groups.clear()
        if self.record is not None:
            for kind, name in self.created:
                self.record.forget(kind, name)
            if self._own_record:
                self.record.close()
                self.record, self._own_record = None, False
        self.created.clear()

    def __enter__(self) -> "Emulation":
        self._handlers = exit_on_signals()
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            restore_signals(getattr(self, "_handlers", {}))

    def in_node(self, node: int, cmd: list[str]) -> list[str]:
        """Run `cmd` in a node's network namespace. nsenter switches only the network
        namespace (`ip netns exec` also remounts /sys, hiding the cgroup hierarchy)."""
        return ["nsenter", f"--net=/var/run/netns/{self.namespaces[node]}", *cmd]


def read_memory_group(group: Path) -> dict[str, int]:
    """A memory group's limit, peak, failcnt and OOM kills (Emulation.memory_usage)."""
    control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines() if line)
    return {"limit_bytes": int((group / "memory.limit_in_bytes").read_text()),
            "peak_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((group / "memory.failcnt").read_text()),
            "oom_kills": int(control.get("oom_kill", 0))}


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_signals() -> dict[int, object]:
    """SIGTERM and SIGHUP raise SystemExit while an emulation or a run is up (as Ctrl-C
    raises KeyboardInterrupt), so `finally` removes it; returns the previous handlers (none
    off the main thread, where handlers cannot be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}


def restore_signals(handlers: dict[int, object]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def join_device() -> "CommEngine | None":
    """In a worker: join this rank's cgroup and CPU, if the launcher asked for it, and start
    moving the communication threads out of it (the comm engine) where the spec says so."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    group, cpu, comm, memory = json.loads(spec)[os.environ["RANK"]]
    _import_lazy_parts()
    (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    if memory:
        (Path(memory) / "cgroup.procs").write_text(str(os.getpid()))
    os.sched_setaffinity(0, {cpu})
    return CommEngine(Path(comm)).start() if comm else None


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """In a worker: what is allocated inside is the host's memory, not this rank's device's.
    The rank's process moves to its run's memory group (no limit) and back to its own
    (cgroup v1 charges a page to the group it was first touched in, and uncharges it there when
    freed). What for: the model a rank builds whole, from its factory, before it places its part
    on the device. On a GPU that build is in host RAM and only the part is copied to the device;
    here both are this process's RAM, and without this the device's limit and measured peak would
    count the whole model (13.6 M parameters: 52 MiB on every rank for the life of the set-up, the
    peak of a slow rank of memory-bound-emulated.toml: 75.7 MiB where training peaks at 69).
    A no-op without device memory (no `emulation.memory_scale`, or outside an emulated cluster)."""
    spec = os.environ.get(ENV)
    memory = json.loads(spec)[os.environ["RANK"]][3] if spec else None
    if not memory:
        yield
        return
    device, pid = Path(memory), str(os.getpid())
    (device.parent / "cgroup.procs").write_text(pid)
    try:
        yield
    finally:
        (device / "cgroup.procs").write_text(pid)


def leave_device() -> None:
    """In a worker whose work is done: leave this rank's CPU group for the root group and run
    on any CPU (a no-op outside an emulated cluster). The memory group stays: its peak is read
    after the run. Why: what follows the work (the last barrier, the process group's teardown,
    the interpreter's exit: about 0.3 s of CPU) is no device's work, and at a 0.25 CPU quota it
    took 1.3 s of every run's wall time (measured, 2-rank GPT tiny: from the ranks' end to the
    command's 4.0 s, 2.7 s after leaving). Every thread goes (cgroup.procs moves them all);
    the comm engine has nothing left to move."""
    if not os.environ.get(ENV):
        return
    (CGROUP_CPU / "cgroup.procs").write_text(str(os.getpid()))
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def _import_lazy_parts() -> None:
    """Import, before the device's quota applies, what torch loads on first use on every rank:
    torch._dynamo, which constructing any torch.optim optimizer imports (about 1.5 s of CPU; at a
    0.25 CPU quota 6 s of wall time, none of it the device's work)."""
    import torch._dynamo  # noqa: F401


class CommEngine:
    """Moves every thread of this process but the main one into the communication cgroup, on
    any CPU, as threads appear (gloo makes its threads with each process group; a look every
    `interval_s`). Its own thread is the first it moves."""

    def __init__(self, group: Path, interval_s: float = 0.05) -> None:
        self.group, self.interval_s = group, interval_s
        # the main thread's id is the pid (Linux); threading.main_thread().native_id still names the
        # parent's main thread in a forked process (Python 3.11), whose own main thread would then
        # be moved out of its device's quota
        self.main = os.getpid()
        self.moved: set[int] = set()
        self.cpus = set(range(os.cpu_count() or 1))

    def start(self) -> "CommEngine":
        threading.Thread(target=self._run, name="hetsynth-comm-engine", daemon=True).start()
        return self

    def move_new(self) -> None:
        """Move the threads not moved yet."""
        new = [int(t) for t in os.listdir("/proc/self/task") if int(t) != self.main and int(t) not in self.moved]
        for tid in new:
            try:
                (self.group / "tasks").write_text(str(tid))
                os.sched_setaffinity(tid, self.cpus)
            except OSError as err:  # ProcessLookupError included
                if Path(f"/proc/self/task/{tid}").exists():  # gone meanwhile: nothing to move
                    raise EmulationError(f"moving thread {tid} to {self.group}: {err}") from err
            self.moved.add(tid)

    def _run(self) -> None:
        while True:
            self.move_new()
            time.sleep(self.interval_s)


def leftovers() -> dict[str, list[str]]:
    """Namespaces, cgroups and veths of emulations, for checks that nothing is left behind."""
    ns = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line]
    groups = [p.name for p in CGROUP_CPU.glob(f"{PREFIX}*")] if CGROUP_CPU.exists() else []
    groups += [f"memory/{p.name}" for p in CGROUP_MEMORY.glob(f"{PREFIX}*")] if CGROUP_MEMORY.exists() else []
    links = [line.split(":")[1].strip().split("@")[0]
             for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines() if ":" in line]
    return {"namespaces": [n for n in ns if n.startswith(PREFIX)], "cgroups": groups,
            "veths": [link for link in links if link.startswith(PREFIX)]}


def names(run: str, num_nodes: int) -> set[str]:
    """Every namespace, veth and cgroup name an emulation called `run` creates."""
    nodes = range(num_nodes)
    return ({f"{run}sw", run} | {f"{run}n{i}" for i in nodes} | {f"{run}a{i}" for i in nodes}
            | {f"{run}b{i}" for i in nodes})


def free_name(num_nodes: int) -> str:
    """`hse<pid>`, or with a letter appended while any of its names exists."""
    found = leftovers()
    taken = set(found["namespaces"]) | {g.removeprefix("memory/") for g in found["cgroups"]} | set(found["veths"])
    for suffix in ["", *"bcdefghijklmnopqrstuvwxyz"]:
        run = f"{PREFIX}{os.getpid()}{suffix}"
        if not names(run, num_nodes) & taken:
            return run
    raise EmulationError(f"every emulation name {PREFIX}{os.getpid()}[b-z] is taken: run `hetsynth cleanup`")


def remove_unrecorded() -> list[str]:
    """Remove emulations no run state file lists whose owner is gone: those of hetsynth
    versions before the state files (named `hse<pid % 100000>`). Returns what was removed."""
    mine, removed = recorded(), []
    live = {f"{PREFIX}{pid % 100000}" for pid in _pids()} | {f"{PREFIX}{pid}" for pid in _pids()}
    found = leftovers()
    for ns in found["namespaces"]:
        owner = ns[:-2] if ns.endswith("sw") else ns[: ns.rfind("n")]
        if ns not in mine and owner not in live:
            remove_namespace(ns)
            removed.append(f"namespace {ns}")
    for name in found["cgroups"]:
        if name.startswith("memory/"):
            removed += _remove_memory_group(name.removeprefix("memory/"), live)
        elif str(CGROUP_CPU / name) not in mine and name not in live:
            remove_cgroup(str(CGROUP_CPU / name))
            removed.append(f"cgroup {CGROUP_CPU / name}")
    return removed


def _remove_memory_group(name: str, live: set[str]) -> list[str]:
    """Remove a run's memory group once its run is gone: its owner is dead and its CPU group
    (which the run state file records) has been removed."""
    if name in live or (CGROUP_CPU / name).exists():
        return []
    remove_cgroup(str(CGROUP_MEMORY / name))
    return [f"cgroup {CGROUP_MEMORY / name}"]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]
