"""Plans cached on disk: the same planning inputs give the plan made before, without capture
or search.

Key. An entry is found by the SHA-256 of a JSON object holding everything a plan is a
function of:

- `code`: a hash of this hetsynth's planning source (every `.py` file of instruction_set,
  cost_models, planner, profiling and hetsynth, the zoo included), torch's version and, when it
  is installed, transformers' (hf: models are built from its classes). A change to the
  planner, its cost models or a zoo model is a different key.
- the model, in one of two forms:
  - `ref` (looked up before capture, `ref_key`): the model reference as written, and for a
    `path/file.py:factory` reference the SHA-256 of that file's bytes. The entry also lists
    every other local source file the factory imported (modules loaded from its directory
    tree, `model_files`) with their hashes, and a lookup whose files no longer hash the same
    is a miss: editing a helper module re-plans. A zoo or hf: model is covered by `code`.
  - `graph` (looked up after capture, `graph_key`, for modules of the Python API): the
    captured graph's fingerprint (its ops, arguments, shapes and parameter names;
    instruction_set.graph) and the model reference the plan records. What the fingerprint
    leaves out is either a function of what it covers (FLOPs, saved tensors: of ops and
    shapes) or not read by the search (source lines; a hit may carry the earlier ones).
- `cluster`: the spec's content after `--devices` (its JSON dump), not its path: an edited
  spec is a different key, a copied one the same.
- `options`: every planning option that can change the result (batch size, ratios, the
  data-parallel / fusion / ZeRO restrictions, bucket cap, precision, stages, micro-batches,
  schedule, replicate fallback, whether an unfit plan is kept).

Planning is deterministic in these (the search and the LP are; timing is not, so a plan of
`--measure-ops`, whose op times are measured here, is never cached). The key is thus sound
up to files a model reads that are not Python modules of its directory tree, and to
packages other than torch and transformers changing underneath; `--no-cache` re-plans.

A cluster that lost or gained devices of a known kind is a different key and is planned
from scratch: re-planning from cached per-block solutions needs a search that solves each
distinct block once and keeps those solutions, which the planner does not have.

Storage. `$HETSYNTH_CACHE_DIR` or `~/.cache/hetsynth/plans`, made with mode 0700 and used
only when it is this user's own real directory that no one else can write (runtime.runstate's
checks: `PlanCacheError`, an `error:` of the CLI, otherwise). One file per key,
`<sha256>.json` = {"format", "created", "key", "model_files", "plan"}, written under a new
unpredictable name and renamed into place, read without following links. An entry that
cannot be read or parsed is ignored with a warning and planned again (then replaced); a
directory that cannot be made (a read-only home) is a warning, and planning goes on without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from hetsynth.instruction_set.cluster import ClusterSpec
from hetsynth.instruction_set.graph import ReferenceGraph
from hetsynth.instruction_set.plan import Plan, plan_from_json, plan_text
from hetsynth.runtime.runstate import _untrusted, read_own, write_replacing

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the plan file's text and its hash, and the printed summary
PACKAGES = ("instruction_set", "cost_models", "planner", "profiling", "hetsynth")


class PlanCacheError(ValueError):
    """The cache directory cannot be trusted; the message says why and what to do."""


@dataclass(frozen=True)
class CacheKey:
    """What a plan is a function of (module docstring) and its hash, the entry's name."""

    material: Mapping[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.material, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Cached:
    """An entry: the plan file's text as save_plan writes it, when it was made, what `hetsynth
    plan` printed for it (None for a plan the API cached), and the plan itself unless the
    lookup was asked not to parse it (`parse=False`: a command that only copies the file and
    prints the summary, without the 0.3 s of validating a large plan)."""

    text: str
    created: str  # UTC, ISO 8601 to the second
    source: str  # the entry's path, for messages
    summary: str | None = None
    plan: Plan | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("HETSYNTH_CACHE_DIR") or Path.home() / ".cache" / "hetsynth" / "plans")


def checked_cache_dir() -> Path:
    """cache_dir(), made (0700) when missing; PlanCacheError when it is a link, not a
    directory, another user's, or writable by group or others."""
    directory = cache_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = directory.lstat()
    why = _untrusted(st)
    if why:
        raise PlanCacheError(f"plan cache directory {directory} {why} (owner uid {st.st_uid}, mode "
                             f"{st.st_mode & 0o7777:04o}); hetsynth uses only a directory of its own user "
                             f"(uid {os.geteuid()}) that no one else can write: set HETSYNTH_CACHE_DIR to one, "
                             f"or pass --no-cache")
    return directory


def _usable_dir() -> Path | None:
    """checked_cache_dir(); None, with a warning, when it cannot be made (a read-only home):
    planning goes on without the cache. An untrusted directory stays an error."""
    try:
        return checked_cache_dir()
    except OSError as err:
        log.warning("plan cache directory %s cannot be used (%s); planning without the cache", cache_dir(), err)
        return None


def _sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the planning source and the versions of torch and transformers (docstring)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("torch", "transformers"):
        digest.update(f"{dist}={_version(dist)}".encode())
    return digest.hexdigest()


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def factory_file(ref: str) -> Path | None:
    """The file of a `path/file.py:factory[,k=v]` reference; None for zoo and hf: references."""
    name = ref.partition(",")[0].rpartition(":")[0] or ref.partition(",")[0]
    return Path(name) if name.endswith(".py") else None


