"""What the planner plans: a model (its sizes: models.py), a batch and a layout (how ranks share the work).

A layout is dp x pp x tp ranks (Narayanan et al. 2021's PTD-P: tp innermost, then dp, then pp, as
DeviceMesh lays them out), a ZeRO stage over dp, recomputation, micro-batches and a pipeline
schedule. check refuses an impossible one with the constraint it breaks and the nearest valid
choices; layouts enumerates every valid one for a world size (what --search ranks).

The MLP's strategies map onto layouts: ddp = dp N (ZeRO 0), zero1/2/3 = ZeRO stage s over dp N,
pipeline = pp N/D x dp D; local_sgd is DDP whose all-reduce of Ψ parameters happens every k steps.
"""
from dataclasses import dataclass, field, fields as dataclass_fields

PRECISIONS = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}     # bytes per parameter / activation value
MIXED = ("fp16", "bf16")                                        # low precision + fp32 master weights
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "pipedream_2bw")


class LayoutError(ValueError):
    """An impossible layout; the message names the constraint and the nearest valid choices."""


@dataclass(frozen=True)
class Layout:
    world: int = 1
    batch_size: int = 1                 # global, all replicas together
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0                       # ZeRO stage over dp (0: DDP)
    sequence_parallel: bool = False
    recompute: str = "none"             # none | selective | full
    schedule: str = "1f1b"
    microbatches: int = 1               # per replica and step
    chunks: int = 1                     # virtual stages per rank (interleaved_1f1b)
    precision: str = "fp32"
    optimizer: str = "adam"             # adam | adamw | sgd (momentum)
    offload: bool = False               # optimizer state (and under ZeRO-3 the shards) on the host
    offload_activations: bool = False
    local_sgd_every: int = 0            # mlp --strategy local_sgd: average parameters every k steps
    bucket_cap_mb: float = 25.0
    threads: int = 0                    # BLAS threads per rank on a CPU (0: as the jobs take them, see time.py)
    cp: int = 1                         # context parallelism: the sequence over cp ranks (plan/context.py)
    cp_method: str = "ring"             # ring (zig-zag: 2cp chunks) | ulysses
    ep: int = 1                         # expert parallelism: E/ep experts per rank, ep | dp
    moe_load: float = 1.0               # the busiest rank's experts' rows over its routed rows (1: even, dropless)
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def replica_rows(self):
        """The heaviest replica's rows: a batch that dp does not divide gives the first replicas one more."""
        return -(-self.batch_size // self.dp)

    @property
    def zero_ranks(self):
        """The ranks ZeRO shards a stage's states over: its dp x cp replicas (GPT3D's; a cp rank holds the same
        parameters and takes its share of every row)."""
        return self.dp * self.cp

    @property
    def micro_batch_size(self):
        """The largest micro-batch: the jobs cut a batch that dp x micro-batches do not divide unevenly."""
        return -(-self.batch_size // (self.dp * self.microbatches))

    @property
    def mixed(self):
        return self.precision in MIXED

    def describe(self):
        parts = [f"dp{self.dp}", f"pp{self.pp}", f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp} {self.cp_method}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f" load {self.moe_load:g}" if self.moe_load != 1 else ""))
        if self.zero:
            parts.append(f"zero{self.zero}" + ("+offload" if self.offload else ""))
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute}")
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f" v={self.chunks}" if self.chunks > 1 else ""))
        parts.append(f"m={self.microbatches} x b={self.micro_batch_size}")
        return " ".join(parts)

    def fields(self):
        """The constructor's arguments (to build a variant: ``Layout(**{**l.fields(), "dp": 2})``)."""
        return {f.name: getattr(self, f.name) for f in dataclass_fields(self)}

    def as_dict(self):
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "zero": self.zero, "sequence_parallel":
                self.sequence_parallel, "recompute": self.recompute, "microbatches": self.microbatches,
                "micro_batch_size": self.micro_batch_size, "schedule": self.schedule, "chunks": self.chunks,
                "offload": self.offload, "offload_activations": self.offload_activations,
                "precision": self.precision, "batch_size": self.batch_size, "world": self.world, "threads": self.threads,
                "cp": self.cp, "cp_method": self.cp_method, "ep": self.ep, "moe_load": self.moe_load}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value, valid, count=2):
    """The ``count`` valid choices closest to ``value`` (ties: the smaller), in increasing order."""
    return sorted(sorted(set(valid), key=lambda v: (abs(v - value), v))[:count])


def _choices(values):
    return " or ".join(str(v) for v in values)


