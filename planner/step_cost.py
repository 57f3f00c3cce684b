"""A program's step as composed cost terms: the gradient buckets' all-reduces overlapped with
the backward pass (an Overlap of cost_models.terms), and the choice of the bucket cap.

The runtime (runtime.grad_sync) launches bucket b's all-reduce asynchronously as soon as its
last gradient is ready, in bucket order, and waits for all of them after the backward pass.
Each instruction's form (evaluate.instruction_term) is split into a forward half and a
backward half: a compute op by its forward share of FLOPs, phi = flops_fwd / (flops_fwd +
flops_bwd) (1/3 when the counter has none); a forward collective whose gradient flows by half
(its adjoint is the same collective backwards); an SFB weight's factor gathers are backward
work; parameter updates come after the backward. The backward runs the program i = N..1 in
reverse; bucket b (b = 1..B, launch order, instruction_set.sync) is ready once the backward
has gone back past the first use p_b of its parameters, after

    R_b = sum_{i >= p_b} c_i          of backward work (c_i: the backward halves),

and its all-reduce takes S_b (cost_models.comm at the bucket's bytes, variant and axis; a ZeRO-2
bucket's reduce-scatter onto the state rows, at the state ratios q). One
serial stream, e_b = max(e_{b-1}, R_b) + S_b, unrolls (max-plus) to

    T_bwd = max( R_1..N + gamma sum_b S_b ,  max_b ( R_b + sum_{b' >= b} S_b' ) )

where gamma in [0, 1] is the share of a transfer's time that the compute loses to it: each
device kind's `transfer_cpu_share` (instruction_set.cluster), measured by `hetsynth profile`
(profiling.profiler.transfer_cpu_share). On CPU workers gloo's transfer threads run inside the
compute's own CPU quota (gamma near 1: the overlap hides little, and many small buckets cost
their latency on the compute too); on GPUs the bytes move beside the compute (gamma near 0).
Each message also costs m_i (transfer_cpu_us_per_message, the same measurement): a bucket's
all-reduce is k_b messages (instruction_set.sync.sync_messages: ring 1, hierarchical 3
stages; a ZeRO-2 reduce-scatter bucket 1 padded, g grouped), so the whole backward's branch adds sum_b (gamma_i S_b + m_i k_b), a compute form per
device (`busy` counts it as compute): many small buckets pay m_i each.
This is exactly an Overlap of B + 1 Series: the whole backward, and for each bucket the
backward up to its readiness followed by its and the later buckets' all-reduces. The
backward's halves are cut into segments at the readiness points, and every branch reuses the
same segment objects, so the sharding-ratio LP (planner.ratios) lowers each distinct form
once and the overlap as one epigraph variable: the LP sees the overlap, as the prediction
does. The step is

    T = sum_i f_i + T_bwd + sum_p update_p + scalars

(f_i the forward halves; scalars: the all-reduce of the clipping norm, only when some
gradient is sharded; the loss all-reduce is issued after the forward and hidden).

The bucket shape (instruction_set.sync.BucketShape): each cap of CAPS_BYTES, one bucket for
everything, torch DDP's own shape (a 1 MiB first bucket, then 25 MiB; DDP_SHAPE), and each of
these with a small last bucket (LAST_CAPS_BYTES) is costed with this form at the final ratios;
the fastest wins (ties: larger caps, fewer collectives) and is recorded in the plan with every
candidate's prediction. The last bucket is the one ready only when the backward ends: its
all-reduce is never hidden, so the tail of the step is at least S_B. Capping it alone keeps
that tail short without paying the per-message cost m_i k_b on every earlier bucket, which a
small cap everywhere would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetsynth.cost_models.compute import FREE_OPS
from hetsynth.cost_models.linear_cost import LinearCost
from hetsynth.cost_models.memory import MemoryTerm
from hetsynth.cost_models.terms import Cost, Form, Overlap, Series, Shares, ShareKind, Term, seconds
from hetsynth.instruction_set.kinds import Category, Phase
from hetsynth.instruction_set.kinds import kind as instruction_kind
from hetsynth.instruction_set.local import whole_draw_bytes
from hetsynth.instruction_set.plan import Prediction
from hetsynth.instruction_set.program import COLLECTIVES, FUSED_MATMULS, Instruction
from hetsynth.instruction_set.training_state import GATHERED_AFTER_STEP, SCATTER_VARIANTS, SHARDED_STATES, TrainingState
from hetsynth.instruction_set.sync import (DEFAULT_BUCKET_CAP_BYTES, ONE_BUCKET, BucketShape, GradBucket, GradientSync,
                                  assign_buckets, sync_messages)
from hetsynth.planner import fusions  # noqa: F401  (registers the fused instructions' cost terms)
from hetsynth.planner.evaluate import first_input_layouts, instruction_term, predict
from hetsynth.planner.problem import Problem
from hetsynth.planner.recompute import recompute_memory

CAPS_BYTES = (2**18, 2**20, 4 * 2**20, 25 * 2**20)  # 256 KiB up to torch DDP's 25 MiB cap
LAST_CAPS_BYTES = (2**18, 2**19, 2**20)              # a small last bucket: 256 KiB to 1 MiB
DDP_SHAPE = BucketShape(25 * 2**20, 2**20)  # torch DDP's default: a 1 MiB first bucket, then 25 MiB


def plain_shapes() -> list[BucketShape]:
    """The shapes without a last cap, in order of preference among equal predictions."""
    return [BucketShape(c) for c in (ONE_BUCKET, *reversed(CAPS_BYTES))] + [DDP_SHAPE]


def with_last_caps(shape: BucketShape) -> list[BucketShape]:
    """`shape` with each smaller last cap of LAST_CAPS_BYTES."""
    return [shape._replace(last=last) for last in LAST_CAPS_BYTES if last < shape.cap]


def _scaled(form: Form, factor: float) -> Form | None:
    if factor <= 0.0:
        return None
    return form if factor == 1.0 else Form(form.cost.scaled(factor), form.shares, form.category, form.devices)


@dataclass(frozen=True)
class TransferCpu:
    """What a transfer in flight takes from each device class's compute: a share of its time
    (gamma_i) and seconds per message (m_i), the kinds' measured figures (module docstring)."""

    share: tuple[float, ...]
    per_message_s: tuple[float, ...]

    @staticmethod
    def of(pb: Problem) -> "TransferCpu":
        return TransferCpu(tuple(k.transfer_cpu_share for k in pb.kinds),
                           tuple(k.transfer_cpu_us_per_message * 1e-6 for k in pb.kinds))

    def loss(self, sync: Form, messages: int) -> Form | None:
        """gamma_i S_b + m_i k_b on each device, a compute form (None when all zero)."""
        a = tuple(g * x + m * messages for g, m, x in zip(self.share, self.per_message_s, sync.cost.a, strict=True))
        if not any(x > 0.0 for x in a):
            return None
        return Form(LinearCost(a, (0.0,) * len(a)), Shares(sync.shares.values, ShareKind.NONE), Category.COMPUTE,
                    sync.devices)


