"""Discrete-event simulation of a pipeline schedule: the predicted step time and timeline.

Semantics (the runtime's, runtime.pipeline):
- A stage is one sequential resource: its ranks run F and B in lockstep (each is an SPMD
  program with its own collectives). F(m) starts when the stage is free and every boundary
  input of m has arrived; B(m) when the stage is free and the gradient of every boundary output
  of m has arrived (on the last stage its own F(m) is enough, the list orders it).
- A SEND is posted when the producing action ends and does not block the stage (the receiver
  posted its receive ahead: runtime.pipeline.transfer). Its transfer starts at max(posting
  time, end of the same boundary and direction's previous transfer: a channel is FIFO, the
  time every resource it needs is free) and takes `seconds[m]`, holding its resources (the
  NICs it crosses, `resources[channel]`: transfers of different boundaries or directions that
  share a NIC queue for it, in the order the simulation posts them). A channel without
  resources only queues behind itself.
- A RECV of micro-batch m waits for its transfer's arrival A. The receiving worker's CPU for
  it (`receive_cpu[channel][m]`, r) is spent while the data comes in: in the wait when the
  stage is idle, beside the stage's compute when it is busy, so

      clock_s <- max(clock_s + r, A)

  (a stage that waits anyway pays nothing for it; one that computes until after A pays all
  of it). What a sender's CPU costs stays in the sending action's time (planner.stage_times).
- Stage s ends at its last action's end plus `sync_s` (its in-stage gradient all-reduce); then
  the all-reduces of parameters several stages hold (`shared_s`, once all stages are done), one
  world all-reduce of [norm^2, loss] (`global_s`) and the slowest stage's `update_s`.

    step = max_s (end_s + sync_s) + shared_s + global_s + max_s update_s

Written here rather than borrowed: torch.distributed.pipelining simulates the order of its
actions, not their times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from hetsynth.instruction_set.schedule import Action, ActionOp, Link, ScheduleError


@dataclass(frozen=True)
class StageTimes:
    forward_s: tuple[float, ...]   # per micro-batch
    backward_s: tuple[float, ...]
    sync_s: float = 0.0
    update_s: float = 0.0


@dataclass(frozen=True)
class TimelineEvent:
    stage: int
    kind: str          # F, B, XFER_F, XFER_B, SYNC
    micro_batch: int
    start_s: float
    end_s: float
    boundary: int | None = None


@dataclass
class Timeline:
    step_time_s: float
    events: list[TimelineEvent] = field(default_factory=list)

    def busy_s(self, stage: int) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.stage == stage and e.kind in ("F", "B"))


class _Sim:
    def __init__(self, actions: Sequence[Sequence[Action]], stages: Sequence[StageTimes], links: Sequence[Link],
                 transfers: Mapping[tuple[int, str], Sequence[float]],
                 resources: Mapping[tuple[int, str], frozenset[Hashable]],
                 receive_cpu: Mapping[tuple[int, str], Sequence[float]]) -> None:
        self.actions, self.stages, self.links, self.transfers = actions, stages, links, transfers
        self.resources, self.receive_cpu = resources, receive_cpu
        self.resource_free: dict[Hashable, float] = {}
        self.clock = [0.0] * len(actions)
        self.arrival: dict[tuple[int, str, int], float] = {}
        self.channel_free: dict[tuple[int, str], float] = {}
        self.events: list[TimelineEvent] = []

    def step(self, s: int, a: Action) -> bool:
        """Time action `a` of stage s; False when it waits for a transfer not yet sent."""
        if a.op in (ActionOp.RECV_F, ActionOp.RECV_B):
            key = (a.boundary, a.op.value[-1], a.micro_batch)
            if key not in self.arrival:
                return False
            cpu = self.receive_cpu.get(key[:2], ())
            self.clock[s] = max(self.clock[s] + (cpu[a.micro_batch] if cpu else 0.0), self.arrival[key])
        elif a.op in (ActionOp.F, ActionOp.B):
            times = self.stages[s].forward_s if a.op is ActionOp.F else self.stages[s].backward_s
            start = self.clock[s]
            self.clock[s] = start + times[a.micro_batch]
            self.events.append(TimelineEvent(s, a.op.value, a.micro_batch, start, self.clock[s]))
        else:
            self._send(s, a)
        return True

    def _send(self, s: int, a: Action) -> None:
        direction = a.op.value[-1]
        channel = (a.boundary, direction)
        needs = self.resources.get(channel, frozenset())
        start = max(self.clock[s], self.channel_free.get(channel, 0.0), *(self.resource_free.get(r, 0.0) for r in needs))
        end = start + self.transfers.get(channel, [0.0] * (a.micro_batch + 1))[a.micro_batch]
        self.channel_free[channel] = end
        for r in needs:
            self.resource_free[r] = end
        self.arrival[(a.boundary, direction, a.micro_batch)] = end
        self.events.append(TimelineEvent(s, f"XFER_{direction}", a.micro_batch, start, end, a.boundary))


def simulate_schedule(actions: Sequence[Sequence[Action]], stages: Sequence[StageTimes], links: Sequence[Link],
                      transfers: Mapping[tuple[int, str], Sequence[float]], *, global_s: float = 0.0,
                      shared_s: float = 0.0,
                      resources: Mapping[tuple[int, str], frozenset[Hashable]] | None = None,
                      receive_cpu: Mapping[tuple[int, str], Sequence[float]] | None = None) -> Timeline:
    """The timeline of one step. `transfers[(boundary, "F" | "B")][m]`: seconds of micro-batch
    m's activation (F) or gradient (B) transfer on that boundary (absent: 0); `resources` of
    the same keys: the NICs each transfer holds (absent: none); `receive_cpu` of the same
    keys: the receiving worker's CPU seconds for it (absent: 0; module docstring)."""
    sim = _Sim(actions, stages, links, transfers, resources or {}, receive_cpu or {})
    pos = [0] * len(actions)
    moved = True
    while moved:
        moved = False
        for s, acts in enumerate(actions):
            while pos[s] < len(acts) and sim.step(s, acts[pos[s]]):
                pos[s], moved = pos[s] + 1, True
    if any(p < len(a) for p, a in zip(pos, actions)):
        raise ScheduleError(f"the schedule deadlocks (stages at actions {pos}); run check_actions for details")
    ends = []
    for s, st in enumerate(stages):
        end = sim.clock[s] + st.sync_s
        if st.sync_s:
            sim.events.append(TimelineEvent(s, "SYNC", -1, sim.clock[s], end))
        ends.append(end)
    step = max(ends) + shared_s + global_s + max((st.update_s for st in stages), default=0.0)
    return Timeline(step, sim.events)