def empty_microbatches(microbatches, batch_size, dp):
    """Why m micro-batches per replica leave some empty on every replica, or None: a replica's batch is cut into
    m (a row apart where they do not divide it), so past the largest replica's ceil(batch / dp) rows each further
    one has none. The jobs and check() refuse it; a batch that dp or m does not divide stays exact."""
    rows = -(-batch_size // dp)
    if microbatches <= rows:
        return None
    return (f"--microbatches {microbatches} exceeds the {rows} rows of the largest replica's batch (--batch-size "
            f"{batch_size} over {dp} data-parallel replica(s)): micro-batches beyond them would be empty")


def check(model, layout):
    """Raise LayoutError naming the first constraint the layout breaks and the nearest valid choices."""
    d, p, t, n, c = layout.dp, layout.pp, layout.tp, layout.world, layout.cp
    if min(d, p, t, n, c, layout.ep, layout.microbatches, layout.chunks, layout.batch_size) < 1:
        raise LayoutError("dp, pp, tp, cp, ep, world, micro-batches, chunks and the batch size must all be >= 1")
    if c > 1 or layout.ep > 1:
        if model.kind != "gpt":
            raise LayoutError("--cp and --ep are axes of the GPT job: --cp 1 --ep 1 for the mlp job and plan params")
        if d * p * t * c != n:
            raise LayoutError(f"dp x pp x tp x cp must equal the world size: {d} x {p} x {t} x {c} = {d * p * t * c} "
                              f"!= --world {n} (or --world {d * p * t * c})")
        t = t * c                         # the world check below holds; the cp ranks sit beside tp's
    if d * p * t != n:
        fits = [(dd, n // (dd * t)) for dd in divisors(n // t)] if n % t == 0 else []
        hint = (f"with --tp {t} and --world {n}: (dp, pp) in {fits}" if fits else
                f"--tp {t} does not divide --world {n}; nearest valid --tp: {_choices(_nearest(t, divisors(n)))}")
        raise LayoutError(f"dp x pp x tp must equal the world size: {d} x {p} x {t} = {d * p * t} != --world {n} "
                          f"({hint}; or --world {d * p * t})")
    empty = empty_microbatches(layout.microbatches, layout.batch_size, d)     # as the jobs refuse it
    if empty:
        raise LayoutError(empty)
    if layout.precision not in PRECISIONS:
        raise LayoutError(f"unknown precision {layout.precision!r}: expected one of {sorted(PRECISIONS)}")
    if layout.zero not in (0, 1, 2, 3):
        raise LayoutError(f"--zero must be 0, 1, 2 or 3, got {layout.zero}")
    if layout.zero >= 2 and p > 1 and model.kind != "gpt":     # GPT3D's ZeRO keeps the full gradient to the end
        raise LayoutError(f"ZeRO-{layout.zero} with pp = {p}: sharded gradients (and parameters) cannot accumulate "
                          f"over a pipeline's micro-batches (DeepSpeed refuses it too); nearest valid: --zero 1, "
                          f"or --pp 1")
    if layout.schedule not in SCHEDULES:
        raise LayoutError(f"unknown schedule {layout.schedule!r}: expected one of {SCHEDULES}")
    if layout.schedule == "zbv" and layout.chunks != 2:
        raise LayoutError(f"zbv is a V of 2 chunks per rank: --chunks 2 (or leave it out), not {layout.chunks}")
    if layout.chunks > 1 and layout.schedule not in ("interleaved_1f1b", "zbv"):
        raise LayoutError(f"--chunks {layout.chunks} needs --schedule interleaved_1f1b (nearest valid: --chunks 1)")
    if layout.schedule == "interleaved_1f1b" and p > 1 and layout.microbatches % p:
        raise LayoutError(f"interleaved_1f1b needs the micro-batches to be a multiple of pp = {p}: "
                          f"--microbatches {layout.microbatches} -> nearest valid "
                          f"{_choices(_nearest(layout.microbatches, [p * k for k in range(1, layout.microbatches // p + 3)]))}")
    if model.kind == "gpt":
        _check_gpt(model, layout)
    elif model.kind == "mlp":
        if t > 1 or layout.sequence_parallel:
            raise LayoutError("the MLP job has no tensor parallelism: --tp 1 (nearest valid)")
        linears = len(model.linears())
        if linears < p * layout.chunks:
            # the MLP job's stages are world / --dp (it has no --pp): fewer stages is more replicas
            raise LayoutError(f"{linears} Linear layers cannot fill pp x chunks = {p * layout.chunks} pipeline stages "
                              f"(each needs one): --layers {p * layout.chunks - 1} or more, or --dp "
                              f"{_choices(_nearest(d, [n // q for q in divisors(n) if q * layout.chunks <= linears]))}"
                              f" (pp = world / dp)")
    elif model.kind == "params" and (p > 1 or t > 1):
        raise LayoutError("plan params predicts model states over data parallelism only: --pp 1 --tp 1")
    return layout


def _check_gpt(model, layout):
    t, p, v = layout.tp, layout.pp, layout.chunks
    if p > 1 and layout.schedule in ("naive", "pipedream_2bw"):
        raise LayoutError(f"the GPT job's pipeline runs gpipe, 1f1b, interleaved_1f1b, zb_h1 or zbv, not "
                          f"{layout.schedule} (the MLP job runs every schedule)")
    if model.n_embd % model.n_head:
        raise LayoutError(f"--n-embd {model.n_embd} is not divisible by --n-head {model.n_head}: nearest valid "
                          f"--n-head {_choices(_nearest(model.n_head, divisors(model.n_embd)))}")
    if model.n_head % t:
        raise LayoutError(f"heads not divisible by tp: --n-head {model.n_head} over --tp {t} (each rank takes whole "
                          f"heads); nearest valid --tp: {_choices(_nearest(t, divisors(model.n_head)))} (the divisors of {model.n_head})")
    if model.n_layer + 2 < p * v:          # as GPT3D: embedding + blocks + head, at least one layer per stage
        raise LayoutError(f"{model.n_layer} blocks + embedding + head = {model.n_layer + 2} layers cannot fill pp x "
                          f"chunks = {p} x {v} = {p * v} pipeline stages; nearest valid --n-layer: {p * v - 2} or more")
    if layout.sequence_parallel and t == 1:
        raise LayoutError("--sequence-parallel needs --tp > 1")
    if layout.sequence_parallel and (model.block_size // layout.cp) % t:      # a cp rank's positions, split by tp
        step, per_cp = layout.cp * t, f" / --cp {layout.cp}" if layout.cp > 1 else ""
        raise LayoutError(f"--block-size {model.block_size}{per_cp} is not divisible by --tp {t} (sequence parallelism); "
                          f"nearest valid --block-size: {_choices(_nearest(model.block_size, [step * k for k in range(1, model.block_size // step + 3)]))}")
    if layout.recompute not in ("none", "selective", "full"):
        raise LayoutError(f"--recompute must be none, selective or full, got {layout.recompute!r}")
    from .experts import check_axes
    check_axes(model, layout)


def layouts(model, world, batch_size, precision="bf16", optimizer="adam", zeros=(0, 1, 2, 3),
            recomputes=("none", "selective", "full"), max_micro_batch=None, cps=None, eps=None,
            cp_methods=("ring", "ulysses")):
    """Every valid layout of ``model`` on ``world`` ranks: dp x pp x tp x cp factorings x ep (dividing dp and
    the experts) x ZeRO x recompute x micro-batch sizes (powers of two dividing the replica's batch) x
    sequence parallelism (tp > 1) x the cp method (cp > 1). ``cps`` / ``eps``: the cp and ep sizes to try
    (default: every divisor; 1 for a model without experts)."""
    out = []
    experts = getattr(model, "moe_experts", 0)
    for tp in divisors(world):
        for cp in (divisors(world // tp) if model.kind == "gpt" else [1]):
            if cps is not None and cp not in cps:
                continue
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * pp * cp)
                if batch_size % dp:
                    continue
                per_replica = batch_size // dp
                sizes = [b for b in divisors(per_replica) if b & (b - 1) == 0 and (max_micro_batch is None or b <= max_micro_batch)]
                ep_sizes = [e for e in divisors(dp) if experts and experts % e == 0 and (eps is None or e in eps)] or [1]
                for b in sizes:
                    for sp in ((False, True) if tp > 1 and model.kind == "gpt" else (False,)):
                        for zero in zeros:
                            for recompute in (recomputes if model.kind == "gpt" else ("none",)):
                                for ep in ep_sizes:
                                    for method in (cp_methods if cp > 1 else ("ring",)):
                                        layout = Layout(world=world, batch_size=batch_size, dp=dp, pp=pp, tp=tp,
                                                        zero=zero, sequence_parallel=sp, recompute=recompute,
                                                        microbatches=per_replica // b, precision=precision,
                                                        optimizer=optimizer, cp=cp, cp_method=method, ep=ep)
                                        try:
                                            out.append(check(model, layout))
                                        except LayoutError:
                                            pass
    return out
