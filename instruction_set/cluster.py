"""Cluster specification: device kinds, devices, nodes and links.

A cluster is a flat, ordered list of devices (the order is the rank order used by plans and
the runtime) grouped into nodes. Devices of one node talk over the intra-node link; devices
of different nodes over the inter-node network, whose speed is the slowest NIC on the path
(a node may declare its own `nic_bandwidth_gbps`).

Units are part of the field names (instruction_set.units): throughput in FLOP/s, memory in
GiB, link bandwidth in Gbit/s, memory bandwidth in GB/s, latency in microseconds.

Specs are written in TOML (or JSON). A node lists its devices by name, or gives `kind` and
`num_devices` as a shorthand that names them `<node>/<i>`:

    name = "a100-t4"
    [device_kinds.A100]
    throughput_flops = 19.5e12
    memory_gib = 40
    [device_kinds.A100.matmul_flops]
    tf32 = 156e12
    bfloat16 = 312e12
    float16 = 312e12
    [[nodes]]
    name = "fast"
    kind = "A100"
    num_devices = 4
    [links]
    intra_node_bandwidth_gbps = 2400
    inter_node_bandwidth_gbps = 100
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetsynth.instruction_set.calibration import Calibration
from hetsynth.instruction_set.matmul_rates import HALF_DTYPES, Dtype, MatmulRates
from hetsynth.instruction_set.units import Flops, GByteS, GiB, Gbps, Micros


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be used; the message names the field and the value."""


MAX_DEVICES = 65_536  # the largest cluster a spec may describe (see load_cluster)
MIN_QUOTA_US = 1000  # the least CFS quota the kernel takes (cpu.cfs_quota_us)


class _Frozen(BaseModel):
    """Strict scalars (no `true` for a count, no "16" for a number) and finite floats; lists
    are accepted for tuples (`Field(strict=False)` on those fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class DeviceKind(_Frozen):
    """A device model. `throughput_flops` is the effective dense float32 matmul rate (peak or
    measured); `matmul_flops` the rate per dtype (instruction_set.matmul_rates), whose 16-bit
    entries say which 16-bit types the kind computes in. A kind without the table runs float32
    only; a table with `float32` may stand in for `throughput_flops`."""

    throughput_flops: Flops
    matmul_flops: MatmulRates | None = None
    memory_gib: GiB
    memory_bandwidth_gbyte_s: GByteS = 500.0
    kernel_launch_us: Micros = 5.0
    transfer_cpu_share: float = Field(
        default=0.0, ge=0, le=1,
        description="gamma: the share of an asynchronous collective's time that this device's compute "
                    "loses while the collective is in flight (0: a copy engine or NCCL moves the bytes; "
                    "near 1: CPU workers whose transfer threads share the compute's CPU quota); "
                    "measured by hetsynth profile (profiling.overlap)")
    transfer_cpu_us_per_message: Micros = Field(
        default=0.0,
        description="the compute time this device loses per asynchronous message in flight (waking "
                    "the transfer threads), beside transfer_cpu_share; measured by hetsynth profile")
    p2p_cpu_share: float | None = Field(
        default=None, ge=0, le=1,
        description="transfer_cpu_share for point-to-point messages (pipeline boundaries), measured "
                    "apart from the all-reduces' by hetsynth profile; unset: transfer_cpu_share")
    p2p_cpu_us_per_message: Micros | None = Field(
        default=None,
        description="transfer_cpu_us_per_message for point-to-point messages (pipeline boundaries); "
                    "unset: transfer_cpu_us_per_message")
    measured: bool = False

    @model_validator(mode="before")
    @classmethod
    def _float32_rate(cls, raw: Any) -> Any:
        """throughput_flops from matmul_flops.float32 when only the table gives it."""
        if isinstance(raw, dict) and "throughput_flops" not in raw and isinstance(raw.get("matmul_flops"), dict):
            rate = raw["matmul_flops"].get("float32")
            return {**raw, "throughput_flops": rate} if rate is not None else raw
        return raw

    @model_validator(mode="after")
    def _rates_agree(self) -> "DeviceKind":
        given = self.matmul_flops.float32 if self.matmul_flops else None
        if given is not None and given != self.throughput_flops:
            raise ValueError(f"matmul_flops.float32 = {given:g} FLOP/s and throughput_flops = "
                             f"{self.throughput_flops:g} FLOP/s differ; both are the float32 matmul rate, give one")
        return self

    def rate_flops(self, dtype: Dtype) -> float | None:
        """Dense matmul FLOP/s in `dtype`; None where the kind does not run it."""
        if dtype is Dtype.FLOAT32:
            return self.throughput_flops
        return self.matmul_flops.rate(dtype) if self.matmul_flops else None

    def half_dtypes(self) -> tuple[Dtype, ...]:
        """The 16-bit types the kind computes in (bfloat16 first), from its rate table."""
        return tuple(d for d in HALF_DTYPES if self.rate_flops(d) is not None)

    def p2p_cpu(self) -> tuple[float, float]:
        """(gamma, us per message) of a point-to-point transfer on this kind: the profile's
        point-to-point fit, else (no such measurement) its all-reduces'."""
        if self.p2p_cpu_share is None or self.p2p_cpu_us_per_message is None:
            return self.transfer_cpu_share, self.transfer_cpu_us_per_message
        return self.p2p_cpu_share, self.p2p_cpu_us_per_message


