"""The stage planner's dynamic programme (planner.stage_dp): in-flight counts per schedule, and
the DP's choice equal to brute force over every cut and sub-mesh on small hand-made cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetsynth.instruction_set.cluster import cluster_from_dict
from hetsynth.instruction_set.schedule import Schedule
from hetsynth.planner.stage_dp import Segments, in_flight, solve, stage_table, units

GIB = 2 ** 30


def cluster(speeds: list[float], memories: list[float]):
    kinds = {f"k{i}": {"throughput_flops": s, "memory_gib": m} for i, (s, m) in enumerate(zip(speeds, memories))}
    devices = [{"name": f"g{i}", "kind": f"k{i}"} for i in range(len(speeds))]
    nodes = [{"name": f"n{i}", "devices": [f"g{i}"]} for i in range(len(speeds))]
    return cluster_from_dict({"name": "t", "device_kinds": kinds, "devices": devices, "nodes": nodes,
                              "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 8}})


@pytest.mark.parametrize("schedule,expected", [
    (Schedule.GPIPE, [8, 8, 8, 8]),
    (Schedule.ONE_F_ONE_B, [4, 3, 2, 1]),
    (Schedule.EAGER_1F1B, [7, 5, 3, 1]),
])
def test_in_flight_per_schedule(schedule, expected):
    assert [in_flight(schedule, 4, s, 8) for s in range(4)] == expected
    assert max(in_flight(schedule, 4, s, 2) for s in range(4)) == 2  # never more than M


def test_in_flight_rejects_a_stage_outside_the_pipeline():
    with pytest.raises(ValueError, match="stage 4: choose 0..3"):
        in_flight(Schedule.GPIPE, 4, 4, 8)


def brute_force(seg: Segments, spec, S: int, M: int, schedule: Schedule, batch: int, micro: int):
    """min T over every choice of S - 1 cuts among the segments and S - 1 cuts among the units."""
    groups = units(spec)
    table = stage_table(seg, spec, groups)
    J, U, frac = len(seg.flops), len(groups), micro / batch
    best = None
    for cuts in itertools.combinations(range(1, J), S - 1):
        for splits in itertools.combinations(range(1, U), S - 1):
            js, us = (0, *cuts, J), (0, *splits, U)
            times, total, ok = [], 0.0, True
            for s in range(S):
                j, jj, i, ii = js[s], js[s + 1], us[s], us[s + 1]
                n = in_flight(schedule, S, s, M)
                need = table.params[j, jj, 0, 0] + n * frac * table.saved[j, jj, 0, 0] * table.share[:, 0, 0, i, ii]
                ok &= bool(np.all(need <= table.memory[:, 0, 0, i, ii]))
                t = table.time[j, jj, i, ii] * frac
                times.append(t)
                total += t + table.sync[j, jj, i, ii]
            if ok:
                T = total + (M - 1) * max(times)
                if best is None or T < best[0]:
                    best = (T, [(js[s], js[s + 1], us[s], us[s + 1]) for s in range(S)])
    return best


def segs(flops, params, saved) -> Segments:
    return Segments(tuple(range(len(flops) + 1)), np.array(flops, float), np.array(params, float), np.array(saved, float))


def test_dp_equals_brute_force_two_groups_four_blocks():
    spec = cluster([3e12, 1e12], [16, 16])
    seg = segs([4e12, 4e12, 4e12, 4e12], [1e8] * 4, [1e9] * 4)
    got = solve(stage_table(seg, spec, units(spec)), 2, 4, Schedule.ONE_F_ONE_B, 16, 4)
    want = brute_force(seg, spec, 2, 4, Schedule.ONE_F_ONE_B, 16, 4)
    assert got[1] == want[1] == [(0, 3, 0, 1), (3, 4, 1, 2)]  # the 3x faster group takes 3 of 4 blocks
    assert got[0] == pytest.approx(want[0], rel=1e-12)


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("S", [2, 3])
def test_dp_equals_brute_force_uneven_blocks_and_memory(schedule, S):
    """Four groups of unlike speed and memory, six unlike blocks; the memory is tight enough
    that some cuts do not fit (the in-flight count of the first stage binds)."""
    spec = cluster([2e12, 1e12, 3e12, 1.5e12], [6, 12, 4, 8])
    seg = segs([2e12, 5e12, 1e12, 3e12, 4e12, 2e12], [2e8, 1e8, 3e8, 1e8, 2e8, 1e8], [3e9, 1e9, 2e9, 4e9, 1e9, 2e9])
    table = stage_table(seg, spec, units(spec))
    got = solve(table, S, 6, schedule, 24, 4)
    want = brute_force(seg, spec, S, 6, schedule, 24, 4)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        assert got[1] == want[1]


def test_dp_reports_nothing_when_no_cut_fits():
    spec = cluster([1e12, 1e12], [1, 1])
    seg = segs([1e12] * 4, [1e9] * 4, [1e9] * 4)  # 4 GB of parameter state per block
    assert solve(stage_table(seg, spec, units(spec)), 2, 4, Schedule.GPIPE, 16, 4) is None


def test_units_split_nodes_until_enough():
    spec = cluster_from_dict({"name": "t", "device_kinds": {"A": {"throughput_flops": 1e12, "memory_gib": 16}},
                              "devices": [{"name": f"g{i}", "kind": "A"} for i in range(16)],
                              "nodes": [{"name": f"n{k}", "devices": [f"g{i}" for i in range(8 * k, 8 * k + 8)]}
                                        for k in range(2)],
                              "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 8}})
    assert [len(u) for u in units(spec)] == [2] * 8
    assert units(spec, min_units=2) == [range(0, 8), range(8, 16)]


@pytest.mark.slow
def test_auto_stages_on_local_emulated_keeps_spmd_and_covers_the_model():
    """gpt:tiny on the shipped local-emulated cluster: the DP's pipeline covers every call and
    every rank in order, and SPMD (predicted faster there) stays the plan's shape."""
    from pathlib import Path

    from hetsynth import capture_model
    from hetsynth.instruction_set.cluster import load_cluster
    from hetsynth.instruction_set.models import parse_model_ref
    from hetsynth.instruction_set.plan import PlanShape
    from hetsynth.planner.pipeline import auto_stages
    from hetsynth.planner.planner import make_plan

    spec = load_cluster(Path(__file__).resolve().parents[1] / "configs" / "clusters" / "local-emulated.toml")
    spmd = make_plan(capture_model("gpt:tiny"), spec, width=8, progress=False, with_baselines=False)
    plan = auto_stages(spmd, parse_model_ref("gpt:tiny"), max_stages=2, top_k=1, width=8)
    stages = plan.pipeline.stages
    assert [s.calls for s in stages] == [(0, stages[0].calls[1]), (stages[0].calls[1], len(spmd.graph.calls))]
    assert stages[0].first_rank == 0 and stages[1].first_rank == stages[0].num_devices
    assert sum(s.num_devices for s in stages) == spec.num_devices
    assert plan.shape is PlanShape.SPMD
    assert plan.pipeline.predicted.step_time_s >= spmd.predicted.step_time_s * 0.98


