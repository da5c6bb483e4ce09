"""Device transports (minitrain/comm/transport.py, ipc.py, nccl.py) on the CuPy stand-in.

Under mpiexec (tests/programs/transport_check.py): with CUDA IPC emulated (CUPY_STANDIN_IPC=1: device
memory in shared memory that the other processes map) the job negotiates cuda-ipc, and every transport
moves exactly the right bytes through every collective, counts the ring's 2(p-1)/p·N·b, opens each peer
buffer once and allocates pinned memory once, lets a sender overwrite a buffer as soon as its send
completed, and reports a size mismatch on both ranks; mpi4py never sees a device array. Without IPC the
job falls back to pinned staging and says so once. In-process: the one guard before mpi4py, the pinned
pool and its ledger entries, and the NCCL backend on ranks that are threads (the stand-in's NCCL).
"""
import json
import os
import pathlib
import sys

import numpy as np
import pytest

from minitrain.comm import ThreadWorld, rings as C, transport as T
from minitrain.testing import run_mpi

ROOT = pathlib.Path(__file__).parent.parent
STANDIN = ROOT / "tests" / "standin"
PROGRAM = ROOT / "tests" / "programs" / "transport_check.py"


def standin_env(**extra):
    path = os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "CUPY_STANDIN_IMPLICIT": "error", "CUPY_STANDIN_FORBID_DEVICE_POINTERS": "1",
            "MINITRAIN_TRANSPORT": "", **extra}


def check(tmp_path, n, *args, **env):
    out = tmp_path / f"transports.{n}.json"
    proc = run_mpi([sys.executable, PROGRAM, out, *args], n=n, timeout=180, env=standin_env(**env))
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("n, gpus", [(2, 1), (4, 2), (4, 4)], ids=["2 ranks on one GPU", "4 ranks on 2 GPUs",
                                                                "4 ranks on 4 GPUs"])
def test_every_transport_moves_the_right_bytes_and_reuses_its_buffers(tmp_path, n, gpus):
    report, output = check(tmp_path, n, "--mismatch", CUPY_STANDIN_IPC="1", CUPY_STANDIN_DEVICES=str(gpus))
    assert report["negotiated"] == "cuda-ipc" and report["ranks_checked"] == n
    entries = report["transports"]
    assert [entries[k]["name"] for k in ("auto", "cuda-ipc", "cuda-ipc/host", "pinned-staging")] == \
        ["cuda-ipc", "cuda-ipc", "cuda-ipc", "pinned-staging"]
    assert entries["cuda-ipc"]["sync"] == "event" and entries["cuda-ipc/host"]["sync"] == "host"
    assert len({e["sent"] for e in entries.values()}) == 1            # the ring's bytes, whatever moves them
    for name in ("cuda-ipc", "cuda-ipc/host"):
        assert 1 <= entries[name]["opens"] <= n - 1                    # peers' memory opened once, not per call
        assert "rank 1 receives 32 bytes, this message has 16" in entries[name]["mismatch"]
    pinned = entries["pinned-staging"]
    assert pinned["pinned_bytes"] > 0 and pinned["ledger_host_comm_buffers"] == pinned["pinned_bytes"]
    assert report["mpi4py_saw"] == ["numpy.ndarray"]                   # no device array ever reached MPI
    assert "cuda-ipc (MPI is not CUDA-aware" in output
    # ranks on one GPU without MPS take turns on it (a hop 142 us against 8 us under MPS, on an H200): said
    shared = {1: "ranks [0, 1] share GPU 0 without MPS", 2: "ranks [0, 2] share GPU 0, ranks [1, 3] share GPU 1 "
              "without MPS", 4: None}[gpus]
    assert (shared in report["note"]) if shared else "MPS" not in report["note"]
    said = [line for line in output.splitlines() if "minitrain: device buffers move" in line]
    assert sum("nvidia-cuda-mps-control -d" in line for line in said) == (shared is not None)


def test_ranks_sharing_a_gpu_under_mps_get_no_advice_to_start_it(tmp_path):
    pipes = tmp_path / "mps"
    pipes.mkdir()
    (pipes / "control").touch()                 # the MPS control daemon's pipe, as nvidia-cuda-mps-control -d makes it
    report, output = check(tmp_path, 2, CUPY_STANDIN_IPC="1", CUPY_STANDIN_DEVICES="1", CUDA_MPS_PIPE_DIRECTORY=str(pipes))
    assert report["negotiated"] == "cuda-ipc" and report["note"] == "MPI is not CUDA-aware"
    assert "MPS" not in output