class Device(_Frozen):
    name: str = Field(min_length=1)
    kind: str = Field(min_length=1)


class Node(_Frozen):
    name: str = Field(min_length=1)
    devices: tuple[str, ...] = Field(strict=False)
    nic_bandwidth_gbps: Gbps | None = None
    intra_bandwidth_gbps: Gbps | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "Node":
        if not self.devices:
            raise ValueError(f"node {self.name!r} has no devices; list at least one device")
        return self


class Links(_Frozen):
    intra_node_bandwidth_gbps: Gbps
    intra_node_latency_us: Micros = 5.0
    inter_node_bandwidth_gbps: Gbps
    inter_node_latency_us: Micros = 50.0


class Emulation(_Frozen):
    """How to emulate this cluster on one machine (see runtime.emulation)."""

    cpu_quota: dict[str, float] = Field(description="CPU share per device kind, e.g. 0.5")
    period_us: int = Field(default=10_000, ge=1000, le=1_000_000)
    shape_links: bool = True
    burst_kib: int = Field(default=256, ge=2, le=65536, description="the token bucket of every shaped link: a "
                           "message of up to this size leaves at once when the link has been idle, so keep it "
                           "well under the messages timed on slow links")
    comm_engine: Literal["separate", "shared"] = Field(
        default="separate", description="separate: a worker's threads other than its main one (gloo's "
        "transport and collective threads, which move the bytes) run outside the device's CPU quota, as a "
        "GPU's NIC and copy engines work beside its SMs; shared: they spend the device's quota")
    link_queue: Literal["priority", "tbf"] = Field(
        default="priority", description="priority: every shaped link end is an htb class at the link's rate "
        "whose small packets (TCP acknowledgements) leave before the queued data and whose queues do not drop "
        "(as a full-duplex NIC: one direction's data does not hold back the other's acknowledgements); tbf: "
        "one tbf FIFO of 20 ms, which drops what does not fit")
    memory_scale: float | None = Field(
        default=None, gt=0, le=64, description="every worker's hard memory limit is its device kind's "
        "memory_gib times this (a cgroup v1 memory group; a rank that exceeds it is killed and reported out "
        "of memory); none: no limit")

    @model_validator(mode="after")
    def _quotas_positive(self) -> "Emulation":
        for kind, quota in self.cpu_quota.items():
            if not 0 < quota <= 64:
                raise ValueError(f"cpu_quota[{kind!r}] = {quota}: must be in (0, 64] CPUs")
            if quota * self.period_us < MIN_QUOTA_US:
                raise ValueError(f"cpu_quota[{kind!r}] = {quota} of period_us = {self.period_us} is "
                                 f"{quota * self.period_us:.0f} us, below the kernel's least quota of "
                                 f"{MIN_QUOTA_US} us; use period_us >= {math.ceil(MIN_QUOTA_US / quota)}")
        return self