def forward_share(pb: Problem, ins: Instruction) -> float:
    """The part of an instruction's time spent in the forward pass (module docstring)."""
    if ins.kind == "compute":
        node = pb.graph.node(ins.node)
        total = node.flops_fwd + node.flops_bwd
        return node.flops_fwd / total if total > 0 else 1.0 / 3.0
    if ins.kind == "sfb":
        return 0.0
    if ins.kind in COLLECTIVES and pb.requires_grad(ins.tensor):
        return 0.5
    return 1.0


def backward_share(pb: Problem, ins: Instruction) -> float:
    """The part of an instruction's time spent in the backward pass: all of it again for an
    instruction of a recomputed block (its forward runs again there; planner.recompute)."""
    return 1.0 if ins.recompute else 1.0 - forward_share(pb, ins)


def bucket_sync(pb: Problem, bucket: GradBucket) -> Form:
    """S_b: the bucket's all-reduce (or a ZeRO-2 bucket's reduce-scatter onto the rows at the
    state ratios q), a constant in the ratios; its bytes as the gradients travel (bfloat16 halves
    them: ReferenceGraph.grad_reduce_scale)."""
    wire = float(bucket.nbytes) * pb.graph.grad_reduce_scale
    if pb.comm.group_size(bucket.axis) == 1:
        seconds_ = 0.0
    elif bucket.kind == "reduce_scatter":
        q = pb.state_shares
        seconds_ = pb.comm.cost("reduce_scatter", bucket.variant, wire, bucket.axis, q).at(q)
    else:
        seconds_ = pb.comm.cost("all_reduce", bucket.variant, wire, bucket.axis).at(
            (1.0 / pb.width,) * pb.width)
    return Form(LinearCost.constant(seconds_, pb.width), Shares((1.0,) * pb.width, ShareKind.NONE),
                Category.COMMUNICATION)