def test_without_cuda_ipc_the_job_stages_through_pinned_memory_and_says_why_once(tmp_path):
    report, output = check(tmp_path, 2, "--transports", "auto", "pinned-staging")
    assert report["negotiated"] == "pinned-staging"
    assert "no CUDA IPC: cudaErrorNotSupported: operation not supported on rank 0" in report["note"]
    assert output.count("device buffers move by pinned-staging") == 1       # rank 0 says it, once
    assert report["transports"]["auto"]["pinned_bytes"] > 0


def test_a_cuda_aware_mpi_gets_the_device_buffers_themselves(tmp_path):
    """MINITRAIN_CUDA_AWARE=1 declares the MPI CUDA-aware; under the stand-in mpi4py then reads device
    pointers (host memory here, through __cuda_array_interface__), so the direct path runs for real."""
    report, _ = check(tmp_path, 2, "--transports", "auto", MINITRAIN_CUDA_AWARE="1", CUPY_STANDIN_FORBID_DEVICE_POINTERS="0")
    assert report["negotiated"] == "cuda-aware-mpi" and report["transports"]["auto"]["checks"] > 0
    assert "cupy._core.ndarray" in report["mpi4py_saw"] and report["transports"]["auto"]["pinned_bytes"] == 0


def test_asking_for_cuda_ipc_where_it_cannot_work_is_a_clear_error(tmp_path):
    proc = run_mpi([sys.executable, PROGRAM, tmp_path / "x.json", "--transports", "auto", "cuda-ipc"], n=2,
                   timeout=120, env=standin_env(), check=False)
    assert proc.returncode != 0
    assert "transport 'cuda-ipc' cannot work here: cudaErrorNotSupported" in proc.stdout


def test_a_device_array_is_refused_before_it_reaches_a_mpi_that_is_not_cuda_aware(standin_gpu, monkeypatch):
    from minitrain.comm import host
    monkeypatch.setattr(host, "_CUDA_AWARE", False)
    with pytest.raises(T.DevicePointerRefused, match="not CUDA-aware"):
        T.mpi_buffer(standin_gpu.zeros(3, np.float32))
    with pytest.raises(TypeError):                    # and mpi4py could not read one anyway (stand-in rules)
        memoryview(standin_gpu.zeros(3, np.float32))


def test_the_pinned_pool_reuses_its_blocks_and_counts_them_as_host_comm_buffers(standin_gpu):
    from minitrain import memory
    tracker = memory.MemoryTracker()
    with memory.use_tracker(tracker):
        pool = T.PinnedPool()
        a = pool.take(5000)
        assert len(a[1]) == 8192 and tracker.host_snapshot()["comm_buffers"] == 8192
        pool.give(a)
        assert pool.take(3000) is a and pool.nbytes == 8192           # reused, nothing new allocated
        b = pool.take(100)                                            # a is taken: a second block
        assert len(b[1]) == 4096 and tracker.host_snapshot()["comm_buffers"] == 8192 + 4096
        pool.close()
        assert tracker.host_snapshot()["comm_buffers"] == 0
    assert standin_gpu._standin.counters()["pinned_bytes"] == 8192 + 4096


# ---------------------------------------------------------------- NCCL on ranks that are threads
@pytest.fixture
def nccl(standin_gpu, monkeypatch):
    from cupy.cuda import nccl as module
    monkeypatch.setattr(module, "available", True)
    return module


def rank_input(rank, n):
    return (np.arange(n) % 5 + rank).astype(np.float32)


def test_the_nccl_backend_runs_the_ring_on_nccl_send_recv_beside_nccls_all_reduce(nccl, standin_gpu):
    from minitrain.comm.nccl import NCCLCommunicator
    cp, p, n = standin_gpu, 3, 1001

    def rank(comm):
        cp.cuda.Device(comm.rank).use()                      # one GPU per rank
        nc = NCCLCommunicator(comm)
        x = cp.asarray(rank_input(comm.rank, n))
        ring = C.ring_all_reduce(nc, x)
        later = C.ring_all_reduce(nc, x, op="max", async_op=True)
        native = nc.nccl_all_reduce(x)
        gathered = C.ring_all_gather(nc, cp.asarray(np.full(comm.rank + 1, comm.rank, np.float64)))   # lengths by host
        nc.barrier()
        return (cp.asnumpy(ring), cp.asnumpy(later.wait()), cp.asnumpy(native), cp.asnumpy(gathered),
                nc.stats["ring_all_reduce"]["bytes_sent"], ring.device.id)

    results = ThreadWorld(p).run(rank)
    stack = np.stack([rank_input(r, n) for r in range(p)])
    bounds = C.chunk_bounds(n, p)
    for r, (ring, later, native, gathered, sent, device) in enumerate(results):
        assert np.array_equal(ring, stack.sum(0)) and np.array_equal(native, stack.sum(0))
        assert np.array_equal(later, stack.max(0)) and device == r
        assert gathered.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        chunk = [bounds[i + 1] - bounds[i] for i in range(p)]
        per_call = 4 * (sum(chunk[(r - s - 1) % p] for s in range(p - 1)) + sum(chunk[(r - s) % p] for s in range(p - 1)))
        assert sent == 2 * per_call                        # two ring all-reduces: the ring's bytes, counted above NCCL


