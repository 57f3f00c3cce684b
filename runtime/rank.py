"""The life of one rank under torchrun, shared by every worker entry point (training, the
profiler, the plan comparison, the collectives benchmark).

`run_rank(body, timeout_s=...)`: die with this rank's agent (PR_SET_PDEATHSIG SIGKILL, so a
stopped rank of a killed launcher goes too: runtime.agent), start this rank's heartbeat
(runtime.heartbeat: a status file the launcher watches), join this rank's emulated device
when there is one (runtime.emulation), one torch thread per OMP_NUM_THREADS, create the
default process group (NCCL on a GPU, gloo on CPU) with the collective timeout, run
`body(rank, device)`, leave the emulated device (its quota is for the work), then a barrier
and teardown. Logging prints with the rank in front
(runtime.logs). Any exception logs `rank N failed: <type>: <message>` on stderr and goes
into the status file (the launcher's failure line carries it; HETSYNTH_DEBUG=1 adds the
traceback) and the exit status is 1, so the other ranks fail their next collective within
the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Callable

import torch
import torch.distributed as dist

from hetsynth.runtime.emulation import join_device, leave_device
from hetsynth.runtime.heartbeat import Heartbeat
from hetsynth.runtime.logs import configure_rank_logging
from hetsynth.runtime.parent import die_with_agent

log = logging.getLogger(__name__)


def rank_device() -> torch.device:
    """This rank's GPU (by LOCAL_RANK) when there is one, else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run_rank(body: Callable[[int, torch.device], None], *, timeout_s: float,
             device: torch.device | None = None) -> int:
    """Run `body` on this rank (see the module docstring); returns the exit status.
    `device` overrides rank_device() (the CPU-only tools)."""
    die_with_agent()
    rank = int(os.environ.get("RANK", "0"))
    configure_rank_logging(rank)
    beat = Heartbeat(rank).start()
    try:
        join_device()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = device or rank_device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        body(rank, device)
        leave_device()
        dist.barrier()
        dist.destroy_process_group()
        beat.finish("done")
        return 0
    except Exception as err:  # name the failed rank, exit non-zero
        message = f"{type(err).__name__}: {err}"
        beat.finish("failed", message)
        log.error("failed: %s", message, exc_info=bool(os.environ.get("HETSYNTH_DEBUG")))
        return 1
