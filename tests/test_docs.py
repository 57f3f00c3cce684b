"""The documentation's code runs: every fenced block of README.md and docs/*.md, in order.

Conventions of the info string (the text after the opening fence):

- ```bash, ```sh: run as one `bash -e` script; exit status 0 expected.
- ```python: run with this venv's python; exit status 0 expected.
- `file=NAME` (```python file=train.py): not run, written to NAME, for the blocks after it
  (a script the tutorial then launches).
- `long`, anywhere in it (```bash long): not run (`make demo`, `make test`, benchmarks,
  anything over about 30 s). The test lists them as skipped.
- `tested-in=PAGE` (```python tested-in=docs/getting-started.md): not run here; the same code
  runs on PAGE (tests/test_docs_reference.py checks that PAGE holds it verbatim), so that the
  README can show a tutorial's core without running it twice.
- any other language (```text, ```toml, none): output or data, not run.

Every document runs in a scratch directory of its own, its blocks in order and sharing it,
with `configs/` and `examples/` linked from the repository (so `configs/clusters/...` is as
written), `.venv/bin` first on PATH and a plan cache of the test's own. A block after a failed
one of the same document is skipped (it would fail for the first one's reason). Documents run
two at a time: the emulated ranks spend most of their time below their CPU quotas.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
RUN = {"bash", "sh", "python"}
BLOCK_TIMEOUT_S = 480  # a block under a heavily loaded machine; idle, none takes two minutes
SETUP_TIMEOUT_S = 900  # all documents; about 3 minutes on an idle 2-core machine, more on a busy one


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    flags: set[str]
    file: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return (self.lang in RUN and "long" not in self.flags and self.file is None
                and not any(f.startswith("tested-in=") for f in self.flags))


@dataclass
class Outcome:
    returncode: int | None = None  # None: not run
    output: str = ""
    seconds: float = 0.0
    reason: str = ""


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = []
    for m in FENCE.finditer(text):
        words = m.group(1).split()
        lang = words[0] if words else ""
        files = [w.removeprefix("file=") for w in words[1:] if w.startswith("file=")]
        found.append(Block(doc, text.count("\n", 0, m.start()) + 1, lang, set(words[1:]),
                           files[0] if files else None, m.group(2)))
    return found


def scratch(base: Path) -> Path:
    base.mkdir(parents=True)
    for name in ("configs", "examples"):
        (base / name).symlink_to(ROOT / name)
    return base


def environment(cache: Path) -> dict[str, str]:
    venv_bin = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
               HETSYNTH_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> Outcome:
    if block.lang == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    start = time.perf_counter()
    # a session of its own, so that a block that hangs is stopped with everything it started
    # (SIGTERM first: hetsynth's launcher then removes its ranks and emulated cluster itself)
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        output = f"timed out after {BLOCK_TIMEOUT_S} s\n{stop(proc)}"
        return Outcome(-1, output, time.perf_counter() - start)
    return Outcome(proc.returncode, output, time.perf_counter() - start)


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM to the block's process group, SIGKILL after 30 s; what it printed."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=wait_s)[0]
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()[0]


def run_doc(doc: Path, cwd: Path, env: dict[str, str]) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    failed = ""
    for block in blocks(doc):
        if block.file is not None:
            (cwd / block.file).write_text(block.code)
        if not block.runs:
            continue
        if failed:
            outcomes[block.name] = Outcome(reason=f"not run: {failed} failed before it")
            continue
        outcomes[block.name] = outcome = run_block(block, cwd, env)
        if outcome.returncode != 0:
            failed = block.name
    return outcomes


def cost(doc: Path) -> int:
    """A rough guess of a document's run time: launched ranks dominate."""
    code = "".join(b.code for b in blocks(doc) if b.runs)
    return 10 * (code.count("hetsynth launch") + code.count("hetsynth run")) + code.count("\n")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    base = tmp_path_factory.mktemp("docs")
    env = environment(base / "plan-cache")
    # the costliest documents first, so that the two workers finish together
    docs = sorted((d for d in DOCS if any(b.runs for b in blocks(d))), key=cost, reverse=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_doc, d, scratch(base / d.stem), env) for d in docs]
        results = [f.result() for f in futures]
    return {name: outcome for result in results for name, outcome in result.items()}


ALL_BLOCKS = [b for d in DOCS for b in blocks(d) if b.lang in RUN and b.file is None]


@pytest.mark.timeout(SETUP_TIMEOUT_S)  # the first block's test also runs every document (the fixture)
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.name for b in ALL_BLOCKS])
def test_block_runs(block: Block, outcomes: dict[str, Outcome]) -> None:
    if "long" in block.flags:
        pytest.skip("marked long")
    if not block.runs:
        pytest.skip("runs on the page its tested-in= names")
    outcome = outcomes[block.name]
    if outcome.returncode is None:
        pytest.skip(outcome.reason)
    assert outcome.returncode == 0, (f"{block.name} exited {outcome.returncode} after {outcome.seconds:.0f} s:\n"
                                     f"{block.code}\n---\n{outcome.output[-4000:]}")


def test_docs_have_blocks_that_run() -> None:
    """The harness sees the blocks (a changed fence syntax would silently test nothing)."""
    assert sum(b.runs for b in ALL_BLOCKS) >= 3, [b.name for b in ALL_BLOCKS]
