"""Every device transport moves the right bytes, under mpiexec (the CuPy stand-in, or a real GPU).

    mpiexec -n N python tests/programs/transport_check.py OUT.json [--transports auto cuda-ipc ...]

For each transport (``auto`` first: what comm.init negotiates here; cuda-ipc also in its host-sync
mode), on device arrays: the ring all-reduce (sum / mean / max / min), reduce-scatter, all-gather,
broadcast, recursive doubling, all-to-all and an asynchronous all-reduce on a split communicator,
on awkward lengths and several dtypes, each equal to the exact result; the bytes each rank sent equal
2(p-1)/p·N·b whatever the transport; repeated calls on the same buffers open no new IPC handle and
allocate no new pinned memory; a completed send may be overwritten at once (the receiver, late, still
gets what was sent); a size mismatch raises on both ranks. Every array handed to mpi4py is
recorded: none may be a device array unless MPI is CUDA-aware (MINITRAIN_CUDA_AWARE=1 makes the stand-in's
MPI one: mpi4py then reads the stand-in's device pointers, which are host memory). Rank 0 writes OUT.json.
"""
import argparse
import json
import sys

import numpy as np

from minitrain import backend, memory
from minitrain import comm as mtcomm
from minitrain.comm import collectives as C
from minitrain.comm import rings as R
from minitrain.comm import transport as T

LENGTHS = (0, 1, 3, 7, 1001)
DTYPES = ("float32", "float64", "int32", "float16")


class Spy:
    """An mpi4py communicator that remembers the type of every buffer handed to it."""

    def __init__(self, inner, seen):
        self._inner, self._seen = inner, seen

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name[:1].isupper() and callable(attr):
            def call(*args, **kwargs):
                for a in args:
                    buf = a[0] if isinstance(a, list) and a else a
                    if hasattr(buf, "nbytes"):
                        self._seen.add(f"{type(buf).__module__}.{type(buf).__name__}")
                return attr(*args, **kwargs)
            return call
        return attr


def rank_input(rank, n, dtype):
    return (np.arange(n) % 7 + rank * 3 - 4).astype(dtype)


def check_collectives(comm, cp, where):
    p, r = comm.size, comm.rank
    count = 0
    for n in LENGTHS:
        for dtype in DTYPES:
            host = rank_input(r, n, dtype)
            stack = np.stack([rank_input(q, n, dtype) for q in range(p)]).astype(np.float64)
            x = cp.asarray(host)
            for op in ("sum", "mean", "max", "min", "prod"):
                if (op == "mean" and dtype == "int32") or (op == "prod" and dtype == "float16"):   # (not exact)
                    continue
                want = {"sum": stack.sum, "mean": stack.mean, "max": stack.max, "min": stack.min,
                        "prod": stack.prod}[op](0)
                got = R.ring_all_reduce(comm, x, op=op)
                assert np.array_equal(cp.asnumpy(got), want.astype(dtype)), f"{where} ring_all_reduce n={n} {dtype} {op}"
                count += 1
            got = R.ring_reduce_scatter(comm, x)
            assert np.array_equal(cp.asnumpy(got), np.array_split(stack.sum(0).astype(dtype), p)[r]), f"{where} rs n={n}"
            full = rank_input(99, n, dtype)
            got = R.ring_all_gather(comm, cp.asarray(np.array_split(full, p)[r]), total=n)
            assert np.array_equal(cp.asnumpy(got), full), f"{where} all_gather n={n} {dtype}"
            buf = cp.asarray(host)
            C.broadcast(comm, buf, root=p - 1)
            assert np.array_equal(cp.asnumpy(buf), rank_input(p - 1, n, dtype)), f"{where} broadcast n={n}"
            got = C.recursive_doubling_all_reduce(comm, x)
            assert np.array_equal(cp.asnumpy(got), stack.sum(0).astype(dtype)), f"{where} recursive doubling n={n}"
            count += 4
    blocks = cp.asarray(np.arange(p * 6, dtype=np.float32).reshape(p * 3, 2) + 100 * r)
    got = cp.asnumpy(C.all_to_all(comm, blocks))
    want = np.concatenate([(np.arange(p * 6, dtype=np.float32).reshape(p * 3, 2) + 100 * q)[3 * r:3 * r + 3]
                           for q in range(p)])
    assert np.array_equal(got, want), f"{where} all_to_all"
    return count + 1