def test_nccl_refuses_two_ranks_on_one_gpu_and_says_what_to_use(nccl, standin_gpu):
    from minitrain.comm.nccl import NCCLCommunicator, NCCLUnavailable
    with pytest.raises(NCCLUnavailable, match=r"ranks \[0, 1\] share GPU cuda:0 .*Use backend 'mpi'"):
        ThreadWorld(2).run(lambda comm: NCCLCommunicator(comm))


def test_without_nccl_the_backend_says_so(standin_gpu):
    from minitrain.comm.nccl import NCCLCommunicator, NCCLUnavailable
    with pytest.raises(NCCLUnavailable, match="CuPy found no NCCL library"):
        ThreadWorld(2).run(lambda comm: (standin_gpu.cuda.Device(comm.rank).use(), NCCLCommunicator(comm)))


@pytest.mark.parametrize("gpu, setting, says", [
    (True, {"MINITRAIN_TRANSPORT": "cuda-ipc"},
     "mlp.py: error: transport 'cuda-ipc' cannot work here: cudaErrorNotSupported"),
    (True, {"MINITRAIN_BACKEND": "nccl", "CUPY_STANDIN_DEVICES": "1"}, "mlp.py: error: [rank 0] NCCL cannot start"),
    (False, {"MINITRAIN_BACKEND": "nccl"}, "mlp.py: error: backend 'nccl' moves device buffers by CuPy's NCCL "
                                           "binding: device 'cuda' needs CuPy"),
    (False, {"MINITRAIN_BACKEND": "gloo"}, "mlp.py: error: unknown backend 'gloo': expected 'mpi' or 'nccl'"),
    (False, {"MINITRAIN_TRANSPORT": "pinned-staging"},
     "mlp.py: error: transport 'pinned-staging' moves device buffers: select the GPU first (MINITRAIN_DEVICE=cuda)"),
    (True, {"MINITRAIN_TRANSPORT": "nvlink"}, "mlp.py: error: unknown transport 'nvlink': expected auto or one of"),
    (False, {"MINITRAIN_DEVICE": "gpu"}, "mlp.py: error: MINITRAIN_DEVICE=gpu: unknown device 'gpu': expected 'cpu' "
                                         "or 'cuda'"),
    (False, {"MINITRAIN_DEVICE": "cuda"}, "mlp.py: error: MINITRAIN_DEVICE=cuda: device 'cuda' needs CuPy"),
], ids=["cuda-ipc where it cannot work", "nccl without NCCL", "nccl without CuPy", "an unknown backend",
        "a transport on the CPU", "an unknown transport", "an unknown device", "the GPU without CuPy"])
def test_a_job_refuses_a_backend_or_transport_that_cannot_work_in_one_line(gpu, setting, says, tmp_path):
    """As a bad option is refused: one line from rank 0, exit status 2 on every rank, no traceback (on the CPU:
    a machine without CuPy, whatever this one has). A device refused while minitrain imports, too."""
    (tmp_path / "cupy.py").write_text("raise ImportError('no CuPy on this machine')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = standin_env(MINITRAIN_DEVICE="cuda", **setting) if gpu else {"MINITRAIN_DEVICE": "", "PYTHONPATH": path,
                                                                      **setting}
    proc = run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--epochs", "1", "--no-progress"], n=2,
                   timeout=120, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stdout
    assert "Traceback" not in proc.stdout


def test_ranks_share_a_gpu_by_node_and_pci_address_not_by_device_index():
    """Ranks given different CUDA_VISIBLE_DEVICES each call their GPU 0: only the PCI address says
    whether two of them are one GPU."""
    from minitrain.comm.gpu_places import shared_gpus
    node_a, node_b = 11, 22
    assert shared_gpus([(node_a, 0x100, 0), (node_a, 0x200, 0)]) == []                  # two GPUs, both "0"
    assert shared_gpus([(node_a, 0x100, 0), (node_b, 0x100, 0)]) == []                  # one per node
    assert shared_gpus([(node_a, 0x100, 1), (node_a, 0x200, 0), (node_a, 0x100, 1), (node_a, 0x200, 0)]) == \
        [([0, 2], 1), ([1, 3], 0)]
