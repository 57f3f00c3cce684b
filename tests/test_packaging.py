"""One installed top-level name: the repository's folders planner/, runtime/ ... install as
hetsynth.planner, hetsynth.runtime ... (pyproject's package-dir), so that installing hetsynth
adds `hetsynth` alone to the importable names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("hetsynth", "instruction_set", "cost_models", "planner", "runtime", "profiling")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _installed_name(folder: Path) -> str:
    parts = folder.relative_to(ROOT).parts
    return ".".join(parts if parts[0] == "hetsynth" else ("hetsynth", *parts))


def test_every_package_folder_is_listed() -> None:
    """A new folder with an __init__.py that pyproject does not list would be left out of the
    wheel (its imports then fail only once installed)."""
    found = sorted(_installed_name(p.parent) for top in FOLDERS for p in (ROOT / top).rglob("__init__.py")
                   if "__pycache__" not in p.parts)
    assert sorted(_setuptools()["packages"]) == found


def test_package_dirs_map_each_folder_under_hetsynth() -> None:
    dirs = _setuptools()["package-dir"]
    assert dirs == {"hetsynth": "hetsynth", **{f"hetsynth.{f}": f for f in FOLDERS[1:]}}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("hetsynth-*.whl")
    return path


@pytest.mark.slow  # builds a wheel with pip
def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        assert {t for t in tops if not t.endswith(".dist-info")} == {"hetsynth"}
        assert "hetsynth/runtime/worker.py" in z.namelist()
        assert "hetsynth/instruction_set/rules/__init__.py" in z.namelist()


@pytest.mark.slow
def test_installed_wheel_imports_under_hetsynth_only(wheel: Path, tmp_path: Path) -> None:
    """Installed (not the checkout): hetsynth and its subpackages import from the install,
    the torchrun worker module is there, and `import runtime` fails."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    code = (f"import sys; sys.path.insert(0, {str(target)!r})\n"
            "import importlib.util, hetsynth, hetsynth.runtime.worker, hetsynth.planner.planner\n"
            f"assert hetsynth.__file__.startswith({str(target)!r}), hetsynth.__file__\n"
            f"assert hetsynth.runtime.worker.__file__.startswith({str(target)!r})\n"
            "for name in ('runtime', 'planner', 'instruction_set', 'cost_models', 'profiling'):\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "print('ok')\n")
    # -I: no current directory (the checkout) and no PYTHONPATH on sys.path
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