def is_bucketed(ins: Instruction) -> bool:
    return ins.kind == "all_reduce" and ins.phase == Phase.BACKWARD


def _split(pb: Problem, program: Sequence[Instruction]) -> tuple[list[Term], list[Form | None], list[Term]]:
    """(forward-half terms with the instructions' memory, backward half per instruction,
    post-backward terms: the parameter updates)."""
    x_layouts = first_input_layouts(program)
    zero3 = zero3_all_forms(pb, program)
    forward: list[Term] = []
    backward: list[Form | None] = []
    post: list[Term] = []
    for ins in program:
        term = None if is_bucketed(ins) else instruction_term(pb, ins, x_layouts)
        backward.append(None)
        if term is None:
            continue
        assert isinstance(term.time, Form) or ins.kind in FUSED_MATMULS or ins.kind == "compute", \
            "instruction terms are single forms"
        if ins.kind == "param":
            post.append(term)
            if ins.state == TrainingState.ZERO3:  # gathered at each use, regathered and reduce-scattered in backward
                ahead_form, backward[-1] = zero3[ins.tensor]
                forward.append(Term(ahead_form))
            continue
        if ins.kind in FUSED_MATMULS:  # Series(forward, backward): planner.fusions
            ahead_cost, backward[-1] = term.time.parts  # type: ignore[union-attr]
            forward.append(Term(ahead_cost, term.memory, term.memory_at))
            continue
        ahead, backward[-1] = _halves(pb, ins, term.time)
        memory = None if ins.recompute else term.memory  # a recomputed block keeps its inputs only
        if ahead is not None or memory is not None:
            forward.append(Term(ahead if ahead is not None else Series(()), memory,
                                term.memory_at if memory is not None else None))
    for working in (zero3_working_set(pb, program), op_working_set(pb, program)):
        if working is not None:
            forward.append(Term(Series(()), working, Shares((1.0,) * pb.width, ShareKind.NONE)))
    return forward, backward, post


def _halves(pb: Problem, ins: Instruction, time: Cost) -> tuple[Cost | None, Cost | None]:
    """(forward, backward) parts of an instruction's time: a form scaled by its forward and
    backward shares; an op with collectives inside (Problem.op_communication: Series(compute,
    communication)) splits its compute by FLOPs and its communication half and half (a
    collective and its adjoint)."""
    if isinstance(time, Form):
        return _scaled(time, forward_share(pb, ins)), _scaled(time, backward_share(pb, ins))
    assert isinstance(time, Series) and all(isinstance(p, Form) for p in time.parts), ins.describe()
    halves = [(_scaled(p, forward_share(pb, ins)), _scaled(p, backward_share(pb, ins)))
              if p.category is not Category.COMMUNICATION else
              ((p, None) if not pb.requires_grad(pb.graph.node(ins.node).inputs[0]) else
               (_scaled(p, 0.5), _scaled(p, 1.0 if ins.recompute else 0.5))) for p in time.parts]
    ahead, behind = (tuple(h[i] for h in halves if h[i] is not None) for i in (0, 1))
    return (Series(ahead) if ahead else None), (Series(behind) if behind else None)


def _unsaved_bytes(pb: Problem, ins: Instruction, saved: frozenset[str]) -> list[float]:
    """Bytes on each device of the tensors `ins` reads and writes, live at once while it runs,
    that nothing else counts: activations in the layouts it reads them (a fused ag_matmul's
    gathered input) and what it writes, but not the tensors some op saves (the saved part),
    parameters, buffers and gradients (state; a gradient's all-reduce runs in place in its
    bucket), nor a view's output (its input's storage). A random draw adds its whole tensor
    (instruction_set.local.whole_draw_bytes) on every device."""
    state = ("param", "buffer")
    if ins.runs_op:
        node = pb.graph.node(ins.node)
        read = [(name, layout) for name, layout in zip(node.inputs, ins.inputs) if pb.graph.node(name).op not in state]
        written = [] if node.target in FREE_OPS else [(ins.tensor, ins.layout)]
    elif ins.kind in COLLECTIVES and ins.src is not None and pb.graph.node(ins.tensor).op not in state:
        read, written = [(ins.tensor, ins.src)], [(ins.tensor, ins.layout)]
    else:
        return [0.0] * pb.width
    drawn = float(whole_draw_bytes(pb.graph, node)) if ins.runs_op else 0.0  # every rank draws it whole
    total = [drawn] * pb.width
    for name, layout in (*read, *written):
        if name in saved:
            continue
        nbytes = float(pb.meta(name).nbytes)
        for i, share in enumerate(pb.shares(name, layout)):
            total[i] += nbytes * share
    return total


