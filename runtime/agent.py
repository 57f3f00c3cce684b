"""One node's torchrun agent, as the launcher starts it (`python -m runtime.agent ... -- <torchrun args>`).

It is torchrun (`torch.distributed.run.run`, in this process), with three differences:

- It dies with the launcher: PR_SET_PDEATHSIG sends it SIGTERM when the launcher goes away
  (SIGKILL included), and torchrun then stops its workers; nothing trains on unseen.
- `--failures FILE`: when a worker fails, the failures torchrun saw are written to FILE as
  JSON, `{global rank: {"exitcode": n, "signal": "SIGKILL" | null}}`, and the agent exits 1
  without torchrun's ChildFailedError traceback (the launcher names the failed rank with the
  rank's own message, runtime.heartbeat).
- `--hold-store`: node 0's agent hosts the rendezvous store, and keeps it after its own
  workers are done, until the launcher closes this agent's stdin. torchrun's exit barrier
  (`_exit_barrier`, one store barrier over the agents) lets the agent that arrives last set
  the barrier key and then wait on it; node 0's agent, woken by that key, used to return and
  exit, taking the store down while the last agent's wait was still in flight: that agent
  logged "Error waiting on exit barrier ... DistNetworkError" with a traceback, in 5-6 of 27
  successful runs. The store here is created first, `multi_tenant` (torchrun's own static
  rendezvous store on the same port shares its server), so it outlives every other agent.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent exits (and at once if it already has)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def hold_store(args: argparse.Namespace):
    """The rendezvous store's server, created before torchrun's (which then shares it)."""
    from torch.distributed import TCPStore

    return TCPStore(args.master_addr, args.master_port, None, True, datetime.timedelta(seconds=600),
                    wait_for_workers=False, multi_tenant=True)


def write_failures(path: str, failures: dict) -> None:
    with open(path, "w") as f:
        json.dump({rank: {"exitcode": fail.exitcode, "signal": fail.signal_name() if fail.exitcode < 0 else None}
                   for rank, fail in failures.items()}, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="runtime.agent")
    p.add_argument("--parent", type=int, required=True, help="the launcher's pid")
    p.add_argument("--failures", required=True, help="write the workers' failures here (JSON)")
    p.add_argument("--hold-store", action="store_true", help="host the rendezvous store until stdin closes")
    p.add_argument("torchrun", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    args = p.parse_args(argv)
    die_with_parent(args.parent)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun = parse_args(args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun)
    store = hold_store(torchrun) if args.hold_store else None
    try:
        run(torchrun)
        if store is not None:
            sys.stdin.read()  # until the launcher closes it: every other agent has left
    except ChildFailedError as err:
        write_failures(args.failures, err.failures)
        return 1
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
