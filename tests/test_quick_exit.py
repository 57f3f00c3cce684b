"""runtime.quick_exit: the exit's gc.freeze() runs after the process's own atexit handlers."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, gc
from hetsynth.runtime.quick_exit import freeze_at_exit
freeze_at_exit()
atexit.register(lambda: print("handler saw frozen", gc.get_freeze_count()))
atexit._run_exitfuncs()
print("after exit handlers frozen", gc.get_freeze_count() > 0)
"""


def test_freeze_runs_after_the_handlers_registered_later() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["handler saw frozen 0", "after exit handlers frozen True"], out.stdout