def op_working_set(pb: Problem, program: Sequence[Instruction]) -> MemoryTerm | None:
    """The largest transient of one instruction, per device: on top of the state and the
    tensors saved for the backward pass (all counted as held at once), an op holds its inputs
    and output together while it runs, and those that no op saves are counted nowhere else (the
    logits an all-gather makes whole for a softmax's maximum, a fused matmul's gathered input):

        working_i = max_v sum_{t read or written by v, t not saved} bytes_t * sigma_t,i

    at the problem's ratios (sigma_t,i: t's share on device i in the layout v reads or writes it;
    1 for whole tensors; a view's output is its input's storage, 0). A transient, in the total
    memory only, and a constant for the ratio LP (the largest op can change with the ratios; the
    prediction re-evaluates it at the plan's). Not counted: what an op's kernel allocates inside,
    an earlier activation still awaiting its last use, and the saved tensors of recomputed blocks
    (their forward runs again in the backward, beside the gradients)."""
    saved = pb.saved_tensors()
    best = [0.0] * pb.width
    for ins in program:
        for i, b in enumerate(_unsaved_bytes(pb, ins, saved)):
            best[i] = max(best[i], b)
    if not any(best):
        return None
    return MemoryTerm(tuple(best), (0.0,) * pb.width, "working")


def zero3_working_set(pb: Problem, program: Sequence[Instruction]) -> MemoryTerm | None:
    """The largest ZeRO-3 parameter whole twice (W and dW while one use runs; transient: a
    working set, in the total memory only), or None without ZeRO-3."""
    sizes = [float(pb.meta(i.tensor).nbytes) for i in program if i.kind == "param" and i.state == TrainingState.ZERO3]
    if not sizes:
        return None
    return MemoryTerm((2.0 * max(sizes),) * pb.width, (0.0,) * pb.width, "working")


def zero3_uses(pb: Problem, program: Sequence[Instruction]) -> dict[str, int]:
    """Parameter -> how many compute instructions read it (each gathers a ZeRO-3 one:
    runtime.zero3), in one pass over the program."""
    uses: dict[str, int] = {}
    for i in program:
        if i.kind == "compute":
            for name in pb.graph.node(i.node).inputs:
                uses[name] = uses.get(name, 0) + 1
    return uses


def zero3_all_forms(pb: Problem, program: Sequence[Instruction]) -> dict[str, tuple[Form, Form]]:
    """Each ZeRO-3 parameter's communication (forward, backward), at the state ratios q, k
    uses: forward k all-gathers; backward k all-gathers again and k reduce-scatters of the
    gradient onto the rows (synchronous, on the backward's own thread). The variants and use
    counts are the program's, found once (per parameter they made planning quadratic)."""
    tensors = [i.tensor for i in program if i.kind == "param" and i.state == TrainingState.ZERO3]
    if not tensors:
        return {}
    q, uses = pb.state_shares, zero3_uses(pb, program)
    gather_variant, scatter_variant = state_gather_variant(pb, program), state_scatter_variant(pb, program)
    shares = Shares(q, ShareKind.FIXED)
    out: dict[str, tuple[Form, Form]] = {}
    for tensor in tensors:
        nbytes, k = float(pb.meta(tensor).nbytes), uses.get(tensor, 0)
        gather = pb.comm.cost("all_gather", gather_variant, nbytes, "all", q).scaled(k)
        scatter = pb.comm.cost("reduce_scatter", scatter_variant, nbytes * pb.graph.grad_reduce_scale, "all",
                               q).scaled(k)
        out[tensor] = (Form(gather, shares, Category.COMMUNICATION),
                       Form(gather + scatter, shares, Category.COMMUNICATION))
    return out


