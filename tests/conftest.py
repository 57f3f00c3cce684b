"""Session-scoped pools of spawned gloo ranks (world sizes 2 and 4), shared by the tests that
need real collectives; each is started on first use and closed at the end of the session."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from hetsynth.runtime.pool import RankPool


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size, timeout_s=60)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


# The modules that take a minute or more of a worker's time (measured, make test on 2 cores), in
# that order: under pytest-xdist's --dist loadscope each module goes to one worker in the order
# collected, and the longest going first lets the workers finish together (longest processing
# time first). Only the order changes; a module not named keeps its place after these.
LONGEST_FIRST = ("test_docs", "test_launch", "test_launch_train", "test_pipeline_run", "test_integrity",
                 "test_families", "test_faults", "test_mixed_precision_run", "test_examples", "test_parity",
                 "test_plan_cache", "test_rules_property", "test_launch_script", "test_pipeline_parity",
                 "test_two_level", "test_state_dir", "test_zero_length")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the spawned rank pools is a multi-process test: marked slow (make test-fast
    leaves it out), as are the modules that launch ranks themselves (their own pytestmark).
    The modules of LONGEST_FIRST run first, each module's tests in their own order."""
    for item in items:
        if "pools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _state_dir_of_this_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, each worker's runs are recorded in a state directory of its own: every
    hetsynth command removes what dead runs of its state directory left, and a test that kills
    a launcher expects its own next command to be the one that cleans up."""
    if "PYTEST_XDIST_WORKER" not in os.environ or "HETSYNTH_STATE_DIR" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HETSYNTH_STATE_DIR", str(tmp_path_factory.mktemp("state") / "runs"))
        yield


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    p = Pools()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test plans into an empty plan cache of its own (hetsynth.plan_cache): a plan cached by
    another test, or by a user of this machine, never answers for a test's own planning."""
    monkeypatch.setenv("HETSYNTH_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache") / "plans"))