def check_bytes_and_reuse(comm, cp, where):
    """The bytes are the ring's whatever the transport; steady state opens and allocates nothing."""
    p = comm.size
    n = 4096 + 3
    x = cp.asarray(rank_input(comm.rank, n, "float32"))
    out = cp.empty_like(x)
    R.ring_all_reduce(comm, x, out=out)                        # warm-up: handles opened, blocks allocated
    t = comm.device_transport()
    standin = getattr(cp, "__standin__", False)
    before = (getattr(t, "opens", 0), getattr(getattr(t, "pool", None), "nbytes", 0),
              cp._standin.counters("process")["ipc_opens"] if standin else 0,
              cp._standin.counters("process")["pinned_bytes"] if standin else 0)
    comm.stats.reset()
    for _ in range(3):
        R.ring_all_reduce(comm, x, out=out)
    after = (getattr(t, "opens", 0), getattr(getattr(t, "pool", None), "nbytes", 0),
             cp._standin.counters("process")["ipc_opens"] if standin else 0,
             cp._standin.counters("process")["pinned_bytes"] if standin else 0)
    assert after == before, f"{where}: repeated calls opened or allocated again: {before} -> {after}"
    bounds = R.chunk_bounds(n, p)
    chunk = [bounds[i + 1] - bounds[i] for i in range(p)]
    r = comm.rank
    rs = sum(chunk[(r - s - 1) % p] for s in range(p - 1))
    ag = sum(chunk[(r - s) % p] for s in range(p - 1))
    sent = comm.stats["ring_all_reduce"]["bytes_sent"]
    assert sent == 3 * (rs + ag) * 4, f"{where}: sent {sent} bytes, the ring sends {3 * (rs + ag) * 4}"
    pinned = memory.tracker().host_snapshot()["comm_buffers"]
    if t.name == "pinned-staging":
        assert pinned >= t.pool.nbytes > 0, f"{where}: pinned blocks {t.pool.nbytes} not in the ledger ({pinned})"
    return {"opens": after[0], "pinned_bytes": after[1], "sent": int(sent), "ledger_host_comm_buffers": int(pinned)}


def check_send_completion(comm, cp, where):
    """A completed send means the buffer may be overwritten: rank 0 overwrites it at once, rank 1 posts
    its receive late, and must still get what was sent (CUDA IPC: the sender waits for the reader)."""
    if comm.size < 2 or comm.rank > 1:
        return
    import time
    buf = cp.asarray(np.arange(64, dtype=np.float32) + 1)
    if comm.rank == 0:
        comm.send(buf, 1, tag=5)
        buf[...] = -1.0
    else:
        time.sleep(0.3)
        got = cp.zeros(64, np.float32)
        comm.recv(got, 0, tag=5)
        assert np.array_equal(cp.asnumpy(got), np.arange(64, dtype=np.float32) + 1), \
            f"{where}: the sender overwrote its buffer before the receiver read it"


def check_mismatch(comm, cp, where):
    """Rank 0 sends 16 bytes, rank 1 expects 32: under cuda-ipc both raise a CommError, neither hangs
    (the MPI transports leave the check to the receive's size contract)."""
    if comm.size < 2 or comm.rank > 1:
        return None
    peer = 1 - comm.rank
    buf = cp.zeros(4 if comm.rank == 0 else 8, np.float32)
    try:
        if comm.rank == 0:
            comm.send(buf, peer, tag=7)
        else:
            comm.recv(buf, peer, tag=7)
    except mtcomm.CommError as e:
        return str(e).splitlines()[0][:200]
    raise AssertionError(f"{where}: rank {comm.rank}: a size mismatch went through")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--transports", nargs="*", default=["auto", "cuda-ipc", "cuda-ipc/host", "pinned-staging"])
    p.add_argument("--mismatch", action="store_true", help="also check that a size mismatch raises on both ranks")
    args = p.parse_args()
    backend.set_device("cuda")
    comm = mtcomm.init(timeout=60)
    cp = backend._import_cupy()
    seen = set()
    comm.mpi_comm = Spy(comm.mpi_comm, seen)
    report = {"size": comm.size, "negotiated": T.describe(comm), "note": comm.transport_note, "transports": {}}
    for name in args.transports:
        want, _, sync = name.partition("/")
        if want != "auto":
            comm.transport.close()
            comm.transport, comm.transport_note = T.choose(comm, want)
        if sync:
            comm.transport.sync = sync
        t = comm.transport
        if hasattr(t, "ack_comm") and not isinstance(t.ack_comm, Spy):
            t.ack_comm = Spy(t.ack_comm, seen)
        where = f"[rank {comm.rank}] {name} ({t.name})"
        entry = {"name": t.name, "sync": getattr(t, "sync", None), "checks": check_collectives(comm, cp, where)}
        entry.update(check_bytes_and_reuse(comm, cp, where))
        check_send_completion(comm, cp, where)
        sub = comm.split(comm.rank % 2)
        assert sub.transport is not None and sub.transport.name == t.name, f"{where}: the split lost the transport"
        x = cp.asarray(rank_input(sub.rank, 257, "float64"))
        work = R.ring_all_reduce(sub, x, async_op=True)
        want = np.stack([rank_input(q, 257, "float64") for q in range(sub.size)]).sum(0)
        assert np.array_equal(cp.asnumpy(work.wait()), want), f"{where}: async all-reduce on a split"
        if args.mismatch and t.name == "cuda-ipc":
            entry["mismatch"] = check_mismatch(comm, cp, where)
        report["transports"][name] = entry
        R.ring_all_reduce(comm, cp.zeros(1, np.float32))        # every rank done before the next transport
    devices = sorted(t for t in seen if "cupy" in t)
    if T.mpi_is_cuda_aware():        # the direct path: device buffers go to MPI as they are
        assert devices, f"[rank {comm.rank}] MPI is CUDA-aware, yet no device buffer went to it directly"
    else:
        assert not devices, f"[rank {comm.rank}] device arrays reached mpi4py: {devices}"
    report["mpi4py_saw"] = sorted(seen)
    rows = R.ring_all_gather(comm, np.array([len(seen)], np.int64), total=comm.size)
    if comm.rank == 0:
        report["ranks_checked"] = int((rows > 0).sum())
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: report[k] for k in ("negotiated", "note")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
