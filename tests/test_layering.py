"""Imports point down (tests/layering.py): none runs back up, no files import in a circle, and
the check catches an upward import or a cycle added to a scratch copy of the packages."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from layering import PACKAGES, import_cycles, upward_imports

ROOT = Path(__file__).resolve().parents[1]


def test_no_upward_imports() -> None:
    found = upward_imports(ROOT)
    assert found == [], "\n".join(found)


@pytest.mark.slow
def test_no_import_cycles() -> None:
    found = import_cycles(ROOT)
    assert found == [], "\n".join(found)


def _scratch(tmp_path: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: Path, text: str) -> int:
    """Append `text` (whose last line is the import) and return that line's number."""
    body = path.read_text().rstrip("\n") + "\n\n\n" + text + "\n"
    path.write_text(body)
    return body.count("\n")


@pytest.mark.parametrize(("file", "text", "package", "module", "allowed"), [
    ("instruction_set/layouts.py", "def _late():\n    from hetsynth import plan", "instruction_set",
     "hetsynth", "nothing of the project"),
    ("runtime/train.py", "def _late():\n    from hetsynth.planner import baselines", "runtime", "planner",
     "instruction_set"),
    ("cost_models/comm.py", "import hetsynth.runtime.groups", "cost_models", "runtime.groups", "instruction_set"),
])
@pytest.mark.slow
def test_upward_import_in_a_scratch_copy_fails(tmp_path: Path, file: str, text: str, package: str,
                                               module: str, allowed: str) -> None:
    root = _scratch(tmp_path)
    before = set(upward_imports(root))
    line = _append(root / file, text)
    new = sorted(set(upward_imports(root)) - before)
    assert len(new) == 1, new
    assert new[0].startswith(f"{file}:{line}: {package} imports {module}; ")
    assert f"may import only {allowed}" in new[0] and "rule: " in new[0]


def test_cycle_in_a_scratch_copy_fails(tmp_path: Path) -> None:
    """plan.py imports graph.py; graph.py importing plan (inside a function) closes a circle."""
    root = _scratch(tmp_path)
    line = _append(root / "instruction_set/graph.py", "def _late():\n    from hetsynth.instruction_set import plan")
    found = import_cycles(root)
    assert len(found) == 1, found
    assert f"instruction_set/graph.py:{line}" in found[0] and "instruction_set/plan.py:" in found[0]
