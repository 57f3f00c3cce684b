"""The plan cache (hetsynth.plan_cache): a hit skips capture and search; a changed option,
cluster spec or model source misses; --no-cache plans again; a corrupt entry is planned
again with a warning; an unsafe directory is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import hetsynth
from hetsynth import plan_cache
from hetsynth.cli import main

# multi-process or seconds long: make test runs them, make test-fast does not
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# two devices: the cache is what is tested, and a plan for two is made in about a second
SPEC = ROOT / "configs" / "clusters" / "slow-pair-emulated.toml"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("HETSYNTH_CACHE_DIR", str(directory))
    return directory


class Planned:
    """Counts the captures and searches the CLI runs (a hit runs neither)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import hetsynth.planner.planner as planner_module

        self.captures = self.searches = 0
        import hetsynth.api

        capture, make_plan = hetsynth.api.capture_model, planner_module.make_plan

        def counted_capture(*a: object, **k: object) -> object:
            self.captures += 1
            return capture(*a, **k)

        def counted_search(*a: object, **k: object) -> object:
            self.searches += 1
            return make_plan(*a, **k)

        monkeypatch.setattr(hetsynth.api, "capture_model", counted_capture)  # what hetsynth.plan calls
        monkeypatch.setattr(planner_module, "make_plan", counted_search)


def _plan(tmp_path: Path, *extra: str, model: str = "gpt:tiny", cluster: Path = SPEC) -> int:
    return main(["plan", "--model", model, "--cluster", str(cluster), "-o", str(tmp_path / "plan.json"), *extra])


