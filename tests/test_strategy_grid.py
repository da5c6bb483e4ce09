"""One grid: every data-parallel strategy x every all-reduce algorithm (where the strategy
all-reduces) x precision (float64; bf16 and fp16 with fp32 master weights) x plain step / k
micro-batch accumulation (PyTorch's semantics: gradients add up over backward calls until zero_grad;
DDP also with no_sync), against one process on the same global batch: float64 to 1e-12, mixed
precision bit for bit. On ThreadWorld (p = 4, and p = 3 in float64) and under ``mpiexec -n 4`` (one
launch runs every cell: tests/programs/strategy_grid.py).

Mixed precision is compared exactly: its model (Linear + ReLU) and loss (a fixed integer weighting
of the outputs, divided by the batch) make every gradient a small multiple of 1/N, exactly
representable in bf16 and fp16 and exactly summed in any order; lr and momentum are powers of two.
So the only way a cell can differ from one process is a bug (a reduction that drops, doubles or
overwrites a micro-batch, a wrong average, masters that are not averaged)."""
import pathlib
import re
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn, optim
from minitrain.backend import bfloat16
from minitrain.comm import ALL_REDUCE_ALGORITHMS, ThreadWorld, all_reduce
from minitrain.nn import functional as F
from minitrain.parallel import (DistributedDataParallel, FullyShardedDataParallel, LocalSGD,
                                ZeroRedundancyOptimizer, found_inf_on_any_rank)

PRECISIONS = {"fp64": np.float64, "bf16": bfloat16, "fp16": np.float16}
ACCUMULATION = {"step": 1, "accumulate": 2, "no_sync": 2}     # micro-batches per optimizer step
STEPS = 2


def cells():
    for strategy in ("ddp", "local_sgd", "zero1", "zero2", "fsdp"):
        algorithms = ALL_REDUCE_ALGORITHMS if strategy in ("ddp", "local_sgd") else ("reduce_scatter",)
        for algorithm in algorithms:
            for precision in PRECISIONS:
                for acc in ACCUMULATION:
                    if acc == "no_sync" and strategy != "ddp":
                        continue
                    yield f"{strategy}-{algorithm}-{precision}-{acc}"


CELLS = list(cells())


# ---------------------------------------------------------------- models, data, optimizers
def make_model(precision, seed):
    mt.manual_seed(seed)
    if precision == "fp64":
        return nn.MLP([6, 13, 11, 3])
    model = nn.Linear(6, 4)
    rng = np.random.default_rng(seed)
    model.weight.data[...] = rng.integers(-8, 9, (4, 6)) / 8.0      # dyadic: exact in bf16 and fp16
    model.bias.data[...] = rng.integers(-8, 9, 4) / 8.0
    return model.to(PRECISIONS[precision])


def forward_loss(model, x, y, precision, scale):
    """Mean loss over the rows given, times ``scale`` (1/k for k micro-batches)."""
    if precision == "fp64":
        return F.cross_entropy(model(mt.Tensor(x)), y) * scale
    out = F.relu(model(mt.Tensor(x).to(PRECISIONS[precision]))).float()
    return (out * mt.Tensor(y.astype(np.float32))).sum() * (scale / len(x))


def data(p, k, seed=7):
    """STEPS x k micro-batches of the global batch (8 rows per rank)."""
    rng = np.random.default_rng(seed)
    n = 8 * p
    batches = []
    for _ in range(STEPS * k):
        x = rng.integers(-1, 2, (n, 6)).astype(np.float64)
        batches.append((x, rng.integers(0, 3, n), rng.integers(-2, 3, (n, 4))))
    return batches


def optimizer_args(strategy, precision):
    """(class, kwargs, mixed-precision kwargs). Local SGD needs a linear update to equal one process."""
    if strategy == "local_sgd":
        opt = (optim.SGD, dict(lr=0.0625, momentum=0.5))
    else:
        opt = (optim.Adam, dict(lr=0.0625))
    mixed = {"bf16": dict(loss_scale=None), "fp16": dict(loss_scale=256.0)}.get(precision)
    return opt[0], opt[1], mixed


def build_optimizer(params, opt_class, kwargs, mixed, comm=None):
    if mixed is None:
        return opt_class(params, **kwargs)
    agree = found_inf_on_any_rank(comm) if comm is not None else None       # sharded: skip steps alike
    return optim.MixedPrecisionOptimizer(params, opt_class, all_reduce_found_inf=agree, **mixed, **kwargs)


