"""Pipeline schedules as data: the per-stage action lists and the dry run that checks them.

A pipeline of S stages runs M micro-batches per step. Each stage s (0-based) runs one action
list; every rank of the stage runs the same list (its forward F(m) and backward B(m) are SPMD
programs on the stage's sub-mesh). Boundary tensors move between stages by point-to-point
transfers named by the list:

  RECV_F(m, b)   wait for micro-batch m's boundary tensor b from its producing stage (before F(m))
  F(m)           forward of micro-batch m on this stage
  SEND_F(m, b)   post the send of b to its consuming stage (non-blocking)
  RECV_B(m, b)   wait for the gradient of b from its consuming stage (before B(m))
  B(m)           backward of micro-batch m
  SEND_B(m, b)   post the send of b's input gradient back to its producing stage

Compute orders (warm-up counts as in Zhuang et al., MLSys'23, counted per our 0-based stages):
  gpipe       F0 .. F(M-1), B0 .. B(M-1)
  1f1b        w = min(M, S-1-s) warm-up forwards, then F(w+j) B(j) for j < M-w, then the rest of B
  eager_1f1b  the same with w = min(M, 2(S-1-s)): each activation is sent while the next stage is
              still busy with an earlier backward, so the transfer leaves the critical path
The issue's "min(M, 2(S-i)-1) warm-up forwards" counts the forwards before the first backward,
which is w + 1 here; the peak number of micro-batches in flight on stage s is `in_flight`.

The dry run (`check_actions`, after torch.distributed.pipelining's action lists and its comms
simulator; nothing is copied) plays the lists with blocking F/B/RECV and non-blocking SEND, FIFO
per boundary and direction, and raises `ScheduleError` naming the stuck stages and what each
waits for, before anything runs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Sequence

from pydantic import BaseModel, ConfigDict


class ScheduleError(ValueError):
    """An action list that cannot run: malformed, or deadlocked (the message names the stages)."""


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    EAGER_1F1B = "eager_1f1b"


class ActionOp(StrEnum):
    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Action(_Frozen):
    op: ActionOp
    micro_batch: int
    boundary: int | None = None  # index into the pipeline's boundaries (SEND/RECV only)

    def __str__(self) -> str:
        where = f" boundary {self.boundary}" if self.boundary is not None else ""
        return f"{self.op.value} mb {self.micro_batch}{where}"


class Link(_Frozen):
    """The two ends of a boundary: the stage producing the tensor and the stage consuming it."""

    src: int
    dst: int


def warmup(schedule: Schedule, num_stages: int, stage: int, num_micro: int) -> int:
    """Forwards stage `stage` runs before its steady state (module docstring)."""
    if schedule is Schedule.GPIPE:
        return num_micro
    depth = num_stages - 1 - stage
    return min(num_micro, depth if schedule is Schedule.ONE_F_ONE_B else 2 * depth)


def compute_order(schedule: Schedule, num_stages: int, stage: int, num_micro: int) -> list[tuple[ActionOp, int]]:
    """The stage's F and B actions in order."""
    w = warmup(schedule, num_stages, stage, num_micro)
    order = [(ActionOp.F, m) for m in range(w)]
    for j in range(num_micro - w):
        order += [(ActionOp.F, w + j), (ActionOp.B, j)]
    return order + [(ActionOp.B, m) for m in range(num_micro - w, num_micro)]


def in_flight(schedule: Schedule, num_stages: int, stage: int, num_micro: int) -> int:
    """Peak micro-batches whose forward is done and backward is not (saved activations)."""
    peak = live = 0
    for op, _ in compute_order(schedule, num_stages, stage, num_micro):
        live += 1 if op is ActionOp.F else -1
        peak = max(peak, live)
    return peak


def stage_actions(order: Sequence[tuple[ActionOp, int]], stage: int, links: Sequence[Link]) -> tuple[Action, ...]:
    """F/B order with the receives before and the sends after each compute action."""
    incoming = [b for b, link in enumerate(links) if link.dst == stage]
    outgoing = [b for b, link in enumerate(links) if link.src == stage]
    out: list[Action] = []
    for op, m in order:
        recv, send = (incoming, outgoing) if op is ActionOp.F else (outgoing, incoming)
        recv_op, send_op = (ActionOp.RECV_F, ActionOp.SEND_F) if op is ActionOp.F else (ActionOp.RECV_B, ActionOp.SEND_B)
        out += [Action(op=recv_op, micro_batch=m, boundary=b) for b in recv]
        out.append(Action(op=op, micro_batch=m))
        out += [Action(op=send_op, micro_batch=m, boundary=b) for b in send]
    return tuple(out)


