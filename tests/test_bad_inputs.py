"""Every user mistake in a model reference, a cluster spec or a plan file is `error: ...`
naming the offending value, exit status 2, no traceback, and nothing written or left behind
(issue 13). One table, one row per mistake."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Callable

import pytest

import hetsynth
from hetsynth.cli import main
from hetsynth.runtime.runstate import remove_dead_runs

ROOT = Path(__file__).resolve().parents[1]
EMULATED = ROOT / "configs" / "clusters" / "local-emulated.toml"

MODEL = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 1)
    def forward(self, x):
        return self.l(x).sum()
def raises(**kw):
    raise RuntimeError("boom in the factory")
def module_only(**kw):
    return M()
def inputs_int(**kw):
    return M(), 5
def inputs_str(**kw):
    return M(), (torch.zeros(3, 4), "text")
def inputs_tensor(**kw):
    return M(), torch.zeros(3, 4)
def inputs_batches(**kw):
    return M(), (torch.zeros(3, 4), torch.zeros(2, 4))
def no_kwargs():
    return M(), (torch.zeros(3, 4),)
def typed(batch_size: int = 3, wide: bool = False):
    return M(), (torch.zeros(batch_size, 4),)
"""


def _spec(tmp: Path, old: str, new: str) -> str:
    text = EMULATED.read_text()
    assert old in text, old
    path = tmp / "spec.toml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


def _plan(tmp: Path, base: dict, edit: Callable[[dict], None]) -> str:
    raw = copy.deepcopy(base)
    edit(raw)
    path = tmp / "edited-plan.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _split(raw: dict, uneven: bool = False) -> list[int]:
    """The first shard-length list of the plan (one that reads differently backwards when
    `uneven`)."""
    for layouts in raw["shards"].values():
        for dims in layouts.values():
            for lengths in dims.values():
                if not uneven or lengths != lengths[::-1]:
                    return lengths
    raise AssertionError("no split in the plan")


def _reverse(lengths: list[int]) -> None:
    """Same sum, same per-node structure (2 x 2 mesh), not the ratios' rounding."""
    lengths.reverse()


def _shift(lengths: list[int]) -> None:
    lengths[:] = [x + 1 for x in lengths]


def _ratios(raw: dict, values: Callable[[list[float]], list[float]]) -> None:
    raw["sharding_ratios"] = values(raw["sharding_ratios"])