def ref_key(ref: str, cluster: ClusterSpec, options: Mapping[str, Any]) -> CacheKey:
    """The key of planning model reference `ref` (before capture; docstring)."""
    path = factory_file(ref)
    try:
        sha = _sha_file(path) if path is not None else None
    except OSError:  # capture reports the missing or unreadable file; nothing is stored
        sha = "unreadable"
    model = {"ref": ref, "file_sha256": sha}
    return _key(model, cluster, options)


def graph_key(graph: ReferenceGraph, cluster: ClusterSpec, options: Mapping[str, Any]) -> CacheKey:
    """The key of planning a captured graph (docstring)."""
    return _key({"fingerprint": graph.fingerprint, "ref": graph.model_ref}, cluster, options)


def _key(model: Mapping[str, Any], cluster: ClusterSpec, options: Mapping[str, Any]) -> CacheKey:
    return CacheKey({"format": FORMAT, "code": code_version(), "model": dict(model),
                     "cluster": cluster.model_dump(mode="json"), "options": dict(options)})


def model_files(ref: str) -> dict[str, str]:
    """SHA-256 of the factory file of `ref` and of every loaded module from its directory tree."""
    path = factory_file(ref)
    if path is None:
        return {}
    top = path.resolve().parent
    files = {path.resolve()} | {Path(m.__file__).resolve() for m in list(sys.modules.values())
                                if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(top)}
    return {str(f): _sha_file(f) for f in sorted(files) if f.suffix == ".py" and f.is_file()}


def lookup(key: CacheKey, parse: bool = True) -> Cached | None:
    """The entry of `key`; None when there is none, its model files changed, or it cannot be
    read or its plan text is not the one stored (a warning says why). `parse`: also read the
    plan (a plan that does not read is a corrupt entry too)."""
    directory = _usable_dir()
    if directory is None:
        return None
    path = directory / f"{key.digest}.json"
    try:
        text = read_own(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("plan cache entry %s cannot be read (%s); planning again", path, err)
        return None
    try:
        entry = json.loads(text)
        if entry.get("format") != FORMAT or entry.get("key") != json.loads(json.dumps(key.material)):
            raise ValueError("its key does not match its name")
        if hashlib.sha256(entry["plan_file"].encode()).hexdigest() != entry["plan_sha256"]:
            raise ValueError("its plan is not the one stored")
        if not _files_unchanged(entry["model_files"]):
            return None
        cached = Cached(entry["plan_file"], str(entry["created"]), str(path), entry.get("summary"))
    except _CORRUPT as err:
        _warn_corrupt(str(path), err)
        return None
    return with_plan(cached) if parse else cached


_CORRUPT = (ValueError, KeyError, TypeError, AttributeError, RecursionError)  # what a damaged entry raises


def with_plan(cached: Cached) -> Cached | None:
    """`cached` with its plan read from its text; None, with a warning, when the plan does not
    read (a corrupt entry)."""
    try:
        return replace(cached, plan=plan_from_json(json.loads(cached.text), cached.source))
    except _CORRUPT as err:
        _warn_corrupt(cached.source, err)
        return None


def _warn_corrupt(source: str, err: BaseException) -> None:
    log.warning("plan cache entry %s is corrupt (%s); planning again", source, str(err).splitlines()[0][:200])


def _files_unchanged(files: Mapping[str, str]) -> bool:
    try:
        return all(_sha_file(Path(f)) == sha for f, sha in files.items())
    except OSError:
        return False


def store(key: CacheKey, plan: Plan, files: Mapping[str, str] | None = None, summary: str | None = None) -> None:
    """Write the entry of `key` whole (the plan as the text save_plan writes, with its hash,
    and `summary`, what `hetsynth plan` printed); a failure to write is a warning, the plan
    stands."""
    plan_file = plan_text(plan)
    entry = {"format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
             "key": key.material, "model_files": dict(files or {}), "plan_file": plan_file,
             "plan_sha256": hashlib.sha256(plan_file.encode()).hexdigest(), "summary": summary}
    directory = _usable_dir()
    if directory is None:
        return
    path = directory / f"{key.digest}.json"
    try:
        write_replacing(path, json.dumps(entry))
    except OSError as err:
        log.warning("plan cache entry %s not written: %s", path, err)


CLI_OPTIONS = ("batch_size", "devices", "ratios", "allow_replicate_fallback", "data_parallel", "bucket_mb",
               "no_fusion", "zero", "precision", "reduce_dtype", "stages", "micro_batches", "schedule",
               "expert_loads")  # `hetsynth plan` flags


def cli_key(args: Any) -> CacheKey | None:
    """The key of `hetsynth plan` with these arguments; None when the plan is not cached
    (--no-cache, or --measure-ops: measured op times)."""
    from hetsynth.instruction_set.cluster import load_cluster

    if args.no_cache or args.measure_ops:
        return None
    spec = load_cluster(args.cluster)
    spec = spec.first(args.devices) if args.devices is not None else spec
    return ref_key(args.model, spec, {"face": "cli", **{name: getattr(args, name) for name in CLI_OPTIONS}})


__all__ = ["CLI_OPTIONS", "CacheKey", "Cached", "PlanCacheError", "cache_dir", "checked_cache_dir", "cli_key",
           "code_version", "graph_key", "lookup", "model_files", "ref_key", "store", "with_plan"]
