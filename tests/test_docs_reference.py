"""The reference pages keep up with the code: every field of the cluster spec's models is named
in docs/cluster-spec.md, every public name of `hetsynth` in docs/python-api.md, and every page
docs/index.md lists exists (and every page is listed). Cheap: no process is started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

import hetsynth
from hetsynth.instruction_set import calibration, cluster, matmul_rates

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SPEC_MODELS: list[type[BaseModel]] = [cluster.ClusterSpec, cluster.DeviceKind, cluster.Device, cluster.Node,
                                      cluster.Links, cluster.Emulation, matmul_rates.MatmulRates,
                                      calibration.Calibration, calibration.AlphaBeta]


def mentioned(text: str, name: str) -> bool:
    """`name` in backquotes, alone or as the last part of a dotted or bracketed path."""
    return re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", text) is not None


@pytest.mark.parametrize("model", SPEC_MODELS, ids=lambda m: m.__name__)
def test_cluster_spec_page_names_every_field(model: type[BaseModel]) -> None:
    text = (DOCS / "cluster-spec.md").read_text()
    missing = [f for f in model.model_fields if not mentioned(text, f)]
    assert not missing, f"docs/cluster-spec.md does not name {model.__name__} field(s) {missing}"


def test_cluster_spec_page_names_the_models() -> None:
    text = (DOCS / "cluster-spec.md").read_text()
    assert all(mentioned(text, m.__name__) for m in SPEC_MODELS), [m.__name__ for m in SPEC_MODELS
                                                                     if not mentioned(text, m.__name__)]


def test_python_api_page_names_every_public_name() -> None:
    text = (DOCS / "python-api.md").read_text()
    missing = [n for n in hetsynth.__all__ if not mentioned(text, n)]
    assert not missing, f"docs/python-api.md does not name {missing} (hetsynth.__all__)"


@pytest.mark.parametrize("module", ["data", "checkpoint"])
def test_python_api_page_names_every_submodule_function(module: str) -> None:
    text = (DOCS / "python-api.md").read_text()
    names = getattr(hetsynth, module).__all__
    missing = [n for n in names if not mentioned(text, f"{module}.{n}") and not mentioned(text, n)]
    assert not missing, f"docs/python-api.md does not name hetsynth.{module}'s {missing}"


def test_index_lists_every_page() -> None:
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"
    assert all((DOCS / p).is_file() for p in linked), sorted(p for p in linked if not (DOCS / p).is_file())


def test_readme_is_a_door() -> None:
    """At most 250 lines, and the headline table's markers with nothing typed between them by hand
    (bench's script fills it)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert text.count("<!-- headline-results:begin -->") == 1 and text.count("<!-- headline-results:end -->") == 1


def test_relative_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file or folder that exists."""
    broken = []
    for doc in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def fenced(doc: Path) -> list[tuple[str, str]]:
    """(info string, code) of every fenced block of `doc`."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```\s*$", doc.read_text(), re.MULTILINE | re.DOTALL)


def test_tested_in_blocks_run_where_they_say() -> None:
    """A block marked `tested-in=PAGE` is not run where it stands (tests/test_docs.py): PAGE must
    hold the same code in a block that runs, or is a file the blocks after it run."""
    for doc in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for info, code in fenced(doc):
            page = next((w.removeprefix("tested-in=") for w in info.split() if w.startswith("tested-in=")), None)
            if page is None:
                continue
            there = [(i, c) for i, c in fenced(ROOT / page) if "tested-in=" not in i and "long" not in i.split()]
            assert any(c == code for _, c in there), f"{doc.name}: a tested-in={page} block is not on that page:\n{code}"


def default_text(value: object) -> list[str]:
    """How a default may be written in the page's tables."""
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, float) and value.is_integer():
        return [str(int(value)), f"{int(value):,}"]
    if isinstance(value, int):
        return [str(value), f"{value:,}"]
    return [str(value), f'"{value}"']


@pytest.mark.parametrize("model", SPEC_MODELS, ids=lambda m: m.__name__)
def test_cluster_spec_page_gives_every_default(model: type[BaseModel]) -> None:
    """Every field with a plain default (a number, a bool, a string) has it on its table row."""
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \|(.*)$", (DOCS / "cluster-spec.md").read_text(), re.MULTILINE)}
    wrong = []
    for name, info in model.model_fields.items():
        default = info.default
        if isinstance(default, (bool, int, float, str)) and name in rows:
            if not any(re.search(rf"`?{re.escape(t)}`?", rows[name]) for t in default_text(default) if t):
                wrong.append(f"{name} = {default!r}")
    assert not wrong, f"docs/cluster-spec.md's rows do not give the defaults {wrong}"
