"""The generated references are current: docs/cli.md (docs/make_cli_reference.py), bench/README.md
and README.md's headline block (bench/make_readme.py); and the generator renders what a result
file holds, with its meta. Fast: no process is started but git's (bench.common.meta)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "run `.venv/bin/python {}` to regenerate"


def _load(relative: str) -> ModuleType:
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def readme_gen() -> ModuleType:
    return _load("bench/make_readme.py")


def test_cli_reference_is_current() -> None:
    cli = _load("docs/make_cli_reference.py")
    diff = cli.check()
    assert not diff, "docs/cli.md is stale; " + REGENERATE.format("docs/make_cli_reference.py") + "\n" + "\n".join(diff[:60])


def test_cli_reference_covers_every_subcommand() -> None:
    from hetsynth.cli import COMMANDS

    text = (ROOT / "docs" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"### `hetsynth {name}`" in text
    assert "`hetsynth.runtime.compare`" in text and "/work/" not in text


def test_bench_readme_is_current(readme_gen: ModuleType) -> None:
    problems = readme_gen.check_readme()
    assert not problems, REGENERATE.format("bench/make_readme.py") + "\n" + "\n".join(problems[:60])


def test_readme_headline_block_is_current(readme_gen: ModuleType) -> None:
    if not readme_gen.has_headline_block():
        pytest.skip("README.md has no <!-- headline-results:begin/end --> block yet")
    problems = readme_gen.check_headline()
    assert not problems, REGENERATE.format("bench/make_readme.py") + "\n" + "\n".join(problems[:60])


FAKE_SPEEDUP = {
    "models": {"gpt": {"hetsynth_s": 0.5, "ddp_ev_s": 1.0, "ddp_cp_s": 0.8, "dp_ev_s": 0.9, "dp_cp_s": 0.75,
                       "best_baseline": "DP-CP", "predicted_s": 0.55, "predicted_dp_ev_s": 0.9}},
    "cluster": "configs/clusters/local-emulated.toml", "measured_spec": "bench/results/local-emulated-measured.toml",
    "meta": {"command": "python bench/measured_speedup.py --rounds 8", "date": "2031-02-03T04:05:06+00:00",
             "machine": {"cpu": "Fake CPU 9000", "logical_cores": 7, "memory_gib": 12.5, "gpu": "none",
                         "torch": "9.9.9"},
             "commit": {"hash": "0123456789abcdef0123456789abcdef01234567", "dirty": True}},
}

FAKE_DDP = {
    "model": "gpt:small-cpu", "rounds": 8, "steps": 2,
    "runs": [{"local": {"hetsynth_s": 0.3, "ddp_s": 0.3, "one_bucket_s": 0.31, "parallelize_s": 0.3, "ratio": r,
                        "parallelize_ratio": 1.0, "phases": {}, "devices": 2}} for r in (1.01, 1.05, 0.99)],
    "summary": {"local": {"ratio": {"median": 1.01, "min": 0.99, "max": 1.05},
                          "parallelize_ratio": {"median": 1.0, "min": 1.0, "max": 1.0}}},
}


def test_a_result_renders_as_a_table_with_its_meta(tmp_path: Path, readme_gen: ModuleType) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "measured_speedup.json").write_text(json.dumps(FAKE_SPEEDUP))
    (results / "ddp_overhead.json").write_text(json.dumps(FAKE_DDP))  # no meta: said so, not invented
    text = readme_gen.render_readme(results)
    # only the sections whose results exist, each with its table built from the figures
    assert '<a id="measured-speedup"></a>' in text and '<a id="pipeline"></a>' not in text
    assert "| gpt | 0.500 | 1.000 | 0.800 | 0.900 | 0.750 | 2.00x | 1.60x | 1.50x (DP-CP) | 0.550 | +10.0% |" in text
    assert "`python bench/measured_speedup.py --rounds 8`" in text
    assert "2031-02-03T04:05:06Z" in text and "`0123456789` with uncommitted changes" in text
    assert "Fake CPU 9000, 7 logical cores, 12.5 GiB memory, GPU: none, torch 9.9.9" in text
    assert "`bench/results/ddp_overhead.json` has no meta" in text
    assert "| local (2 ranks) | hetsynth / torch DDP | 1.010x | 0.990x-1.050x | 3 runs |" in text

    # the headline: only the text between the markers changes, and check() then finds nothing stale
    readme, output = tmp_path / "README.md", tmp_path / "bench-README.md"
    readme.write_text(f"# title\n\nbefore\n{readme_gen.BEGIN}\nold\n{readme_gen.END}\nafter\n")
    assert readme_gen.check_headline(results, readme)  # stale
    readme_gen.write(results, output, readme)
    new = readme.read_text()
    assert new.startswith(f"# title\n\nbefore\n{readme_gen.BEGIN}\n") and new.endswith(f"\n{readme_gen.END}\nafter\n")
    assert "old" not in new and "| 1.010x | 0.990x-1.050x | 3 runs |" in new and "| 2.00x | - | 1 run |" not in new
    assert "best data-parallel baseline (DP-CP) / hetsynth (step time) | 1.50x | - | 1 run |" in new
    assert readme_gen.check(results, output, readme) == []

    # a changed figure makes both stale, and the check says where
    FAKE = json.loads(json.dumps(FAKE_SPEEDUP))
    FAKE["models"]["gpt"]["hetsynth_s"] = 0.25
    (results / "measured_speedup.json").write_text(json.dumps(FAKE))
    problems = readme_gen.check(results, output, readme)
    assert any("is stale" in p for p in problems) and any("headline block is stale" in p for p in problems)
    assert any(p.startswith("+") and "| gpt | 0.250 |" in p for p in problems)


def test_a_missing_headline_block_is_reported_and_skipped(tmp_path: Path, readme_gen: ModuleType) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "ddp_overhead.json").write_text(json.dumps(FAKE_DDP))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    assert any("no headline block" in p for p in readme_gen.check_headline(results, readme))
    done = readme_gen.write(results, tmp_path / "bench-README.md", readme)
    assert any("skipped the headline" in line for line in done)
    assert readme.read_text() == "# no markers here\n"


def test_write_json_records_meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        common = _load("bench/common.py")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "memory_bound.py"), "--runs", "3"])
    path = common.write_json("fake.json", {"figure": 1.5, "meta": "replaced"})
    data = json.loads(path.read_text())
    assert data["figure"] == 1.5
    meta = data["meta"]
    assert meta["command"] == "python bench/memory_bound.py --runs 3"
    assert meta["date"].endswith("+00:00")
    assert set(meta["machine"]) == {"cpu", "logical_cores", "memory_gib", "gpu", "torch"}
    assert len(meta["commit"]["hash"]) == 40 or meta["commit"]["hash"] == "unknown"


def test_speedups_of_several_runs_show_their_ranges(tmp_path: Path, readme_gen: ModuleType) -> None:
    """measured_speedup.json of three runs: the table and the headline give each ratio's median
    and range, and the run count."""
    ratio = {"median": 1.5, "min": 1.4, "max": 1.7}
    gpt = FAKE_SPEEDUP["models"]["gpt"] | {"runs": 3, "ratios": {
        "vs_ddp_ev": ratio, "vs_ddp_cp": ratio, "vs_best_baseline": ratio,
        "prediction_error": {"median": 0.1, "min": -0.05, "max": 0.2}}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "measured_speedup.json").write_text(json.dumps(FAKE_SPEEDUP | {"runs": [{}, {}, {}],
                                                                              "models": {"gpt": gpt}}))
    text = readme_gen.render_readme(results)
    assert ("| gpt | 0.500 | 1.000 | 0.800 | 0.900 | 0.750 | 1.50x (1.40x to 1.70x) | 1.50x (1.40x to 1.70x) | "
            "1.50x (1.40x to 1.70x) (DP-CP) | 0.550 | +10.0% (-5.0% to +20.0%) |") in text
    assert "3 runs, each planning and measuring anew" in text
    (row,) = readme_gen.headline_rows(results)
    assert row[1:4] == ["1.50x", "1.40x-1.70x", "3 runs"]
