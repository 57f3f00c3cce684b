"""The plan file from the launcher to the ranks: the bytes the launcher validated, no others.

The launcher (runtime.launch) reads the plan file, checks that its bytes are the plan it
validated (`validated_digest`) and puts their sha256 in the ranks' environment, PLAN_ENV
(JSON: {path as the ranks are given it: hex digest}). A rank (`load_rank_plan`) reads the
file once, refuses bytes with another digest (PlanChanged, naming both: a plan swapped
during start-up is never trained) and parses the very bytes it checked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hetsynth.instruction_set.plan import Plan, PlanError, plan_from_json

PLAN_ENV = "HETSYNTH_PLAN_SHA256"
PATH_ENV = "HETSYNTH_PLAN"  # the validated plan file's absolute path, for a rank's own script (hetsynth launch)


class PlanChanged(ValueError):
    """The plan file's bytes are not those the launcher validated."""


def plan_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan_digests(paths: list[str]) -> dict[str, str]:
    """path -> sha256 of the plan files as they are now (runtime.launch.launch's `plans`)."""
    return {path: plan_digest(Path(path).read_bytes()) for path in paths}


def validated_digest(plan: Plan, plan_path: str) -> str:
    """The sha256 of the plan file, whose bytes must still be `plan`, the plan validated
    (PlanChanged otherwise)."""
    data = Path(plan_path).read_bytes()
    try:
        same = plan_from_json(json.loads(data), plan_path) == plan
    except ValueError:
        same = False
    if not same:
        raise PlanChanged(f"plan file {plan_path!r} changed after it was validated (sha256 now "
                          f"{plan_digest(data)}); nothing was trained from it, start the run again")
    return plan_digest(data)


def load_rank_plan(path: str) -> Plan:
    """The plan at `path`, checked against the digest the launcher validated (module
    docstring); a path the launcher gave no digest for is read as it is."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise PlanError(f"plan file {path!r} cannot be read: {err.strerror}") from None
    expected = json.loads(os.environ.get(PLAN_ENV) or "{}").get(path)
    if expected is not None and plan_digest(data) != expected:
        raise PlanChanged(f"plan file {path!r} changed after the launcher validated it: sha256 {plan_digest(data)} "
                          f"now, {expected} validated; nothing was trained from it, start the run again")
    try:
        raw = json.loads(data)
    except ValueError as err:
        raise PlanError(f"{path} is not JSON: {err}") from None
    return plan_from_json(raw, path)
