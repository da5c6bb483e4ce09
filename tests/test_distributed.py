"""minitrain.distributed: torch.distributed's calls (in place, global src / dst, groups, async Work) equal MPI's
built-ins at p = 3 on sizes no p divides; what PyTorch refuses, or what cannot work here, is refused in one line."""
import re
import sys
from pathlib import Path

import pytest

from minitrain.testing import free_port, run_mpi

PROGRAM = Path(__file__).parent / "programs" / "torch_style.py"
ORACLE = Path(__file__).parent / "programs" / "torch_dist_oracle.py"
ORACLE_CALLS = 39          # the compare() calls in ORACLE
CHECKS = ["init as PyTorch's", "all_reduce sum", "all_reduce max", "all_reduce min", "all_reduce product",
          "all_reduce avg", "all_reduce int64 exact", "all_reduce Tensor and transposed view", "all_reduce async_op",
          "broadcast", "reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
          "all_to_all_single uneven", "all_to_all", "in place", "strided, 0-d, empty", "gather", "scatter",
          "object collectives", "isend/irecv", "barrier async_op", "batch_isend_irecv ring", "new_subgroups",
          "new_subgroups of a group",
          "monitored_barrier", "destroyed", "broadcast read-only"]
REFUSALS = {"twice": "trying to initialize the default process group twice!",
            "bad op": "all_reduce: op 'median' is not one of ReduceOp.SUM, AVG, PRODUCT, MIN, MAX",
            "bitwise op": "all_reduce: ReduceOp.BAND is not supported here (nor by NCCL); on bool tensors MIN is a "
                          "logical and, MAX a logical or",
            "integer mean": "all_reduce: op='mean' needs a floating dtype, got int64",
            "group rank outside": "get_global_rank: group rank 3 is not in the group [0, 1, 2]",
            "output too long": "all_to_all_single: output has shape (4,); what the splits receive needs (3,)",
            "ranks not integers": "new_group: ranks must be global ranks (integers), got [0, 1.5]",
            "src outside": "broadcast: src=3 is not a rank of the group [0, 1, 2]",
            "wrong output size": ("all_gather_into_tensor: output_tensor has 7 elements, the group's 3 inputs of 2 "
                                  "need 6"),
            "any source": "irecv: a receive from any source (src=None) is not supported here",
            "to itself": "isend: Invalid destination rank: should not be the same as rank of the current process",
            "a list": "all_reduce: tensor must be a NumPy or CuPy array or a minitrain Tensor, got list",
            "empty batch": "batch_isend_irecv: p2p_op_list is empty; give it at least one P2POp",
            "not a P2POp": "batch_isend_irecv: p2p_op_list must be a list of dist.P2POp, got list [<function isend",
            "op not isend or irecv": "P2POp: op must be dist.isend or dist.irecv, got 'send'",
            "mixed groups": "batch_isend_irecv: All ops need to use the same group",
            "to itself unpaired": ("batch_isend_irecv: an isend to this rank itself (tag 0) needs an irecv from itself "
                                   "with the same tag in the same batch"),
            "peer outside": "P2POp: peer=3 is not a rank of the group [0, 1, 2]",
            "subgroups uneven": "new_subgroups: The world size (3) must be divisible by 'group_size=2'",
            "subgroups disagree": ("new_subgroups: the ranks disagree: group_size [1, 3, 3] on ranks 0..2; pass one "
                                   "group_size on every rank"),
            "monitored timeout": "monitored_barrier: timeout must be a positive timedelta or number of seconds, got -1",
            # where the call writes its result, before anything moves (mpi4py's own words were "dlpack: buffer is
            # not writable", or NumPy's once the data had moved)
            "read-only tensor": "all_reduce: tensor is read-only, and the call writes its result into it",
            "read-only output": "all_gather_into_tensor: output_tensor is read-only, and the call writes its result",
            "read-only list": "all_gather: a tensor of tensor_list is read-only, and the call writes its result",
            "read-only scatter": "scatter: tensor is read-only, and the call writes its result into it",
            "read-only gather list": "gather: a tensor of gather_list is read-only, and the call writes its result",
            "read-only receive": "irecv: tensor is read-only, and the receive writes into it",
            "read-only receive in a batch": "irecv: tensor is read-only, and the receive writes into it"}
#: what each rank of monitored_barrier raises in each case of late ranks (PROGRAM): rank 1 late (wait_all_ranks=True,
#: timeout 1 s), ranks 1 and 2 late (False, 0.3 s), ranks 1 and 2 late (True, 0.3 s). Rank 0's lines are in
#: torch.distributed's words under gloo (2.13): case 0's as torch raised it, the others' in its source's format.
STOPPED = "failed to pass monitoredBarrier in {} ms: rank 0 had stopped waiting when it arrived"
LATE = {(0, 0): "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms",
        (1, 0): "[Rank 1]: Rank 1 " + STOPPED.format(1000),
        (2, 0): ("[Rank 2]: Rank 2 successfully reached monitoredBarrier, but rank 0 found that Rank 1 failed to "
                 "pass monitoredBarrier in 1000 ms"),
        (0, 1): "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 300 ms",
        (1, 1): "[Rank 1]: Rank 1 " + STOPPED.format(300),
        (2, 1): "[Rank 2]: Rank 2 " + STOPPED.format(300),
        (0, 2): "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 300 ms",
        (1, 2): "[Rank 1]: Rank 1 " + STOPPED.format(300),
        (2, 2): "[Rank 2]: Rank 2 " + STOPPED.format(300)}