def backward_overlap(backward: Sequence[Form | None], ready: Sequence[int], sync: Sequence[Form],
                     lost: Sequence[Form | None] = ()) -> Cost:
    """T_bwd as an Overlap (module docstring): `backward[i]` the backward half of instruction
    i, `ready[b]` the first instruction whose backward completes bucket b, `lost[b]` the
    compute bucket b's transfer takes (TransferCpu.loss; none: nothing)."""
    cuts = sorted(set(ready) | {0, len(backward)}, reverse=True)
    segments = {start: Series(tuple(f for f in backward[start:end] if f is not None))
                for end, start in zip(cuts, cuts[1:])}
    done = {start: tuple(segments[s] for s in sorted(segments, reverse=True) if s >= start) for start in cuts}
    whole: tuple[Cost, ...] = done[0] + tuple(f for f in lost if f is not None)
    branches = [Series(whole)]
    for b, start in enumerate(ready):
        branches.append(Series(done[start] + tuple(sync[b:])))
    return Overlap(tuple(branches))


def program_terms(pb: Problem, program: Sequence[Instruction],
                  buckets: Sequence[GradBucket] | None = None,
                  split: tuple[list[Term], list[Form | None], list[Term]] | None = None) -> list[Term]:
    """The step's terms: forward halves, the overlapped backward, updates, scalars (buckets:
    assigned at the default cap when not given; `split`: _split(pb, program) if known)."""
    if buckets is None:
        buckets = assign_buckets(pb.graph, program, param_shards(pb, program), DEFAULT_BUCKET_CAP_BYTES,
                                 scatter_variant=state_scatter_variant(pb, program))
    forward, backward, post = split or _split(pb, program)
    ready = ready_indices(program, buckets)
    sync = [bucket_sync(pb, b) for b in buckets]
    overlap = Term(backward_overlap(backward, ready, sync, transfer_losses(pb, buckets, sync)))
    return forward + [overlap] + post + state_gather_terms(pb, program) + scalar_terms(pb, program) + \
        recompute_memory(pb, program)


def state_gather_terms(pb: Problem, program: Sequence[Instruction]) -> list[Term]:
    """The all-gather after the step that brings every device the ZeRO-1/2 parameters' updated
    rows (runtime.zero: one all-gather of every rank's rows, at the state ratios q)."""
    nbytes = state_gather_bytes(pb, program)
    if nbytes == 0.0:
        return []
    q = pb.state_shares
    cost = pb.comm.cost("all_gather", state_gather_variant(pb, program), nbytes, "all", q)
    return [Term.leaf(cost, Shares(q, ShareKind.FIXED), Category.COMMUNICATION)]


def state_gather_bytes(pb: Problem, program: Sequence[Instruction], states=GATHERED_AFTER_STEP) -> float:
    return float(sum(pb.meta(i.tensor).nbytes for i in program if i.kind == "param" and i.state in states))


def state_gather_variant(pb: Problem, program: Sequence[Instruction]) -> str:
    """The all-gather variant the model predicts fastest for the ZeRO rows at the state ratios
    (the post-step gather of ZeRO-1/2, or ZeRO-3's gathers)."""
    nbytes, q = state_gather_bytes(pb, program, SHARDED_STATES), pb.state_shares
    return min(instruction_kind("all_gather").variants,
               key=lambda v: pb.comm.cost("all_gather", v, nbytes, "all", q).at(q))


def state_scatter_variant(pb: Problem, program: Sequence[Instruction]) -> str:
    """The reduce-scatter variant the model predicts fastest for the ZeRO-2 gradients onto
    the rows at the state ratios (of those the bucketed sync issues: SCATTER_VARIANTS)."""
    nbytes = state_gather_bytes(pb, program, {TrainingState.ZERO2, TrainingState.ZERO3}) * pb.graph.grad_reduce_scale
    if nbytes == 0.0:
        return SCATTER_VARIANTS[0]
    q = pb.state_shares
    allowed = pb.restrictions.variants.get("reduce_scatter", SCATTER_VARIANTS)
    return min([v for v in SCATTER_VARIANTS if v in allowed] or SCATTER_VARIANTS,
               key=lambda v: pb.comm.cost("reduce_scatter", v, nbytes, "all", q).at(q))


