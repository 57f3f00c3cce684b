"""Processes that die with the process that started them.

The launcher's agents die with the launcher (runtime.agent), and every rank with its agent
(runtime.rank, runtime.script_runner): PR_SET_PDEATHSIG SIGKILL, so that nothing trains on
unseen when the launcher is killed, even a rank stopped by SIGSTOP (a stopped process ignores
SIGTERM until continued). AGENT_ENV names the ranks' parent; `die_with_agent` reads it.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
AGENT_ENV = "HETSYNTH_AGENT_PID"   # the ranks' parent, their agent


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent exits (and at once if `parent` is already gone:
    this process then has another parent)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_agent() -> None:
    """die_with_parent(AGENT_ENV's pid), for a rank; nothing when AGENT_ENV is not set (a rank
    of a torchrun the user started)."""
    agent = os.environ.get(AGENT_ENV)
    if agent:
        die_with_parent(int(agent))