@pytest.fixture(scope="module")
def printed():
    return run_mpi([sys.executable, PROGRAM], n=3, timeout=120).stdout


@pytest.mark.parametrize("check", CHECKS)
def test_each_call_equals_mpi_on_every_rank(printed, check):
    for rank in range(3):
        assert f"[{rank}] ok {check}\n" in printed, printed


def test_a_group_sorts_its_ranks_takes_global_ranks_and_leaves_a_non_member_out(printed):
    for rank in (0, 2):        # the group [2, 0] asked for, sorted as PyTorch sorts it
        for check in ("group all_reduce", "group ranks", "group broadcast from a global rank"):
            assert f"[{rank}] ok {check}\n" in printed, printed
    assert "[1] ok outside the group\n" in printed and "[2] ok recv returns the sender\n" in printed
    assert "[1] ok outside the group batch_isend_irecv\n" in printed, printed
    assert "[1] refused a non-member's question: get_process_group_ranks: global rank 1 is not in this group" \
        in printed, printed
    for rank in (0, 2):       # new_group([2, 0], sort_ranks=False): group rank 0 is global rank 2
        assert f"[{rank}] ok sort_ranks=False\n" in printed, printed


def test_monitored_barrier_names_the_late_ranks_on_every_rank(printed):
    for (rank, case), line in LATE.items():
        assert f"[{rank}] monitored_barrier case {case}: {line}\n" in printed, printed


@pytest.mark.parametrize("name", REFUSALS)
def test_what_cannot_work_is_refused_in_one_line(printed, name):
    for rank in range(3):      # an error raised by comm/ names the rank too
        line = rf"\[{rank}\] refused {name}: (\[rank {rank}\] )?{re.escape(REFUSALS[name])}"
        assert re.search(line, printed), printed


def test_each_call_answers_as_torch_distributed_does_under_gloo():
    """torch.distributed itself beside minitrain.distributed in every rank (p = 3): each result, each return value
    (wait()'s, recv's, a non-member's, get_rank off a group) the same, all ops and dtypes gloo defines."""
    pytest.importorskip("torch")
    out = run_mpi([sys.executable, "-W", "ignore", ORACLE], n=3, timeout=120,
                  env={"MASTER_PORT": str(free_port())}).stdout
    assert "differs" not in out, out
    for rank in range(3):
        assert out.count(f"[{rank}] same ") == ORACLE_CALLS, out


def test_calls_before_init_process_group_say_so():
    import numpy as np
    import minitrain.distributed as dist
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.all_reduce(np.ones(2))
    with pytest.raises(ValueError, match="backend 'ucc' is not one of mpi, gloo, nccl"):
        dist.init_process_group("ucc")
    with pytest.raises(ValueError, match="the MPI launcher does the rendezvous"):
        dist.init_process_group("gloo", init_method="tcp://10.0.0.1:23456")


CUPY_CALLS = """
import cupy as cp
import minitrain.distributed as dist
dist.init_process_group('gloo'); r = dist.get_rank()
x = cp.arange(5, dtype=cp.float64) + r
dist.all_reduce(x, op=dist.ReduceOp.MAX)
out = cp.empty(10); dist.all_gather_into_tensor(out, cp.full(5, float(r)))
g = [cp.empty(2) for _ in range(2)] if r == 0 else None
dist.gather(cp.full(2, float(r)), g, dst=0)
o = cp.empty(2); dist.scatter(o, [cp.full(2, 5.0), cp.full(2, 6.0)] if r == 0 else None, src=0)
b, me = cp.empty(2), cp.empty(1)
ops = [dist.P2POp(dist.irecv, b, 1 - r), dist.P2POp(dist.isend, cp.full(2, r + 7.0), 1 - r),
       dist.P2POp(dist.isend, cp.full(1, r + 3.0), r), dist.P2POp(dist.irecv, me, r)]     # to itself: a copy
[w.wait() for w in dist.batch_isend_irecv(ops)]
print('cupy', type(x).__module__, cp.asnumpy(x).tolist(), cp.asnumpy(out).tolist(),
      g and cp.asnumpy(cp.concatenate(g)).tolist(), cp.asnumpy(o).tolist(), cp.asnumpy(b).tolist(),
      cp.asnumpy(me).tolist(), flush=True)
"""


def test_device_arrays_stay_on_the_device_under_the_strict_cupy_stand_in():
    """CuPy arrays in, CuPy arrays written (a batch_isend_irecv's too, its message to itself included): no
    implicit host copy (the stand-in raises on one)."""
    import os
    standin = Path(__file__).parent / "standin"
    env = {"PYTHONPATH": os.pathsep.join([str(standin), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "CUPY_STANDIN_IMPLICIT": "error", "MINITRAIN_DEVICE": "cuda"}
    out = run_mpi([sys.executable, "-c", CUPY_CALLS], n=2, timeout=120, env=env).stdout
    assert "[0] cupy cupy._core [1.0, 2.0, 3.0, 4.0, 5.0] [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0] " \
           "[0.0, 0.0, 1.0, 1.0] [5.0, 5.0] [8.0, 8.0] [3.0]" in out, out
    assert "[1] cupy cupy._core [1.0, 2.0, 3.0, 4.0, 5.0] [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0] " \
           "None [6.0, 6.0] [7.0, 7.0] [4.0]" in out, out
