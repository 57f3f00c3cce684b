"""One node's torchrun agent, as the launcher starts it (`python -m hetsynth.runtime.agent ... -- <torchrun args>`).

It is torchrun (`torch.distributed.run.run`, in this process), with these differences:

- It dies with the launcher: PR_SET_PDEATHSIG sends it SIGKILL when the launcher goes away
  (SIGKILL included), and its workers die with it (runtime.rank: the same, tied to this
  agent's pid, AGENT_ENV); nothing trains on unseen. Not SIGTERM: torchrun would give its
  workers 30 s to stop, and a stopped worker ignores SIGTERM: the agent and that worker would
  outlive the launcher by 30 s.
- `--bind-store`: this agent hosts the rendezvous store, listening on `--master-addr` only
  (loopback for a run on this machine, node 0's address inside an emulated cluster, the
  address the user names in the printed command of node 0 of a multi-node cluster): a
  TCPStore's own server listens on every interface whatever host it is given, and it has no
  authentication. `--master-port 0` takes a free port. The store is created first,
  `multi_tenant`, so torchrun's own static rendezvous store on the same port shares it.
- `--failures FILE`: when a worker fails, the failures torchrun saw are written to FILE as
  JSON, `{global rank: {"exitcode": n, "signal": "SIGKILL" | null}}`, and the agent exits 1
  without torchrun's ChildFailedError traceback (the launcher names the failed rank with the
  rank's own message, runtime.heartbeat).
- `--hold-store`: `--bind-store`, and the store is kept after this agent's own workers are
  done, until the launcher closes this agent's stdin. torchrun's exit barrier
  (`_exit_barrier`, one store barrier over the agents) lets the agent that arrives last set
  the barrier key and then wait on it; node 0's agent, woken by that key, used to return and
  exit, taking the store down while the last agent's wait was still in flight: that agent
  logged "Error waiting on exit barrier ... DistNetworkError" with a traceback, in 5-6 of 27
  successful runs. Created first, the store outlives every other agent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from hetsynth.runtime.quick_exit import freeze_at_exit
from hetsynth.instruction_set.files import write_atomic
from hetsynth.runtime.parent import AGENT_ENV, die_with_parent


def bind_store(args: argparse.Namespace):
    """The rendezvous store's server on `args.master_addr` only, created before torchrun's
    (which then shares it); a port 0 is replaced in `args` by the one taken."""
    import socket

    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in args.master_addr else socket.AF_INET
    sock = socket.create_server((args.master_addr.strip("[]"), args.master_port), family=family, backlog=512)
    args.master_port = sock.getsockname()[1]
    return TCPStore(args.master_addr, args.master_port, None, True, datetime.timedelta(seconds=600),
                    wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())


def write_failures(path: str, failures: dict) -> None:
    write_atomic(path, json.dumps({rank: {"exitcode": fail.exitcode,
                                          "signal": fail.signal_name() if fail.exitcode < 0 else None}
                                   for rank, fail in failures.items()}))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The agent's own flags, and torchrun's after `--` (in `torchrun`)."""
    p = argparse.ArgumentParser(prog="hetsynth.runtime.agent")
    p.add_argument("--parent", type=int, help="the launcher's pid, to die with (none: a node command a user runs)")
    p.add_argument("--failures", help="write the workers' failures here (JSON; none: torchrun reports them)")
    p.add_argument("--bind-store", action="store_true", help="host the rendezvous store on --master-addr only")
    p.add_argument("--hold-store", action="store_true", help="--bind-store, and keep the store until stdin closes")
    p.add_argument("torchrun", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    freeze_at_exit()
    args = parse(argv)
    if args.parent is not None:
        die_with_parent(args.parent)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    torchrun = parse_args(args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun)
    store = bind_store(torchrun) if args.bind_store or args.hold_store else None  # noqa: F841 (kept alive)
    os.environ[AGENT_ENV] = str(os.getpid())
    try:
        run(torchrun)
        if args.hold_store:
            sys.stdin.read()  # until the launcher closes it: every other agent has left
    except ChildFailedError as err:
        if args.failures is None:
            raise
        write_failures(args.failures, err.failures)
        return 1
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