def transfer_losses(pb: Problem, buckets: Sequence[GradBucket],
                    sync: Sequence[Form] | None = None) -> list[Form | None]:
    """The compute each bucket's transfer takes (TransferCpu.loss; `sync`: the buckets'
    bucket_sync forms if known)."""
    cpu = TransferCpu.of(pb)
    sync = sync if sync is not None else [bucket_sync(pb, b) for b in buckets]
    return [cpu.loss(s, sync_messages(b, pb.comm.group_size(b.axis))) for s, b in zip(sync, buckets, strict=True)]


def ready_indices(program: Sequence[Instruction], buckets: Sequence[GradBucket]) -> list[int]:
    """p_b: the instruction whose backward completes bucket b (the first use of its parameters)."""
    first: dict[str, int] = {}
    for i, ins in enumerate(program):
        if ins.runs_op:
            first.setdefault(ins.node, i)
    return [first.get(b.ready_after, 0) for b in buckets]


def scalar_terms(pb: Problem, program: Sequence[Instruction]) -> list[Term]:
    """The clipping norm's all-reduce, only when some parameter or gradient is sharded (a
    ZeRO-2 gradient lives on the rows; runtime.train)."""
    if not any(i.kind == "param" and (i.layout.is_shard or i.state in (TrainingState.ZERO2, TrainingState.ZERO3))
               for i in program):
        return []
    one = pb.comm.cost("all_reduce", "ring", 8.0).at((1.0 / pb.width,) * pb.width)
    return [Term.leaf(LinearCost.constant(one, pb.width), Shares((1.0,) * pb.width, ShareKind.NONE),
                      Category.COMMUNICATION)]


def param_shards(pb: Problem, program: Sequence[Instruction]) -> dict[str, dict[str, dict[int, tuple[int, ...]]]]:
    """Local lengths of the parameters' storage layouts (what bucket sizes need)."""
    return {i.tensor: {i.layout: pb.lengths.rank_lengths(i.tensor, i.layout)}
            for i in program if i.kind == "param" and i.layout.is_shard}


def choose_buckets(pb: Problem, program: Sequence[Instruction],
                   forced: BucketShape | None = None) -> tuple[GradientSync, list[Term]]:
    """The bucket shape the model predicts fastest (or `forced`), its buckets and terms: the
    plain shapes first, then the best of them with each small last bucket."""
    shards, split = param_shards(pb, program), _split(pb, program)  # both independent of the shape
    scatter = state_scatter_variant(pb, program)
    tried: dict[BucketShape, tuple[tuple[GradBucket, ...], list[Term], float]] = {}

    def cost(shapes: Sequence[BucketShape]) -> BucketShape:
        for shape in shapes:
            buckets = assign_buckets(pb.graph, program, shards, *shape, scatter_variant=scatter)
            if not any(buckets == t[0] for t in tried.values()):  # else the same buckets as a costed shape
                terms = program_terms(pb, program, buckets, split)
                memo: dict[int, float] = {}  # parts the terms share (bucket syncs) evaluated once
                tried[shape] = (buckets, terms, sum(seconds(t.time, memo) for t in terms))
        return min(tried, key=lambda s: (round(tried[s][2], 9), len(tried[s][0])))

    best = cost([forced]) if forced else cost(with_last_caps(cost(plain_shapes())))
    return GradientSync(bucket_cap_bytes=best.cap, first_bucket_cap_bytes=best.first,
                        last_bucket_cap_bytes=best.last, buckets=tried[best][0],
                        chosen_from={s.label(): t[2] for s, t in tried.items()}), tried[best][1]


def predict_program(pb: Problem, program: Sequence[Instruction],
                    forced: BucketShape | None = None) -> tuple[Prediction, GradientSync]:
    """The prediction of a program with its gradient buckets at the shape the model prefers
    (or `forced`)."""
    sync, terms = choose_buckets(pb, program, forced)
    return predict(pb, terms), sync


__all__ = ["CAPS_BYTES", "DDP_SHAPE", "LAST_CAPS_BYTES", "plain_shapes", "with_last_caps", "backward_overlap", "backward_share", "bucket_sync", "choose_buckets", "forward_share", "is_bucketed",
           "ready_indices", "scalar_terms", "state_gather_terms", "state_gather_variant", "state_scatter_variant", "zero3_all_forms", "zero3_uses", "zero3_working_set",
           "param_shards", "predict_program", "program_terms", "TransferCpu"]
