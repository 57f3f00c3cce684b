"""Pipeline schedules: warm-up and in-flight counts, the dry run, and the discrete-event
simulation against the toy figures of design.md (S=4, M=16, F=1, B=2, transfer C)."""

import random

import pytest

from hetsynth.cost_models.schedule import StageTimes, simulate_schedule
from hetsynth.instruction_set.schedule import (ActionOp, Link, Schedule, ScheduleError, build_actions,
                                      check_actions, in_flight, warmup)


def chain(num_stages: int) -> list[Link]:
    return [Link(src=s, dst=s + 1) for s in range(num_stages - 1)]


def toy(schedule: Schedule, c: float, S: int = 4, M: int = 16, f: float = 1.0, b: float = 2.0) -> float:
    links = chain(S)
    actions = build_actions(schedule, M, links, S)
    check_actions(actions, links, M)
    stages = [StageTimes((f,) * M, (b,) * M) for _ in range(S)]
    transfers = {(i, d): (c,) * M for i in range(len(links)) for d in "FB"}
    return simulate_schedule(actions, stages, links, transfers).step_time_s


@pytest.mark.parametrize("schedule, expected", [
    (Schedule.ONE_F_ONE_B, (71, 85, 113)), (Schedule.EAGER_1F1B, (60, 63, 75)), (Schedule.GPIPE, (60, 63, 84))])
def test_toy_table(schedule, expected):
    assert tuple(toy(schedule, c) for c in (0.5, 1.0, 2.0)) == expected


def test_no_transfer_time_is_the_ideal_pipeline():
    rng = random.Random(0)
    for _ in range(30):
        S, M = rng.randint(1, 6), rng.randint(1, 20)
        for schedule in Schedule:
            assert toy(schedule, 0.0, S, M) == (M + S - 1) * 3.0


def test_warmup_and_in_flight_counts():
    for S in range(1, 7):
        for M in range(1, 21):
            for s in range(S):
                assert warmup(Schedule.ONE_F_ONE_B, S, s, M) == min(M, S - 1 - s)
                assert in_flight(Schedule.ONE_F_ONE_B, S, s, M) == min(M, S - s)
                assert in_flight(Schedule.EAGER_1F1B, S, s, M) == min(M, 2 * (S - s) - 1)
                assert in_flight(Schedule.GPIPE, S, s, M) == M


def test_dry_run_finds_a_deadlock_and_names_both_stages():
    links = chain(2)
    actions = [list(a) for a in build_actions(Schedule.ONE_F_ONE_B, 2, links, 2)]
    # stage 0 waits for mb 0's gradient before sending mb 0's activation
    recv = next(a for a in actions[0] if a.op is ActionOp.RECV_B)
    actions[0] = [recv] + [a for a in actions[0] if a is not recv]
    with pytest.raises(ScheduleError, match=r"stage 0 is at action 0 .*from stage 1.*stage 1 is at action 0"):
        check_actions(actions, links, 2)


def test_dry_run_refuses_malformed_lists():
    links = chain(2)
    actions = [list(a) for a in build_actions(Schedule.GPIPE, 3, links, 2)]
    actions[1] = [a for a in actions[1] if not (a.op is ActionOp.B and a.micro_batch == 2)]
    with pytest.raises(ScheduleError, match="stage 1 runs B for micro-batches"):
        check_actions(actions, links, 3)
    swapped = [list(a) for a in build_actions(Schedule.GPIPE, 3, links, 2)]
    swapped[0][1], swapped[0][4] = swapped[0][4], swapped[0][1]  # SEND_F mb 1 before mb 0's
    with pytest.raises(ScheduleError, match="increasing micro-batch order|comes before"):
        check_actions(swapped, links, 3)


def test_transfers_that_share_a_nic_queue_for_it():
    """Two boundary tensors from stage 0 to stage 1 (GPipe, M = 1, F = 1, B = 2, C = 1 each):
    on their own links both arrive together; through one NIC per direction the second waits
    for the first, in both directions (activations and gradients)."""
    links = [Link(src=0, dst=1), Link(src=0, dst=1)]
    actions = build_actions(Schedule.GPIPE, 1, links, 2)
    stages = [StageTimes((1.0,), (2.0,)), StageTimes((1.0,), (2.0,))]
    transfers = {(i, d): (1.0,) for i in range(2) for d in "FB"}
    assert simulate_schedule(actions, stages, links, transfers).step_time_s == 8.0
    nics = {(i, "F"): frozenset({(0, "out"), (1, "in")}) for i in range(2)}
    nics |= {(i, "B"): frozenset({(1, "out"), (0, "in")}) for i in range(2)}
    shared = simulate_schedule(actions, stages, links, transfers, resources=nics)
    assert shared.step_time_s == 10.0
    ends = sorted(e.end_s for e in shared.events if e.kind == "XFER_F")
    assert ends == [2.0, 3.0]


def test_end_of_step_phases_add_up():
    """step = max_s (end_s + sync_s) + shared_s + global_s + max_s update_s."""
    links = chain(2)
    actions = build_actions(Schedule.ONE_F_ONE_B, 2, links, 2)
    stages = [StageTimes((1.0, 1.0), (2.0, 2.0), sync_s=0.5, update_s=0.25),
              StageTimes((1.0, 1.0), (2.0, 2.0), sync_s=3.0, update_s=0.75)]
    base = simulate_schedule(actions, [StageTimes(s.forward_s, s.backward_s) for s in stages], links, {})
    ends = {}
    for e in base.events:
        ends[e.stage] = max(ends.get(e.stage, 0.0), e.end_s)
    got = simulate_schedule(actions, stages, links, {}, shared_s=0.125, global_s=0.0625).step_time_s
    assert got == max(ends[0] + 0.5, ends[1] + 3.0) + 0.125 + 0.0625 + 0.75


def test_receive_cpu_is_paid_only_where_the_receiver_is_busy():
    """GPipe, 2 stages, F = 1, B = 2, C = 1, receive CPU r = 0.5 of each activation. M = 1:
    stage 1 waits from 0 until the activation arrives at 2, so r falls into the wait and the
    step stays 8. M = 2: the second activation arrives at 3 while stage 1 computes F0 (2-3),
    so its receive CPU delays F1 by r: clock = max(3 + 0.5, 3)."""
    links = chain(2)
    for m, extra in ((1, 0.0), (2, 0.5)):
        actions = build_actions(Schedule.GPIPE, m, links, 2)
        stages = [StageTimes((1.0,) * m, (2.0,) * m) for _ in range(2)]
        transfers = {(0, d): (1.0,) * m for d in "FB"}
        base = simulate_schedule(actions, stages, links, transfers)
        got = simulate_schedule(actions, stages, links, transfers, receive_cpu={(0, "F"): (0.5,) * m})
        assert got.step_time_s == pytest.approx(base.step_time_s + extra)
        second = [e for e in got.events if e.stage == 1 and e.kind == "F"][-1]
        assert second.start_s == pytest.approx(2.0 if m == 1 else 3.5)