def scaled(opt, loss):
    return opt.scale(loss) if hasattr(opt, "scale") else loss


# ---------------------------------------------------------------- one cell
def run_cell(comm, cell):
    """Train the cell's strategy and one process side by side; the largest parameter difference."""
    strategy, algorithm, precision, acc = cell.split("-")
    k = ACCUMULATION[acc]
    mt.set_default_dtype(np.float64)
    opt_class, kwargs, mixed = optimizer_args(strategy, precision)
    p, r = comm.size, comm.rank
    model = make_model(precision, seed=100 + r)          # different on each rank: the strategy must broadcast
    reference = make_model(precision, seed=100)          # one process: rank 0's initial weights
    ref_opt = build_optimizer(reference.parameters(), opt_class, kwargs, mixed)

    wrapped, opt, ddp = model, None, None
    if strategy == "ddp":
        wrapped = ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.0002, algorithm=algorithm)
        opt = build_optimizer(model.parameters(), opt_class, kwargs, mixed)
    elif strategy == "local_sgd":
        opt = build_optimizer(model.parameters(), opt_class, kwargs, mixed)
        wrapped = LocalSGD(model, comm, sync_every=1, algorithm=algorithm, optimizer=opt)
    elif strategy in ("zero1", "zero2"):
        opt = ZeroRedundancyOptimizer(model.parameters(), opt_class, comm, stage=int(strategy[-1]),
                                      bucket_cap_mb=0.0002, **(mixed or {}), **kwargs)
    else:
        wrapped = FullyShardedDataParallel(model, comm)
        opt = build_optimizer(wrapped.parameters(), opt_class, kwargs, mixed, comm=comm)

    worst = 0.0
    for i, (x, y, c) in enumerate(data(p, k)):
        target = y if precision == "fp64" else c
        micro = i % k
        if micro == 0:
            ref_opt.zero_grad()
            opt.zero_grad()
        scaled(ref_opt, forward_loss(reference, x, target, precision, 1.0 / k)).backward()
        loss = scaled(opt, forward_loss(wrapped, x[r::p], target[r::p], precision, 1.0 / k))
        if acc == "no_sync" and micro < k - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
        if micro < k - 1:
            continue
        ref_opt.step()
        opt.step()
        if strategy == "local_sgd":
            wrapped.step()
        mine = wrapped.full_state_dict() if strategy == "fsdp" else {n: q.data for n, q in model.named_parameters()}
        pairs = [(mine[name], q.data) for name, q in reference.named_parameters()]
        if mixed is not None and strategy in ("ddp", "local_sgd"):       # the fp32 masters too
            pairs += [(m.data, rm.data) for m, rm in zip(opt.masters, ref_opt.masters)]
        for got, want in pairs:
            worst = max(worst, float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max()))
    return worst


def tolerance(cell):
    return 1e-12 if "-fp64-" in cell else 0.0


# ---------------------------------------------------------------- ThreadWorld
@pytest.mark.parametrize("cell", CELLS)
def test_strategy_equals_one_process_on_threadworld(cell, float64):
    for p in ((3, 4) if "-fp64-" in cell else (4,)):
        worst = max(ThreadWorld(p).run(run_cell, cell))
        assert worst <= tolerance(cell), f"{cell} at p={p}: max abs difference {worst:g}"


# ---------------------------------------------------------------- mpiexec -n 4: one launch, every cell
PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "strategy_grid.py")


@pytest.fixture(scope="module")
def mpi_grid():
    from minitrain.testing import run_mpi
    out = run_mpi([sys.executable, PROGRAM], n=4, timeout=240).stdout
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"cell (\S+) max_abs_diff (\S+)", out)}


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_strategy_equals_one_process_under_mpiexec(cell, mpi_grid):
    assert cell in mpi_grid, f"{cell} did not report"
    assert mpi_grid[cell] <= tolerance(cell), f"{cell} under mpiexec -n 4: max abs difference {mpi_grid[cell]:g}"


def report_grid(comm):
    """Run every cell on ``comm``; rank 0 prints each cell's largest difference over the ranks."""
    for cell in CELLS:
        worst = float(all_reduce(comm, np.array([run_cell(comm, cell)]), op="max")[0])
        if comm.rank == 0:
            print(f"cell {cell} max_abs_diff {worst!r}", flush=True)