def _file(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def _same(tmp: Path, base: dict) -> str:
    """The valid plan, as a file."""
    return _plan(tmp, base, lambda raw: None)


def _out(tmp: Path) -> str:
    """An output path in an existing directory (a missing one is itself an error, checked first)."""
    (tmp / "out").mkdir(exist_ok=True)
    return str(tmp / "out" / "plan.json")


PLAN = ["plan", "--cluster", str(EMULATED), "--model"]

# (id, argv from (tmp dir, a valid plan's JSON), text the error must contain)
CASES: list[tuple[str, Callable[[Path, dict], list[str]], str]] = [
    # model references: presets and overrides
    ("hidden<0", lambda t, p: PLAN + ["gpt:tiny,hidden=-5", "-o", _out(t)], "hidden=-5: input should be greater than or equal to 1"),
    ("hidden=0", lambda t, p: ["inspect", "--model", "gpt:tiny,hidden=0"], "hidden=0"),
    ("heads=0", lambda t, p: ["inspect", "--model", "gpt:tiny,num_heads=0"], "num_heads=0"),
    ("layers<0", lambda t, p: ["inspect", "--model", "bert:tiny,num_layers=-1"], "num_layers=-1"),
    ("batch=0", lambda t, p: PLAN + ["vit:tiny,batch_size=0", "-o", _out(t)], "batch_size=0"),
    ("batch<0", lambda t, p: ["inspect", "--model", "gpt:tiny,batch_size=-3"], "batch_size=-3"),
    ("int dtype", lambda t, p: ["inspect", "--model", "gpt:tiny,dtype=int64"], "dtype=int64: input should be 'float16'"),
    ("heads∤hidden", lambda t, p: ["inspect", "--model", "moe:tiny,hidden=30"], "hidden=30 is not divisible by num_heads=4"),
    ("patch>image", lambda t, p: ["inspect", "--model", "vit:tiny,patch_size=32"], "patch_size=32 is larger than image_size=16"),
    ("vgg image", lambda t, p: ["inspect", "--model", "vgg:tiny,image_size=16"], "image_size=16"),
    ("one expert", lambda t, p: ["inspect", "--model", "moe:tiny,num_experts=1"], "num_experts=1"),
    ("dropout", lambda t, p: ["inspect", "--model", "gpt:tiny,dropout=1.5"], "dropout=1.5"),
    ("not an int", lambda t, p: ["inspect", "--model", "gpt:tiny,hidden=1.5"], "hidden=1.5: input should be a valid integer"),
    ("resnet blocks", lambda t, p: ["inspect", "--model", "resnet:tiny,blocks=2:0"], "blocks=2:0: expected a positive count"),
    ("torch family", lambda t, p: ["inspect", "--model", "torch:lstm,family=rnn"], "family=rnn: input should be"),
    ("unet odd image", lambda t, p: ["inspect", "--model", "torch:unet,image_size=15"], "image_size=15 is odd"),
    ("hf model_type", lambda t, p: ["inspect", "--model", "hf:lama"], "hf:lama: unknown model_type"),
    ("hf task", lambda t, p: ["inspect", "--model", "hf:t5,task=image-classification"], "its tasks: seq2seq-lm"),
    ("hf size", lambda t, p: ["inspect", "--model", "hf:llama,seq_len=0"], "seq_len=0: input should be greater"),
    # a user's own model file
    ("factory raises", lambda t, p: PLAN + [f"{t}/m.py:raises", "-o", _out(t)], "raised RuntimeError: boom in the factory"),
    ("module only", lambda t, p: ["inspect", "--model", f"{t}/m.py:module_only"], "got M"),
    ("inputs not a tuple", lambda t, p: ["inspect", "--model", f"{t}/m.py:inputs_int"], "got int"),
    ("input not a tensor", lambda t, p: ["inspect", "--model", f"{t}/m.py:inputs_str"], "example_inputs[1] is a str ('text')"),
    ("bare tensor", lambda t, p: ["inspect", "--model", f"{t}/m.py:inputs_tensor"], "got Tensor (wrap a single tensor"),
    ("two batch sizes", lambda t, p: ["inspect", "--model", f"{t}/m.py:inputs_batches"], "shapes: [(3, 4), (2, 4)]"),
    ("unknown kwarg", lambda t, p: ["inspect", "--model", f"{t}/m.py:no_kwargs,width=3"],
     "the factory has no parameter 'width'; its parameters: none"),
    ("kwarg not an int", lambda t, p: ["inspect", "--model", f"{t}/m.py:typed,batch_size=eight"],
     "batch_size='eight' is not an int (the factory's parameter 'batch_size' is one)"),
    ("kwarg not a bool", lambda t, p: ["inspect", "--model", f"{t}/m.py:typed,wide=maybe"],
     "wide='maybe' is not a bool"),
    ("nan ratio", lambda t, p: PLAN + ["gpt:tiny", "--ratios", "nan,1,1,1", "-o", _out(t)],
     "ratios must be finite, >= 0 and have a positive sum, got [nan, 1.0, 1.0, 1.0]"),
    ("ratios for 3", lambda t, p: PLAN + ["gpt:tiny", "--ratios", "1,1,1", "-o", _out(t)], "3 ratios given for 4 devices"),
    ("zero bucket cap", lambda t, p: PLAN + ["gpt:tiny", "--bucket-mb", "0", "-o", _out(t)],
     "bucket cap 0.0 MiB: must be a finite number of at least one byte"),
    ("zero with stages", lambda t, p: PLAN + ["gpt:tiny", "--zero", "2", "--stages", "2", "-o", _out(t)],
     "--zero 2 with --stages 2: the pipeline runtime keeps every stage's training state whole"),
    # cluster specs
    ("no cpu_quota", lambda t, p: PLAN[:2] + [_spec(t, "cpu-slow = 0.25\n", ""), "--model", "gpt:tiny", "-o", _out(t)],
     "cpu_quota has no entry for device kind(s) ['cpu-slow']"),
    ("quota of no kind", lambda t, p: ["inspect", "--cluster", _spec(t, "cpu-slow = 0.25\n", "cpu-slow = 0.25\ngpu = 1\n")],
     "cpu_quota names unknown device kind(s) ['gpu']"),
    ("quota under 1 ms", lambda t, p: ["inspect", "--cluster", _spec(t, "period_us = 10000", "period_us = 2000")],
     "cpu_quota['cpu-slow'] = 0.25 of period_us = 2000 is 500 us, below the kernel's least quota of 1000 us; "
     "use period_us >= 4000"),
    ("inf throughput", lambda t, p: ["inspect", "--cluster", _spec(t, "throughput_flops = 20e9", "throughput_flops = inf")],
     "throughput_flops = inf: Input should be a finite number"),
    ("nan bandwidth", lambda t, p: ["inspect", "--cluster", _spec(t, "inter_node_bandwidth_gbps = 0.2", "inter_node_bandwidth_gbps = nan")],
     "inter_node_bandwidth_gbps = nan"),
    ("bool count", lambda t, p: ["inspect", "--cluster", _spec(t, "num_devices = 2", "num_devices = true")],
     "num_devices = True: must be an integer >= 1"),
    ("bool memory", lambda t, p: ["inspect", "--cluster", _spec(t, "memory_gib = 4", "memory_gib = true")],
     "memory_gib = True: Input should be a valid number"),
    ("text number", lambda t, p: ["inspect", "--cluster", _spec(t, "throughput_flops = 20e9", 'throughput_flops = "20e9"')],
     "throughput_flops = '20e9'"),
    ("1e8 devices", lambda t, p: ["inspect", "--cluster", _spec(t, "num_devices = 2", "num_devices = 100000000")],
     "num_devices = 100000000: the spec would hold at least 100,000,000 devices; a cluster spec may hold at most 65,536"),
    # plan files
    ("ratios sum", lambda t, p: ["explain", _plan(t, p, lambda r: _ratios(r, lambda x: [v * 1.1 for v in x]))],
     "sharding_ratios sum to 1.1; they must sum to 1"),
    ("negative ratio", lambda t, p: ["run", _plan(t, p, lambda r: _ratios(r, lambda x: [-0.1, x[1] + x[0] + 0.1] + x[2:])),
                                     "--steps", "1"], "sharding_ratios[0] = -0.1"),
    ("lengths sum", lambda t, p: ["run", _plan(t, p, lambda r: _shift(_split(r))), "--steps", "1"], "the shard lengths add up to"),
    ("lengths swapped", lambda t, p: ["explain", _plan(t, p, lambda r: _reverse(_split(r, uneven=True)))],
     "are not the plan's sharding ratios rounded"),
    ("lengths missing", lambda t, p: ["explain", _plan(t, p, lambda r: r["shards"].clear())], "the shard table has no lengths for"),
    ("mesh", lambda t, p: ["explain", _plan(t, p, lambda r: r["mesh"].update(num_nodes=3, per_node=5))],
     "mesh 3 x 5 from rank 0: must cover the cluster's 4 devices"),
    ("layout", lambda t, p: ["explain", _plan(t, p, lambda r: r["instructions"][0].update(layout="S0|Q"))],
     "layout 'S0|Q' is not a layout: 'Q' is no placement; use R, P, Pmax, S<d>"),
    # traces and reports (issue 19)
    ("trace: no plan", lambda t, p: ["trace", f"{t}/missing.json", "-o", _out(t)], "missing.json' does not exist"),
    ("trace: no -o dir", lambda t, p: ["trace", _same(t, p), "-o", f"{t}/nodir/p.json"], "nodir' does not exist"),
    ("report: -o dir", lambda t, p: ["report", _same(t, p), "-o", str(t)], "is a directory"),
    ("report: no measured", lambda t, p: ["report", _same(t, p), "--measured", f"{t}/m.json", "-o", _out(t)],
     "--measured '" + "{t}/m.json': no such file"),
    ("report: measured not JSON", lambda t, p: ["report", _same(t, p), "--measured", _file(t, "m.json", "{"),
                                                "-o", _out(t)], "m.json': not JSON"),
    ("report: predicted as measured", lambda t, p: [
        "report", _same(t, p), "--measured", _file(t, "m.json", '{"traceEvents": [], "otherData": {"hetsynth": "predicted"}}'),
        "-o", _out(t)], "m.json': not a measured trace"),
    ("report: other plan's trace", lambda t, p: [
        "report", _same(t, p), "--measured",
        _file(t, "m.json", '{"traceEvents": [], "otherData": {"hetsynth": "measured", "plan_digest": "0123"}}'),
        "-o", _out(t)], "a trace of another plan (plan digest '0123'"),
    ("run: trace steps", lambda t, p: ["run", _same(t, p), "--steps", "2", "--trace-steps", "2", "--trace",
                                       f"{_out(t)}.trace"], "--trace-steps 2 with --steps 2"),
    ("run: no --trace dir", lambda t, p: ["run", _same(t, p), "--steps", "2", "--trace", f"{t}/nodir/m.json"],
     "--trace '" + "{t}/nodir/m.json': directory"),
    ("run: --trace elsewhere", lambda t, p: ["run", _plan(t, p, lambda r: r["cluster"].update(emulation=None)), "--steps",
                                             "2", "--trace", _out(t)], "--trace needs a run on this machine"),
    ("run: --trace is --report", lambda t, p: ["run", _same(t, p), "--steps", "2", "--trace", _out(t),
                                               "--report", _out(t)], "name the same file"),
    ("run: memory report of 1 step", lambda t, p: ["run", _same(t, p), "--steps", "1", "--memory-report"],
     "--memory-report with --steps 1"),
]


@pytest.fixture(scope="module")
def valid_plan() -> dict:
    return json.loads(hetsynth.plan("gpt:tiny", cluster=str(EMULATED)).model_dump_json())


@pytest.mark.parametrize("argv, needle", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_bad_input_is_an_error_message(argv: Callable[[Path, dict], list[str]], needle: str, valid_plan: dict,
                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.py").write_text(MODEL)
    args = argv(tmp_path, valid_plan)
    needle = needle.replace("{t}", str(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    remove_dead_runs()  # a run an earlier test killed would otherwise put its clean-up note first
    start = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing left behind
    assert time.perf_counter() - start < 10


@pytest.mark.slow
@pytest.mark.serial  # timed
def test_hopeless_memory_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpt:xl's training state (23 GiB) on the emulated cluster (16 GiB): refused before the
    search, in seconds (was 313 s)."""
    start = time.perf_counter()
    assert main(["plan", "--model", "gpt:xl", "--cluster", str(EMULATED), "-o", _out(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no plan fits in memory" in err and "need 23.21 GiB" in err and "hold 16 GiB in all" in err, err
    assert time.perf_counter() - start < 15 and not (tmp_path / "out" / "plan.json").exists()


# Inputs that pass the schema but that training, the solvers or the parsers cannot take (issue 36,
# validation at the door): each is refused when it is read or planned, never on the ranks.
DOOR_MODEL = MODEL + """
import sys
class IntLoss(M):
    def forward(self, x):
        return (self.l(x) > 0).sum()
class Detached(M):
    def forward(self, x):
        return self.l(x).sum().detach()
class NoParams(torch.nn.Module):
    def forward(self, x):
        return x.sum()
def exits(**kw):
    sys.exit(0)
def base_exception(**kw):
    raise BaseException("not an Exception")
def int_loss(**kw):
    return IntLoss(), (torch.zeros(3, 4),)
def detached(**kw):
    return Detached(), (torch.zeros(3, 4),)
def no_params(**kw):
    return NoParams(), (torch.zeros(3, 4),)
def frozen(**kw):
    return M().requires_grad_(False), (torch.zeros(3, 4),)
"""
DEEP = "[" * 100_000 + "]" * 100_000


def _bytes(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)

DOOR_CASES: list[tuple[str, Callable[[Path, dict], list[str]], str]] = [
    ("factory sys.exit(0)", lambda t, p: PLAN + [f"{t}/door.py:exits", "-o", _out(t)], "exits() raised SystemExit: 0"),
    ("factory BaseException", lambda t, p: PLAN + [f"{t}/door.py:base_exception", "-o", _out(t)],
     "raised BaseException: not an Exception"),
    ("integer loss", lambda t, p: PLAN + [f"{t}/door.py:int_loss", "-o", _out(t)],
     "the loss has dtype int64; it must be a floating-point scalar"),
    ("detached loss", lambda t, p: PLAN + [f"{t}/door.py:detached", "-o", _out(t)],
     "the loss (float32 scalar) does not depend on any trainable parameter"),
    ("no parameters", lambda t, p: PLAN + [f"{t}/door.py:no_params", "-o", _out(t)],
     "the model (NoParams) has no parameters"),
    ("frozen parameters", lambda t, p: PLAN + [f"{t}/door.py:frozen", "-o", _out(t)],
     "has no trainable parameters: its 2 parameter tensor(s) (5 elements) all have requires_grad=False"),
    ("hidden=10**30", lambda t, p: ["inspect", "--model", f"gpt:tiny,hidden={10**30}"],
     f"gpt:tiny,hidden={10**30}: the model cannot be built at these sizes"),
    ("batch=10**20", lambda t, p: PLAN + [f"gpt:tiny,batch_size={10**20}", "-o", _out(t)],
     "the model cannot be built at these sizes"),
    ("memory 1e308", lambda t, p: ["inspect", "--cluster", _spec(t, "memory_gib = 4", "memory_gib = 1e308")],
     "memory_gib = 1e+308: must be in [1e-06, 1e+06] GiB"),
    ("throughput 1e-300", lambda t, p: PLAN[:2] + [_spec(t, "throughput_flops = 20e9", "throughput_flops = 1e-300"),
                                                   "--model", "gpt:tiny", "-o", _out(t)],
     "throughput_flops = 1e-300: must be in [1000, 1e+21] FLOP/s"),
    ("bandwidth 1e-30", lambda t, p: ["inspect", "--cluster", _spec(t, "inter_node_bandwidth_gbps = 0.2",
                                                                   "inter_node_bandwidth_gbps = 1e-30")],
     "inter_node_bandwidth_gbps = 1e-30: must be in [1e-06, 1e+07] Gbit/s"),
    ("latency 1e300", lambda t, p: ["inspect", "--cluster", _spec(t, "inter_node_latency_us = 300",
                                                                 "inter_node_latency_us = 1e300")],
     "inter_node_latency_us = 1e+300: must be in [0, 1e+08] us"),
    ("deep JSON spec", lambda t, p: ["inspect", "--cluster", _file(t, "deep.json", DEEP)],
     "deep.json: nested too deeply"),
    ("deep TOML spec", lambda t, p: ["inspect", "--cluster", _file(t, "deep.toml", f"name = {DEEP}\n")],
     "deep.toml: nested too deeply"),
    ("deep plan", lambda t, p: ["explain", _file(t, "deep-plan.json", DEEP)], "deep-plan.json: nested too deeply"),
    ("binary spec", lambda t, p: ["inspect", "--cluster", _bytes(t, "bin.toml", b"\xff\xfe name")],
     "bin.toml: cannot read it"),
    ("--lr inf", lambda t, p: ["run", _same(t, p), "--steps", "1", "--lr", "inf"],
     "--lr inf: give a positive, finite learning rate"),
    ("--lr nan", lambda t, p: ["run", _same(t, p), "--steps", "1", "--lr", "nan"], "--lr nan"),
    ("--weight-decay inf", lambda t, p: ["run", _same(t, p), "--steps", "1", "--weight-decay", "inf"],
     "--weight-decay inf: give a finite number >= 0"),
    ("--max-grad-norm inf", lambda t, p: ["run", _same(t, p), "--steps", "1", "--max-grad-norm", "inf"],
     "--max-grad-norm inf: give a positive, finite norm, or none"),
]


@pytest.mark.parametrize("argv, needle", [(c[1], c[2]) for c in DOOR_CASES], ids=[c[0] for c in DOOR_CASES])
@pytest.mark.slow
def test_unusable_input_is_an_error_message(argv: Callable[[Path, dict], list[str]], needle: str, valid_plan: dict,
                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "door.py").write_text(DOOR_MODEL)
    test_bad_input_is_an_error_message(argv, needle, valid_plan, tmp_path, capsys)


def test_unreadable_inputs_are_an_error_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec or plan this user may not read (a PermissionError as a non-root user; simulated,
    since root reads anything)."""
    spec, plan = Path(_file(tmp_path, "spec.toml", EMULATED.read_text())), Path(_file(tmp_path, "plan.json", "{}"))
    real = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        if self.name in (spec.name, plan.name):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    for argv, needle in ((["inspect", "--cluster", str(spec)], f"cluster spec {spec}: cannot read it: [Errno 13]"),
                         (["explain", str(plan)], f"plan file {plan}: cannot read it: [Errno 13]")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err, err