def test_hit_skips_capture_and_search(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    counted = Planned(monkeypatch)
    assert _plan(tmp_path) == 0
    first = (tmp_path / "plan.json").read_text()
    assert (counted.captures, counted.searches) == (1, 1)
    assert len(list(cache.glob("*.json"))) == 1 and (cache.stat().st_mode & 0o777) == 0o700
    capsys.readouterr()
    assert _plan(tmp_path) == 0
    assert (counted.captures, counted.searches) == (1, 1)
    assert "(cached plan from " in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(first)


def test_changed_option_or_spec_misses(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Planned(monkeypatch)
    assert _plan(tmp_path) == 0
    assert _plan(tmp_path, "--data-parallel") == 0
    assert _plan(tmp_path, "--batch-size", "4") == 0
    assert counted.searches == 3
    spec = tmp_path / "copy.toml"
    spec.write_text(SPEC.read_text())
    assert _plan(tmp_path, cluster=spec) == 0  # same content, another path: a hit
    assert counted.searches == 3
    spec.write_text(SPEC.read_text() + "\n# an edit that changes nothing planned\n")
    assert _plan(tmp_path, cluster=spec) == 0  # the parsed content is the key, not the bytes
    assert counted.searches == 3
    assert _plan(tmp_path, "--no-cache") == 0
    assert counted.searches == 4


def test_changed_model_source_misses(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Planned(monkeypatch)
    source = tmp_path / "mymodel.py"
    helper = tmp_path / "mylayers.py"
    helper.write_text("WIDTH = 16\n")
    source.write_text(
        "import torch\nfrom torch import nn\nimport mylayers\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(mylayers.WIDTH, 8)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).pow(2).mean()\n\n"
        "def make():\n"
        "    return Net(), (torch.randn(8, mylayers.WIDTH),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = f"{source}:make"
    assert _plan(tmp_path, model=ref) == 0
    assert _plan(tmp_path, model=ref) == 0
    assert counted.searches == 1
    source.write_text(source.read_text().replace("nn.Linear(mylayers.WIDTH, 8)", "nn.Linear(mylayers.WIDTH, 4)"))
    assert _plan(tmp_path, model=ref) == 0
    assert counted.searches == 2
    helper.write_text("WIDTH = 16  # the same width, another file\n")
    assert _plan(tmp_path, model=ref) == 0  # a helper module the factory imported changed: planned again
    assert counted.searches == 3


def test_corrupt_entry_is_planned_again(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    counted = Planned(monkeypatch)
    assert _plan(tmp_path) == 0
    (entry,) = cache.glob("*.json")
    for bad in ('{"format": 2, "key"', '[]', json.dumps({**json.loads(entry.read_text()), "plan_file": '{"version": 99}'})):
        entry.write_text(bad)
        assert _plan(tmp_path) == 0
        assert "corrupt" in caplog.text
        caplog.clear()
    assert counted.searches == 4
    assert _plan(tmp_path) == 0  # the last re-plan replaced the entry
    assert counted.searches == 4


def test_unsafe_directory_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("HETSYNTH_CACHE_DIR", str(shared))
    assert _plan(tmp_path) == 2
    assert "error: plan cache directory" in capsys.readouterr().err
    assert "writable by other users" in str(pytest.raises(plan_cache.PlanCacheError, plan_cache.checked_cache_dir).value)
    assert _plan(tmp_path, "--no-cache") == 0  # the way out: the cache is not touched
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(own)
    monkeypatch.setenv("HETSYNTH_CACHE_DIR", str(link))
    with pytest.raises(plan_cache.PlanCacheError, match="symbolic link"):
        plan_cache.checked_cache_dir()


def test_planted_entry_link_not_followed(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Planned(monkeypatch)
    assert _plan(tmp_path) == 0
    (entry,) = cache.glob("*.json")
    target = tmp_path / "elsewhere.json"
    target.write_text(entry.read_text())
    entry.unlink()
    os.symlink(target, entry)
    assert _plan(tmp_path) == 0  # read with O_NOFOLLOW: planned again, and the link replaced
    assert counted.searches == 2 and not entry.is_symlink()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).pow(2).mean()


def test_api_caches_refs_and_modules(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Planned(monkeypatch)
    first = hetsynth.plan("gpt:tiny", cluster=str(SPEC), cache=True)
    assert hetsynth.plan("gpt:tiny", cluster=str(SPEC), cache=True) == first
    assert (counted.captures, counted.searches) == (1, 1)
    inputs = (torch.randn(8, 16),)
    made = hetsynth.plan(_Tiny(), inputs, cluster=str(SPEC), cache=True)
    assert hetsynth.plan(_Tiny(), inputs, cluster=str(SPEC), cache=True) == made  # keyed after capture
    assert counted.searches == 2
    hetsynth.plan(_Tiny(), inputs, cluster=str(SPEC))
    assert counted.searches == 3  # cache=False (the default) plans


def test_unusable_directory_plans_without_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HETSYNTH_CACHE_DIR", str(blocker / "plans"))  # its parent cannot be made
    assert _plan(tmp_path) == 0
    assert "planning without the cache" in caplog.text


def test_a_hit_writes_the_same_file_and_summary_without_torch(cache: Path, tmp_path: Path) -> None:
    """A second `hetsynth plan` of the same inputs writes the same bytes and prints the same
    summary as the first, without importing torch (a fresh interpreter: measured 0.24 s for the
    Llama-3-8B shape on hap-paper.toml, whose first plan takes 45-50 s)."""
    import subprocess
    import sys

    args = ["plan", "--model", "gpt:tiny", "--cluster", str(SPEC)]
    script = ("import sys; from hetsynth.cli import main; rc = main(sys.argv[1:]); "
              "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    runs = [subprocess.run([sys.executable, "-c", script, *args, "-o", str(tmp_path / f"plan{i}.json")],
                           capture_output=True, text=True, timeout=300, env=os.environ | {"HETSYNTH_CACHE_DIR": str(cache)})
            for i in (1, 2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert "torch imported" in runs[0].stdout and "no torch" in runs[1].stdout, runs[1].stdout
    assert (tmp_path / "plan1.json").read_bytes() == (tmp_path / "plan2.json").read_bytes()
    first, second = (r.stdout.split("\nwrote ")[0] for r in runs)
    assert "(cached plan from" in second and second.split("\n(cached plan from")[0] == first.rstrip("\n"), (first, second)
