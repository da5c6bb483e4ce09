"""Grader: all_to_all_single from sendrecv, equal to minitrain.comm.all_to_all_single (Thakur
et al. 2005's pairwise exchange) bit for bit at p = 1..4: uneven and zero-size splits, rows of one
number and rows with extra axes; and the traffic: at most p-1 messages per rank."""
import numpy as np

from ..comparing import alias_problem, as_array, compare, to_learner
from ..grading import Mismatch
from ..oracles import traffic, world_checks

TITLE = "all_to_all_single: every rank sends a block of rows to every rank (MoE's exchange)"
ORDER = 190
KIND = "implement"
NOTEBOOK = "14_experts"
DEFINES = "all_to_all_single"

STUB = '''"""Exercise all_to_all_single: the exchange of expert parallelism, where every rank sends each
token row to the rank that holds its expert and gets back the rows its experts must process
(PyTorch's all_to_all_single, MPI_Alltoallv).

Write all_to_all_single(comm, x, output_split_sizes, input_split_sizes) with only point-to-point calls:

    comm.rank, comm.size
    comm.sendrecv(sendbuf, dest, recvbuf, source)   send to dest and receive from source at once
    buffers are contiguous NumPy arrays (a slice of rows of a C-ordered array is one)

Contract:
  - x has shape (n, ...): n rows, each of any shape; input_split_sizes is p non-negative ints
    summing to n: the first input_split_sizes[0] rows go to rank 0, the next ones to rank 1, ...;
  - output_split_sizes[i] is how many rows rank i sends here (it equals rank i's
    input_split_sizes[rank]); sizes may be uneven and may be 0;
  - return a NEW array of shape (sum(output_split_sizes), ...) with x's dtype: the blocks received,
    stacked in rank order (rank 0's block first, this rank's own block in its place);
  - at most p-1 sendrecv calls per rank: your own block is a copy, not a message.

The test to pass: at p = 1, 2, 3, 4, uneven and empty blocks, 1-D x and x of shape (n, 3, 2), four
dtypes, bit for bit against minitrain.comm.all_to_all_single; then at most p-1 messages per rank.

On the GPU: MINITRAIN_DEVICE=cuda python -m minitrain.exercises check all_to_all_single mine.py
hands your code CuPy arrays; make new arrays with xp = minitrain.backend.array_module(x), not np.

Check it:  python -m minitrain.exercises check all_to_all_single mine.py
Stuck?     python -m minitrain.exercises hint all_to_all_single
"""
import numpy as np


def all_to_all_single(comm, x, output_split_sizes, input_split_sizes):
    raise NotImplementedError("all_to_all_single: send each rank its block of rows")
'''

HINTS = (
    "Cut x into p blocks with the offsets np.cumsum([0] + input_split_sizes), and the output into p "
    "slots with np.cumsum([0] + output_split_sizes): slot i receives exactly the rows rank i sends "
    "here, so it always has the right size. Copy your own block into your own slot first.",
    "p-1 rounds. If in round k every rank sends to (rank + k) % p, then every rank hears in that round "
    "from (rank - k) % p: each round pairs the ranks up perfectly, and nobody waits on a busy peer.",
    "Round k = 1 .. p-1: dest, source = (r + k) % p, (r - k) % p; comm.sendrecv(x[send[dest]:send[dest + 1]], "
    "dest, out[recv[source]:recv[source + 1]], source), where send and recv are the two cumsums.",
)

DTYPES = ("float64", "float32", "int64", "uint8")


def _sizes(p, seed):
    """sizes[i][j]: rows rank i sends to rank j, uneven, with empty blocks (the diagonal too)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, size=(p, p))
    sizes[rng.random((p, p)) < 0.3] = 0
    return sizes.tolist()


def _rows(i, n, tail, dtype):
    """Rank i's input: every element tells its rank, its row and its place in the row."""
    a = (i * 1000 + np.arange(n * int(np.prod(tail, dtype=int))) % 251).reshape((n,) + tail)
    return a.astype(dtype)


def _expected(sizes, r, tail, dtype):
    p = len(sizes)
    blocks = []
    for i in range(p):
        x = _rows(i, sum(sizes[i]), tail, dtype)
        start = sum(sizes[i][:r])
        blocks.append(x[start:start + sizes[i][r]])
    return np.concatenate(blocks)


def _exact(comm, impl):
    p, r = comm.size, comm.rank
    for seed in range(3):
        sizes = _sizes(p, 10 * p + seed)
        for tail, dtype in [((), "float64"), ((3, 2), "float32"), ((), "int64"), ((3, 2), "uint8")]:
            x = to_learner(_rows(r, sum(sizes[r]), tail, dtype))
            out_sizes = [sizes[i][r] for i in range(p)]
            case = (f"rank {r} of {p}, all_to_all_single(x of shape {x.shape}, output_split_sizes={out_sizes}, "
                    f"input_split_sizes={sizes[r]}, {dtype})")
            result = impl(comm, x, out_sizes, list(sizes[r]))
            aliased = alias_problem(result, x, case, "x")
            if aliased:
                raise Mismatch(aliased)
            got = as_array(result, case)
            want = _expected(sizes, r, tail, dtype)
            if got.dtype != want.dtype:
                raise Mismatch(f"{case}: returned dtype {got.dtype}, expected {want.dtype} (x's)")
            problem = compare(got, want, case, exact=True)
            if problem:
                raise Mismatch(problem + " (element values are 1000 * sending rank + position: the blocks must "
                               "be stacked in the order of the sending ranks, this rank's own among them)")


def _traffic(comm, impl):
    p, r = comm.size, comm.rank
    sizes = [[2 + (i + j) % 3 for j in range(p)] for i in range(p)]
    x = to_learner(np.ones((sum(sizes[r]), 4), np.float32))
    sent, messages = traffic(comm, lambda: impl(comm, x, [sizes[i][r] for i in range(p)], sizes[r]))
    if messages > p - 1:
        raise Mismatch(f"rank {r} of {p} sent {messages} messages; the pairwise exchange sends p-1 = {p - 1} "
                       f"(one block per other rank; the own block is a local copy)")


def checks():
    return world_checks([("every rank gets its blocks, uneven and empty ones too", _exact, 1, 1),
                         ("at most p-1 messages per rank", _traffic, 2, 2)])


def reference():
    from minitrain.comm import all_to_all_single
    return lambda comm, x, output_split_sizes, input_split_sizes: all_to_all_single(
        comm, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes)