def build_actions(schedule: Schedule, num_micro: int, links: Sequence[Link],
                  num_stages: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's action list."""
    return tuple(stage_actions(compute_order(schedule, num_stages, s, num_micro), s, links)
                 for s in range(num_stages))


# -- the dry run ----------------------------------------------------------------------------------

_MATCH = {ActionOp.RECV_F: ActionOp.SEND_F, ActionOp.RECV_B: ActionOp.SEND_B}


def check_form(actions: Sequence[Sequence[Action]], links: Sequence[Link], num_micro: int) -> None:
    """One F and one B per micro-batch on every stage, F(m) before B(m); each boundary's sends
    and receives in increasing micro-batch order (a channel is FIFO) and only on its ends."""
    for s, acts in enumerate(actions):
        seen: dict[ActionOp, list[int]] = {}
        for i, a in enumerate(acts):
            if a.boundary is not None:
                _check_end(s, i, a, links)
            if a.op is ActionOp.B and a.micro_batch not in seen.get(ActionOp.F, []):
                raise ScheduleError(f"stage {s} action {i} ({a}) comes before F mb {a.micro_batch}")
            seen.setdefault(a.op, []).append(a.micro_batch)
        for op in (ActionOp.F, ActionOp.B):
            if sorted(seen.get(op, [])) != list(range(num_micro)):
                raise ScheduleError(f"stage {s} runs {op.value} for micro-batches {seen.get(op, [])}; "
                                    f"it must run each of 0..{num_micro - 1} once")
        _check_fifo(s, acts)


def _check_end(s: int, i: int, a: Action, links: Sequence[Link]) -> None:
    if not 0 <= a.boundary < len(links):
        raise ScheduleError(f"stage {s} action {i} ({a}): no boundary {a.boundary} ({len(links)} boundaries)")
    link = links[a.boundary]
    end = link.src if a.op in (ActionOp.SEND_F, ActionOp.RECV_B) else link.dst
    if end != s:
        raise ScheduleError(f"stage {s} action {i} ({a}): boundary {a.boundary} runs from stage {link.src} to "
                            f"stage {link.dst}; this action belongs on stage {end}")


def _check_fifo(s: int, acts: Sequence[Action]) -> None:
    last: dict[tuple[ActionOp, int], int] = {}
    for i, a in enumerate(acts):
        if a.boundary is None:
            continue
        key = (a.op, a.boundary)
        if a.micro_batch <= last.get(key, -1):
            raise ScheduleError(f"stage {s} action {i} ({a}) after mb {last[key]}: a boundary's transfers run "
                                f"in increasing micro-batch order")
        last[key] = a.micro_batch


def check_actions(actions: Sequence[Sequence[Action]], links: Sequence[Link], num_micro: int) -> None:
    """The dry run (module docstring): raises ScheduleError unless every list runs to its end."""
    check_form(actions, links, num_micro)
    pos, sent = [0] * len(actions), set()
    moved = True
    while moved:
        moved = False
        for s, acts in enumerate(actions):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                if a.op in _MATCH and (_MATCH[a.op], a.boundary, a.micro_batch) not in sent:
                    break
                if a.op in (ActionOp.SEND_F, ActionOp.SEND_B):
                    sent.add((a.op, a.boundary, a.micro_batch))
                pos[s], moved = pos[s] + 1, True
    stuck = [s for s, acts in enumerate(actions) if pos[s] < len(acts)]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(_waiting(s, pos[s], actions[s][pos[s]], links, pos, actions)
                                                     for s in stuck))


def _waiting(s: int, i: int, a: Action, links: Sequence[Link], pos: list[int],
             actions: Sequence[Sequence[Action]]) -> str:
    link = links[a.boundary]
    peer = link.src if a.op is ActionOp.RECV_F else link.dst
    at = actions[peer][pos[peer]] if pos[peer] < len(actions[peer]) else None
    where = f"action {pos[peer]} ({at})" if at is not None else "its end"
    what = "activation" if a.op is ActionOp.RECV_F else "gradient"
    return (f"stage {s} is at action {i} ({a}) waiting for the {what} of boundary {a.boundary} mb "
            f"{a.micro_batch} from stage {peer}, which is at {where}")
