"""Training a pipeline plan on one rank: set-up, the action-list executor, one step.

Set-up (collective, every rank in the same order): the process groups of every stage's
sub-mesh (runtime.groups.Groups.for_stages), one group per parameter that several stages hold
(GPT's tied embedding), then this rank's stage programs, one per micro-batch size, built from the
stage's SPMD plans on its sub-mesh of global ranks; the programs of all sizes share one set of
nn.Parameters (parameter shard lengths do not depend on the micro-batch size).

`build` makes the stage from the model's whole state (runtime.pipeline.module's
PipelineModule: the user's module; `setup`: the model reference's initial state, with an
optimizer, for `hetsynth run`). A step is exactly a single-device step:
- micro-batch m holds samples sB + o_m + [0, b_m); a step takes this rank's rows of each input
  (runtime.input_rows: every micro-batch's rows of its stage's layouts, and the whole batch
  for inputs of the statistics), and each micro-batch's program reads its rows of them;
- statistics (input-only batch reductions, planner.microbatch) are computed from the whole
  batch, so that the micro-batches' losses add up to the batch's;
- the actions of the rank's stage run in order (instruction_set.schedule): F(m) runs the
  program of size b_m on the received boundary tensors and keeps what B(m) needs; B(m)
  differentiates the loss (last stage) or the tokens of the sent boundary tensors, so autograd
  accumulates every micro-batch's gradient into .grad;
- then the stage's replicated gradients are all-reduced on their axis, the copies of a
  parameter several stages hold are summed over their holders, the global norm is one world
  all-reduce (each element counted once), clipping, and the optimizer step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from hetsynth.instruction_set.interpret import call_node, constant
from hetsynth.instruction_set.layouts import Layout
from hetsynth.instruction_set.local import MAY_DRAW
from hetsynth.instruction_set.models import ModelSpec, parse_model_ref, with_dtype
from hetsynth.instruction_set.pipeline import Pipeline, PipelineStage
from hetsynth.instruction_set.plan import Plan
from hetsynth.instruction_set.precision import with_float_dtype
from hetsynth.instruction_set.schedule import ActionOp
from hetsynth.instruction_set.shards import MeshLayout
from hetsynth.runtime.codegen import RankProgram, build_rank_program, local_slice
from hetsynth.runtime.config import TrainConfig
from hetsynth.runtime.draws import Draws
from hetsynth.runtime.groups import Groups, group_timeout
from hetsynth.runtime.input_rows import input_names, input_rows, layout_rows, local_rows, stage_mesh_of, stage_statistics
from hetsynth.runtime.mixed_precision import autocast, forward_dtype, gradient_wire, loss_scaler, reduced
from hetsynth.runtime.pipeline.transfer import Link, Outbox, post_receive, receive_forward, send_forward
from hetsynth.runtime.rank_state import precision
from hetsynth.runtime.train import check_finite, check_state, initial_state, make_optimizer

if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

MAX_CHAINS = 1 << 12  # tag space per (boundary, micro-batch)


stage_mesh = stage_mesh_of  # the name explain_pipeline and the checkpoints use


@dataclass
class PipelineTrainer:
    plan: Plan
    stage: PipelineStage
    groups: Groups
    world: Any
    programs: dict[int, RankProgram]
    shared: dict[str, Any]                 # fqn -> group of the ranks of every stage holding it
    state: dict[str, torch.Tensor]         # the model's whole buffers as initialised (statistics read them)
    rows: list[list[int]]                  # this rank's rows of each input (runtime.input_rows)
    device: torch.device = torch.device("cpu")
    dtype: str | None = None               # the float dtype of a plan's twin (runtime.train.precision)
    spec: ModelSpec | None = None          # hetsynth run's: the model reference (setup)
    optimizer: torch.optim.Optimizer | None = None
    config: TrainConfig | None = None
    outbox: Outbox = field(default_factory=Outbox)
    scaler: "ShardedGradScaler | None" = None  # the run's loss scaler (runtime.mixed_precision; build's)
    autocast_dtype: torch.dtype | None = None  # what forwards autocast to (mixed_precision.forward_dtype)
    losses: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # of the last step (train_step)
    events: list[tuple[str, int, float, float]] = field(default_factory=list)  # of the last step (train_step)
    draws: Draws | None = None             # the model's random draws, made whole once a step (runtime.draws)

    @property
    def pipeline(self) -> Pipeline:
        assert self.plan.pipeline is not None
        return self.plan.pipeline

    @property
    def main(self) -> RankProgram:
        return self.programs[max(self.programs)]


def _shared_groups(pipeline: Pipeline, rank: int, world: Any) -> dict[str, Any]:
    holders: dict[str, list[PipelineStage]] = {}
    for stage in pipeline.stages:
        for node in next(iter(stage.plans.values())).graph.params:
            holders.setdefault(node.fqn, []).append(stage)
    out = {}
    for fqn, stages in holders.items():
        if len(stages) > 1:
            ranks = [r for s in stages for r in s.ranks]
            group = dist.new_group(ranks, timeout=group_timeout(world))
            if rank in ranks:
                out[fqn] = group
    return out


def _outputs(pipeline: Pipeline, stage: PipelineStage) -> list[tuple[str, Layout]]:
    return list(dict.fromkeys((b.tensor, b.src_layout) for b in pipeline.boundaries if b.src_stage == stage.index))


def build(plan: Plan, rank: int, state: dict[str, torch.Tensor], params: set[str], *, world: Any,
          device: torch.device | str = "cpu", dtype: str | None = None) -> PipelineTrainer:
    """This rank's stage of a pipeline plan (already in `dtype`: twin) over the model's whole
    `state` (every parameter and buffer by name, `params` the parameters' names): collective,
    every rank in the same order. No rank keeps whole copies of the parameters."""
    assert plan.pipeline is not None, "build needs a pipeline plan"
    pipeline = plan.pipeline
    groups = Groups.for_stages([stage_mesh(s) for s in pipeline.stages], rank, world=world)
    shared = _shared_groups(pipeline, rank, world)
    stage = pipeline.stage_of(rank)
    draws = _draws(plan, stage, torch.device(device))
    programs: dict[int, RankProgram] = {}
    for b in sorted(stage.plans, reverse=True):
        programs[b] = build_rank_program(stage.plans[b], groups, state=state, device=device,
                                         outputs=_outputs(pipeline, stage), draws=draws)
        if len(programs) > 1:
            _share_parameters(programs[b], programs[max(programs)])
    buffers = {k: v.detach().clone() for k, v in state.items() if k not in params}
    return PipelineTrainer(plan, stage, groups, world, programs, shared, buffers, input_rows(plan, rank),
                           torch.device(device), dtype, scaler=loss_scaler(plan, torch.device(device), world, dtype),
                           autocast_dtype=forward_dtype(plan, rank, dtype), draws=draws)


def _draws(plan: Plan, stage: PipelineStage, device: torch.device) -> Draws | None:
    """The stage's random draws, made whole once a step (runtime.draws); None for a model
    that draws nothing."""
    keep = {n.name for p in stage.plans.values() for n in p.graph.calls if n.target in MAY_DRAW}
    made = Draws(plan.graph, plan.model.batch_size, keep, device)
    return made if made.made else None


def setup(plan: Plan, rank: int, config: TrainConfig, *, world: Any) -> PipelineTrainer:
    """`build` from the model reference's initial state, with the run's optimizer (hetsynth run)."""
    assert plan.pipeline is not None, "setup needs a pipeline plan"
    spec = parse_model_ref(plan.model.ref)
    if config.dtype is not None:
        plan, spec = twin(plan, config.dtype), with_dtype(spec, config.dtype)
    state, params = initial_state(spec, config.seed)
    check_state(plan, state)
    t = build(plan, rank, state, params, world=world, dtype=config.dtype)
    t.spec, t.config = spec, config
    t.optimizer = make_optimizer(list(t.main.module.parameters()), config)
    return t


def twin(plan: Plan, dtype: str) -> Plan:
    """The pipeline plan in another floating-point dtype: every stage plan's twin
    (instruction_set.precision), the same programs, ratios and shard lengths."""
    pipeline = plan.pipeline
    stages = tuple(s.model_copy(update={"plans": {b: with_float_dtype(p, dtype) for b, p in s.plans.items()}})
                   for s in pipeline.stages)
    return with_float_dtype(plan, dtype).model_copy(update={"pipeline": pipeline.model_copy(update={"stages": stages})})


def _share_parameters(program: RankProgram, main: RankProgram) -> None:
    for name, param in list(program.module.named_parameters()):
        program.module._parameters[name] = getattr(main.module, name)
    for name, _ in list(program.module.named_buffers()):
        program.module._buffers[name] = getattr(main.module, name)


# -- data -------------------------------------------------------------------------------------------

def spec_inputs(t: PipelineTrainer, step: int) -> list[torch.Tensor]:
    """This rank's rows of each input of global batch `step`, from the model reference's data."""
    assert t.spec is not None and t.config is not None, "spec_inputs needs setup's trainer"
    wanted = sorted({r for rows in t.rows for r in rows})
    base = step * t.plan.model.batch_size
    values = t.spec.make_batch([base + r for r in wanted], seed=t.config.data_seed) if wanted else None
    at = {r: i for i, r in enumerate(wanted)}
    out = []
    for k, node in enumerate(n for n in t.plan.graph.nodes if n.op == "input"):
        if values is None:
            out.append(torch.zeros((0, *node.out.shape[1:]), dtype=getattr(torch, node.out.dtype)))
        else:
            out.append(values[k][[at[r] for r in t.rows[k]]])
    return out


def statistics(t: PipelineTrainer, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The input-only batch reductions this stage reads, over the whole global batch
    (planner.microbatch), of `inputs` (this rank's rows: the whole batch of the inputs they read)."""
    graph, used = t.plan.graph, stage_statistics(t.plan, t.stage)
    if not used:
        return {}
    env: dict[str, Any] = dict(zip(input_names(t.plan), inputs))
    for node in graph.nodes:
        if node.op == "buffer":
            env[node.name] = constant(node) if node.value is not None else t.state[node.fqn]
    need = _closure(graph, used)
    for node in graph.calls:
        if node.name in need:
            env[node.name] = call_node(node, env, torch.device("cpu"))
    return {s: env[s] for s in used}


def _closure(graph: Any, names: Sequence[str]) -> set[str]:
    todo, need = list(names), set()
    while todo:
        n = todo.pop()
        if n not in need and graph.node(n).op == "call":
            need.add(n)
            todo += list(graph.node(n).inputs)
    return need


def micro_inputs(t: PipelineTrainer, inputs: Sequence[torch.Tensor], m: int, received: dict[str, torch.Tensor],
                 stats: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The program's inputs for micro-batch m: data rows, statistics, received boundaries."""
    sizes = t.pipeline.micro_batches
    b, base = sizes[m], sum(sizes[:m])
    plan, program = t.stage.plans[b], t.programs[b]
    names = input_names(t.plan)
    out = []
    for name, layout in program.inputs:
        if (name, layout) in received:
            out.append(received[(name, layout)])
        elif name in stats:
            out.append(stats[name].to(t.device, getattr(torch, plan.graph.node(name).out.dtype)))
        else:
            i = names.index(name)
            rows = layout_rows(plan, t.groups.mesh, name, layout, t.groups.rank, b)
            out.append(inputs[i][local_rows(t.rows[i], range(base + rows.start, base + rows.stop))].to(t.device))
    return out


# -- the executor -----------------------------------------------------------------------------------

def _link(t: PipelineTrainer, index: int, m: int) -> Link:
    boundary = t.pipeline.boundaries[index]
    b = t.pipeline.micro_batches[m]
    dtype = getattr(torch, t.stage.plans[b].graph.node(boundary.tensor).out.dtype)
    stage_group = t.groups.group("all") if boundary.src_stage == t.stage.index else None
    tag = (index * len(t.pipeline.micro_batches) + m) * MAX_CHAINS
    plan = boundary.reshard[b]
    first = (t.groups.span("all") if stage_group is not None and boundary.src_layout.outer.is_partial
             and not plan.spec.src.partial else None)
    return Link(plan, t.groups.rank, t.world, stage_group, tag, t.outbox, dtype, first)


ACTION_PHASES = {ActionOp.F: "forward", ActionOp.B: "backward", ActionOp.RECV_F: "receive",
                 ActionOp.RECV_B: "receive", ActionOp.SEND_F: "send", ActionOp.SEND_B: "send"}


def run_actions(t: PipelineTrainer, inputs: Sequence[torch.Tensor],
                events: list[tuple[str, int, float, float]] | None = None, *, backward: bool = True,
                loss_scale: float = 1.0) -> torch.Tensor:
    """This rank's stage actions for one step on its rows of each input (`inputs`, input_rows');
    returns its summed loss summand (float64). `backward=False`: the forward actions only (an
    evaluation pass under torch.no_grad). The last stage seeds each micro-batch's backward
    with d(loss_scale * loss)/d(loss) = loss_scale, so every stage's gradients are scaled by
    it. `events` gets
    every action as (op, micro-batch, start, end), perf_counter seconds (CLOCK_MONOTONIC: one
    clock for every rank of a machine), to set against the predicted timeline, the setup
    (statistics, receives posted) first as ("setup", -1, start, end)."""
    events = [] if events is None else events
    clock = time.perf_counter()
    pipeline, s = t.pipeline, t.stage.index
    stats = statistics(t, inputs)
    if t.draws is not None:
        t.draws.make()
    received: dict[int, dict] = {}
    saved: dict[int, list[torch.Tensor]] = {}
    outs: dict[int, dict] = {}
    loss = torch.zeros((), dtype=torch.float64)
    last = s == len(pipeline.stages) - 1
    posted = {(a.boundary, a.micro_batch): post_receive(_link(t, a.boundary, a.micro_batch))
              for a in pipeline.actions[s] if a.op is ActionOp.RECV_F}  # all ahead (runtime.pipeline.transfer)
    now = time.perf_counter()
    events.append(("setup", -1, clock, now))
    clock = now
    for a in pipeline.actions[s]:
        m = a.micro_batch
        if t.draws is not None and a.op in (ActionOp.F, ActionOp.B):  # a recomputed block reads its own rows
            t.draws.offset = sum(pipeline.micro_batches[:m])
        if a.op is ActionOp.RECV_F:
            bd = pipeline.boundaries[a.boundary]
            received.setdefault(m, {})[(bd.tensor, bd.dst_layout)] = receive_forward(posted.pop((a.boundary, m)), True)
        elif a.op is ActionOp.F:
            program = t.programs[pipeline.micro_batches[m]]
            with autocast(t.autocast_dtype, t.device):
                result = program.module(*micro_inputs(t, inputs, m, received.pop(m, {}), stats))
            n_up = len(program.updates)
            _update_buffers(program, result[1:1 + n_up])
            outs[m] = dict(zip(program.outputs, result[1 + n_up:]))
            saved[m] = [result[0]] if last else []
            if last:
                loss = loss + result[0].detach().to(torch.float64)
        elif a.op is ActionOp.SEND_F:
            bd = pipeline.boundaries[a.boundary]
            x = outs[m][(bd.tensor, bd.src_layout)]
            if x.requires_grad:
                saved[m].append(send_forward(x, _link(t, a.boundary, m)))
            else:
                send_forward(x, _link(t, a.boundary, m))
        elif a.op is ActionOp.B and backward:
            roots = saved.pop(m)
            outs.pop(m, None)
            if roots:
                seeds = [r.new_zeros(0) for r in roots] if not last else \
                    [torch.full_like(roots[0], loss_scale) if loss_scale != 1.0 else None] + [None] * (len(roots) - 1)
                torch.autograd.backward(roots, seeds)
        now = time.perf_counter()
        events.append((a.op.value, m, clock, now))
        clock = now
    return loss


def _update_buffers(program: RankProgram, values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for name, value in zip(program.updates, values, strict=True):
            getattr(program.module, name).copy_(value)


# -- after the backward passes ----------------------------------------------------------------------

def sync_gradients(t: PipelineTrainer) -> None:
    """Replicated gradients inside the stage (their backward all_reduce), coalesced: one
    all-reduce of all of them per axis and dtype (one per parameter paid each its latency, 3 ms
    on a throttled worker's loopback); then the copies of parameters several stages hold,
    summed over the holders."""
    module = t.main.module
    plan = t.stage.plans[max(t.stage.plans)]
    wire = gradient_wire(t.plan) if t.dtype is None else None  # a twin reduces in its own dtype
    coalesced: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for p in t.main.params:
        grad = getattr(module, p.name).grad
        if p.sync is not None and grad is not None:
            coalesced.setdefault((p.sync.axis, grad.dtype), []).append(grad)
    for (axis, _), grads in coalesced.items():
        flat = reduced(lambda x: _all_reduced(x, t.groups.group(axis)), torch.cat([g.reshape(-1) for g in grads]), wire)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
    for p in t.main.params:
        if p.fqn in t.shared:
            param = getattr(module, p.name)
            node = plan.graph.node(p.name)
            whole = torch.zeros(node.out.shape, dtype=param.dtype)
            if param.grad is not None and MeshLayout(t.groups.mesh, p.layout).counts_once(t.groups.rank):
                local_slice(plan, p.name, p.layout, t.groups.rank, whole, t.groups.mesh).add_(param.grad)
            whole = reduced(lambda x: _all_reduced(x, t.shared[p.fqn]), whole, wire)
            param.grad = local_slice(plan, p.name, p.layout, t.groups.rank, whole, t.groups.mesh).clone()


def _all_reduced(x: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def first_holder(t: PipelineTrainer, fqn: str) -> bool:
    """Whether this stage counts a parameter in global sums (the first stage holding it)."""
    for stage in t.pipeline.stages:
        if any(n.fqn == fqn for n in next(iter(stage.plans.values())).graph.params):
            return stage.index == t.stage.index
    return False


def _square_norm(t: PipelineTrainer) -> torch.Tensor:
    """This rank's part of the squared global gradient norm: each element counted once, by the
    first replica of the first stage holding it."""
    module = t.main.module
    sq = torch.zeros((), dtype=torch.float64)
    for p in t.main.params:
        grad = getattr(module, p.name).grad
        counted = first_holder(t, p.fqn) and MeshLayout(t.groups.mesh, p.layout).counts_once(t.groups.rank)
        if grad is not None and counted:
            sq += grad.detach().to(torch.float64).pow(2).sum()
    return sq


def _clip(t: PipelineTrainer, norm: float, max_norm: float) -> None:
    scale = max_norm / (norm + 1e-6)
    grads = [p.grad for p in t.main.module.parameters() if p.grad is not None]
    if scale < 1.0 and grads:
        torch._foreach_mul_(grads, scale)


def clip_grad_norm(t: PipelineTrainer, max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)); returns the global ||g||
    (collective over the world)."""
    sq = _square_norm(t)
    dist.all_reduce(sq, group=t.world)
    norm = float(sq.sqrt())
    _clip(t, norm, max_norm)
    return norm


def clip_and_step(t: PipelineTrainer, loss: torch.Tensor, step: int) -> float:
    """The global norm and loss (one all-reduce), clipping and the update; NonFiniteError
    (runtime.train) before the update when either is not finite. Returns the global loss."""
    assert t.optimizer is not None and t.config is not None and t.scaler is not None, \
        "clip_and_step needs setup's trainer"
    scaling = t.scaler.is_enabled()
    if scaling:
        t.scaler.unscale_(t.optimizer)
    both = torch.stack([_square_norm(t), loss.to(torch.float64)])
    dist.all_reduce(both, group=t.world)
    norm = float(both[0].sqrt())
    if scaling:  # an overflow skips the step on every rank (the scaler) instead of stopping the run
        check_finite(step, loss=float(both[1]))
    else:
        check_finite(step, loss=float(both[1]), gradient_norm=norm)
    if t.config.max_grad_norm is not None and math.isfinite(norm):
        _clip(t, norm, t.config.max_grad_norm)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    return float(both[1])


def seconds_by_kind(events: list[tuple[str, int, float, float]]) -> dict[str, float]:
    """Seconds of each kind of action (ACTION_PHASES; receive: the wait for the data; and the
    setup), summed over run_actions' events: to set against the prediction's per-micro-batch
    forward and backward."""
    kind = {op.value: name for op, name in ACTION_PHASES.items()} | {"setup": "setup"}
    out: dict[str, float] = {}
    for op, _, start, end in events:
        out[kind[op]] = out.get(kind[op], 0.0) + end - start
    return out


def scale_of(t: PipelineTrainer) -> float:
    """The loss scaler's current scale (1 when disabled); scale() of a one initialises it on
    first use, as torch's AMP recipe's first scaler.scale(loss) does."""
    if t.scaler is None or not t.scaler.is_enabled():
        return 1.0
    return float(t.scaler.scale(torch.ones((), device=t.device)))


def train_step(t: PipelineTrainer, step: int, inputs: Sequence[torch.Tensor] | None = None) -> float:
    """One step (module docstring) on this rank's rows of each input of global batch `step`
    (`inputs`; by default spec_inputs'); returns the global loss. `t.phases` gets this rank's
    seconds of the actions (and of each kind of action, `actions.forward` ...), the gradient
    syncs, and the norm with the update; `t.events` the step ("step", -1, start, end) first,
    then its actions (run_actions), the gradient syncs ("sync") and the update ("update")."""
    with precision(t.dtype):
        start, events = time.perf_counter(), []
        loss = run_actions(t, spec_inputs(t, step) if inputs is None else inputs, events, loss_scale=scale_of(t))
        t.outbox.flush()
        actions = time.perf_counter()
        sync_gradients(t)
        synced = time.perf_counter()
        value = clip_and_step(t, loss, step)
    end = time.perf_counter()
    t.phases = {"actions": actions - start, "gradient_sync": synced - actions, "update": end - synced,
                **{f"actions.{k}": v for k, v in seconds_by_kind(events).items()}}
    t.events = [("step", -1, start, end), *events, ("sync", -1, actions, synced), ("update", -1, synced, end)]
    t.losses.append(value)
    return value


def local_parameters(t: PipelineTrainer) -> dict[str, tuple[int, str, torch.Tensor]]:
    """fqn -> (stage, storage layout, this rank's slice)."""
    module = t.main.module
    return {p.fqn: (t.stage.index, str(p.layout), getattr(module, p.name).detach().cpu()) for p in t.main.params}


def local_buffers(t: PipelineTrainer) -> dict[str, torch.Tensor]:
    """The model's buffers by name, whole: this stage's (stored whole, updated by training) over
    the initial values."""
    out = dict(t.state)
    module = t.main.module
    for node in t.stage.plans[max(t.stage.plans)].graph.nodes:
        if node.op == "buffer" and node.value is None and hasattr(module, node.name):
            out[node.fqn] = getattr(module, node.name).detach().cpu()
    return out


def assemble(plan: Plan, per_rank: Sequence[dict[str, tuple[int, str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's slices, each from the first stage holding it."""
    pipeline = plan.pipeline
    assert pipeline is not None
    owner = {fqn: min(i for params in per_rank for f, (i, _, _) in params.items() if f == fqn)
             for params in per_rank for fqn in params}
    out: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(per_rank):
        stage = pipeline.stage_of(rank)
        splan, mesh = stage.plans[max(stage.plans)], stage_mesh(stage)
        for fqn, (index, layout, value) in params.items():
            if index != owner[fqn]:
                continue
            node = next(n for n in splan.graph.params if n.fqn == fqn)
            whole = out.setdefault(fqn, torch.full(node.out.shape, float("nan"), dtype=value.dtype))
            local_slice(splan, node.name, Layout.parse(layout), rank, whole, mesh).copy_(value)
    return out