@pytest.mark.slow
def test_cli_rejects_a_bad_stage_count():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hetsynth", "plan", "--model", "gpt:tiny", "--cluster", "x.toml",
                          "--stages", "many"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "'many': expected 'auto' or a number of stages" in out.stderr


def _tiny_memory_cluster(path, memory_gib: float) -> str:
    import json

    path.write_text(json.dumps({"name": "tiny-mem", "device_kinds": {"small": {"throughput_flops": 1e12,
                                                                              "memory_gib": memory_gib}},
                                "nodes": [{"name": "n", "kind": "small", "num_devices": 2}],
                                "links": {"intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10}}))
    return str(path)


@pytest.mark.slow
def test_plan_tries_stages_when_no_spmd_plan_fits(tmp_path, capsys):
    """gpt:tiny on two devices of 0.00033 GiB: no SPMD program fits (0.000411 GiB on a device
    even with every block recomputed), a pipeline of one device per stage does; `hetsynth plan`
    without --stages says it tries stages and writes the pipeline. At 0.00028 GiB neither
    fits: error naming both, exit 2, nothing written."""
    from hetsynth.cli import main
    from hetsynth.instruction_set.plan import PlanShape, load_plan
    from hetsynth.planner.pipeline import stage_memory

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt:tiny", "--cluster", _tiny_memory_cluster(tmp_path / "c.json", 0.00033),
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no SPMD plan fits in memory; trying pipeline stages" in printed and "chosen: pipeline" in printed
    plan = load_plan(out)
    assert plan.shape is PlanShape.PIPELINE and not plan.predicted.fits
    assert all(peak <= cap for peak, cap, _ in stage_memory(plan)) and len(plan.pipeline.stages) == 2
    out.unlink()
    assert main(["plan", "--model", "gpt:tiny", "--cluster", _tiny_memory_cluster(tmp_path / "c.json", 0.00028),
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: no plan fits in memory: the best plan found needs" in err and "No pipeline fits either" in err
    assert not out.exists()


@pytest.mark.slow
def test_no_stage_program_at_every_micro_batch_size_is_an_error(tmp_path, capsys, monkeypatch):
    """A stage whose program synthesized at one micro-batch size cannot run at another (here
    forced: planner.pipeline.program_at refuses every other size) leaves no pipeline at the
    asked micro-batch count: `hetsynth plan --stages 2 --micro-batches 3` of a batch of 8 (sizes
    3, 3, 2) says which stage, the sizes, why each try failed and what to do; exit 2, nothing
    written."""
    from hetsynth.cli import main
    from hetsynth.planner import pipeline

    def refuse(graph, cluster, plan):
        raise ValueError("no rule shards dim 0 of size 2")

    monkeypatch.setattr(pipeline, "program_at", refuse)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt:tiny,batch_size=8", "--cluster", _tiny_memory_cluster(tmp_path / "c.json", 4),
                 "--stages", "2", "--micro-batches", "3", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: stage of calls [" in err and "no program runs at every micro-batch size [2, 3]" in err, err
    assert ("the program synthesized at 3 samples: no rule shards dim 0 of size 2; the program synthesized at 2 "
            "samples: no rule shards dim 0 of size 2") in err, err
    assert "choose a micro-batch count that divides the batch" in err and not out.exists()