class ClusterSpec(_Frozen):
    name: str = Field(min_length=1)
    description: str = ""
    device_kinds: dict[str, DeviceKind] = Field(min_length=1)
    devices: tuple[Device, ...] = Field(min_length=1, max_length=MAX_DEVICES, strict=False)
    nodes: tuple[Node, ...] = Field(min_length=1, max_length=MAX_DEVICES, strict=False)
    links: Links
    emulation: Emulation | None = None
    calibration: Calibration | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSpec":
        _check_unique("devices", [d.name for d in self.devices])
        _check_unique("nodes", [n.name for n in self.nodes])
        _check_kinds(self)
        _check_membership(self)
        _check_quotas(self)
        return self

    # -- derived views -------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device_kind(self, rank: int) -> DeviceKind:
        return self.device_kinds[self.devices[rank].kind]

    def node_of(self, rank: int) -> int:
        """Index of the node holding device `rank` (devices are listed node by node)."""
        if not 0 <= rank < self.num_devices:
            raise IndexError(f"rank {rank} of a {self.num_devices}-device cluster")
        return bisect.bisect_right(list(itertools.accumulate(len(n.devices) for n in self.nodes)), rank)

    def rank_nodes(self) -> tuple[int, ...]:
        """The node index of every device, in rank order."""
        return tuple(j for j, node in enumerate(self.nodes) for _ in node.devices)

    def throughputs_flops(self) -> list[float]:
        return [self.device_kind(r).throughput_flops for r in range(self.num_devices)]

    def memories_gib(self) -> list[float]:
        return [self.device_kind(r).memory_gib for r in range(self.num_devices)]

    def fingerprint(self) -> str:
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def scaled(self, num_nodes: int) -> "ClusterSpec":
        """A cluster of `num_nodes` nodes like this one's, in its proportions and order (node j
        copies node j * len(nodes) // num_nodes): hap-paper's 2 V100 + 6 P100 nodes scaled to
        128 nodes are 32 V100 and 96 P100 nodes. For studying how planning scales."""
        if num_nodes < 1:
            raise ClusterSpecError(f"scaled({num_nodes}): a cluster needs at least one node")
        kinds = {d.name: d.kind for d in self.devices}
        nodes = []
        for j in range(num_nodes):
            model = self.nodes[j * len(self.nodes) // num_nodes]
            node = model.model_dump(exclude_none=True) | {"name": f"{model.name}.{j}"}
            node["devices"] = [{"name": f"{node['name']}/{i}", "kind": kinds[d]} for i, d in enumerate(model.devices)]
            nodes.append(node)
        raw = self.model_dump(exclude_none=True, exclude={"nodes", "devices", "calibration"})
        raw["devices"] = [d for node in nodes for d in node["devices"]]
        for node in nodes:
            node["devices"] = [d["name"] for d in node["devices"]]
        return cluster_from_dict(raw | {"name": f"{self.name}x{num_nodes}", "nodes": nodes},
                                 source=f"{self.name} scaled to {num_nodes} nodes")

    def first(self, num_devices: int) -> "ClusterSpec":
        """The sub-cluster of the first `num_devices` devices (in rank order)."""
        if not 1 <= num_devices <= self.num_devices:
            raise ClusterSpecError(
                f"--devices {num_devices}: cluster {self.name!r} has {self.num_devices} devices; "
                f"choose 1..{self.num_devices}"
            )
        keep = {d.name for d in self.devices[:num_devices]}
        nodes = [
            n.model_copy(update={"devices": tuple(d for d in n.devices if d in keep)})
            for n in self.nodes
        ]
        return self.model_copy(
            update={
                "name": f"{self.name}[:{num_devices}]",
                "devices": self.devices[:num_devices],
                "nodes": tuple(n for n in nodes if n.devices),
            }
        )

    def subset(self, ranks: "range") -> "ClusterSpec":
        """The sub-cluster of the contiguous ranks `ranks` (a pipeline stage's devices), in
        rank order, with the nodes that hold them; links and calibration are kept."""
        if not (len(ranks) >= 1 and ranks.step == 1 and 0 <= ranks.start and ranks.stop <= self.num_devices):
            raise ClusterSpecError(f"ranks {list(ranks)}: a sub-cluster is a non-empty run of consecutive ranks "
                                   f"of 0..{self.num_devices - 1}")
        keep = {d.name for d in self.devices[ranks.start:ranks.stop]}
        nodes = [n.model_copy(update={"devices": tuple(d for d in n.devices if d in keep)}) for n in self.nodes]
        return self.model_copy(update={"name": f"{self.name}[{ranks.start}:{ranks.stop}]",
                                       "devices": self.devices[ranks.start:ranks.stop], "emulation": None,
                                       "nodes": tuple(n for n in nodes if n.devices)})


def _check_unique(what: str, names: list[str]) -> None:
    repeated = sorted(n for n, c in Counter(names).items() if c > 1)
    if repeated:
        raise ValueError(f"{what}: names must be unique; repeated: {repeated}")


def _check_kinds(spec: ClusterSpec) -> None:
    for device in spec.devices:
        if device.kind not in spec.device_kinds:
            raise ValueError(
                f"devices: device {device.name!r} has kind {device.kind!r}; "
                f"valid kinds are {sorted(spec.device_kinds)}"
            )


def _check_quotas(spec: ClusterSpec) -> None:
    """An emulated cluster gives every device kind in use a CPU share, and no other kind one."""
    if spec.emulation is None:
        return
    used = sorted({d.kind for d in spec.devices})
    quota = spec.emulation.cpu_quota
    missing = [k for k in used if k not in quota]
    if missing:
        raise ValueError(f"emulation.cpu_quota has no entry for device kind(s) {missing}; give each kind "
                         f"in use a CPU share, e.g. {missing[0]} = 0.5 (kinds in use: {used})")
    unknown = sorted(k for k in quota if k not in spec.device_kinds)
    if unknown:
        raise ValueError(f"emulation.cpu_quota names unknown device kind(s) {unknown}; "
                         f"device kinds: {sorted(spec.device_kinds)}")


def _check_membership(spec: ClusterSpec) -> None:
    known = {d.name for d in spec.devices}
    owner: dict[str, str] = {}
    for node in spec.nodes:
        for name in node.devices:
            if name not in known:
                raise ValueError(
                    f"nodes: node {node.name!r} lists unknown device {name!r}; "
                    f"declared devices are {sorted(known)[:8]}{'...' if len(known) > 8 else ''}"
                )
            if name in owner:
                raise ValueError(
                    f"nodes: device {name!r} is listed on two nodes, {owner[name]!r} and "
                    f"{node.name!r}; a device belongs to exactly one node"
                )
            owner[name] = node.name
    orphans = [d.name for d in spec.devices if d.name not in owner]
    if orphans:
        raise ValueError(f"devices: {orphans} belong to no node; list each device on one node")
    order = [name for node in spec.nodes for name in node.devices]
    if order != [d.name for d in spec.devices]:
        raise ValueError("devices: must be listed in node order (rank order is node by node)")


# -- loading --------------------------------------------------------------------------------


def _expand_node_shorthand(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Turn `kind` + `num_devices` on a node into explicit devices named `<node>/<i>`."""
    raw = dict(raw)
    nodes, devices = raw.get("nodes"), raw.get("devices", [])
    if not isinstance(nodes, list) or not isinstance(devices, list):
        return raw  # the model's validation names the wrong type
    devices = list(devices)
    expanded, total = [], len(devices)
    for node in nodes:
        if isinstance(node, dict) and "num_devices" in node:
            node = dict(node)
            count, kind = node.pop("num_devices"), node.pop("kind", None)
            where = f"invalid cluster spec {source}:\n  nodes[{node.get('name')!r}].num_devices = {count!r}"
            if type(count) is not int or count < 1:
                raise ClusterSpecError(f"{where}: must be an integer >= 1")
            total += count
            if total > MAX_DEVICES:
                raise ClusterSpecError(f"{where}: the spec would hold at least {total:,} devices; "
                                       f"a cluster spec may hold at most {MAX_DEVICES:,}")
            names = [f"{node.get('name')}/{i}" for i in range(count)]
            devices += [{"name": n, "kind": kind} for n in names]
            node["devices"] = list(node.get("devices", [])) + names
        expanded.append(node)
    raw["nodes"], raw["devices"] = expanded, devices
    return raw


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"invalid cluster spec {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" = {value!r}"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "missing required field"
        lines.append(f"  {loc}{shown}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def cluster_from_dict(raw: dict[str, Any], source: str = "<dict>") -> ClusterSpec:
    """Validate a parsed spec; raises ClusterSpecError naming every bad field and value."""
    if not isinstance(raw, dict):
        raise ClusterSpecError(f"invalid cluster spec {source}: expected a table, got {type(raw).__name__}")
    try:
        return ClusterSpec.model_validate(_expand_node_shorthand(raw, source))
    except ValidationError as err:
        raise ClusterSpecError(_format_errors(source, err)) from None
    except RecursionError:
        raise ClusterSpecError(f"invalid cluster spec {source}: nested too deeply") from None


def load_cluster(path: str | Path) -> ClusterSpec:
    """Load a cluster spec from a .toml or .json file."""
    path = Path(path)
    if not path.is_file():
        raise ClusterSpecError(f"cluster spec {str(path)!r} does not exist")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:  # unreadable for this user, or not text
        raise ClusterSpecError(f"cluster spec {path}: cannot read it: {err}") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ClusterSpecError(f"cluster spec {path}: cannot parse: {err}") from None
    except RecursionError:
        raise ClusterSpecError(f"cluster spec {path}: nested too deeply to parse (a spec needs a few levels "
                               f"of tables)") from None
    return cluster_from_dict(raw, source=str(path))


def dump_cluster_toml(spec: ClusterSpec) -> str:
    """Serialise a spec as TOML (used by the profiler to write measured specs)."""
    import tomli_w

    return tomli_w.dumps(spec.model_dump(mode="json", exclude_none=True))
