"""Ring all-reduce bus bandwidth over each device transport, beside MPI's and NCCL's own all-reduce.

    mpirun -n 2 python scripts/bench_gpu_collectives.py [--max-mib 256] [--configs ...] [--json out.json]
    PYTHONPATH=tests/standin CUPY_STANDIN_IPC=1 mpiexec -n 2 python scripts/bench_gpu_collectives.py --tiny

On device buffers of float32, 1 KiB to 256 MiB (x4 steps): minitrain's ring_all_reduce over each
transport that works here (cuda-ipc with interprocess events and with host syncs, pinned-staging,
cuda-aware-mpi), MPI_Allreduce on the same data staged the same way (device -> pinned -> MPI in
place -> device; directly on the device buffer where MPI is CUDA-aware), and under NCCL (where it
runs: one GPU per rank) the ring on NCCL's send/recv and NCCL's own all-reduce. Time: blocks of
back-to-back calls closed by a device synchronisation (as nccl-tests), the slowest rank's, median
of 3 blocks; busbw = bytes / time * 2(p-1)/p (nccl-tests' definition). Every result is checked
(integer-valued floats: exact). Goals (issue 16; one H100 shared by 2 ranks): the ring over
cuda-ipc >= 250 GB/s at 64 MiB; the staged ring >= 0.8x MPI's all-reduce on the same staging.
"""
import argparse
import inspect
import json
import statistics
import sys
import time

import numpy as np

from minitrain import backend, cli
from minitrain import comm as mtcomm
from minitrain.comm import rings as C
from minitrain.comm import transport as T

GOAL_IPC_GBPS, GOAL_IPC_BYTES, GOAL_STAGED_RATIO = 250.0, 64 << 20, 0.8


def busbw(nbytes, seconds, p):
    return nbytes / seconds * 2 * (p - 1) / p / 1e9


class Bench:
    def __init__(self, comm, args):
        from mpi4py import MPI
        self.MPI, self.comm, self.args = MPI, comm, args
        self.mpi = comm.mpi_comm if hasattr(comm, "mpi_comm") else comm.bootstrap.mpi_comm
        self.cp = backend._import_cupy()
        self.p = comm.size
        top = args.sizes[-1] // 4
        base = (self.cp.arange(top, dtype=np.float32) % 7)
        self.x = base + comm.rank                                  # one allocation each: IPC opens it once
        self.want = base * self.p + sum(range(self.p))
        self.out = self.cp.empty(top, np.float32)
        self.pinned = np.frombuffer(self.cp.cuda.alloc_pinned_memory(top * 4), np.float32, top)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def time(self, fn):
        """Seconds per call: blocks of back-to-back calls closed by a sync, the slowest rank, median."""
        MPI, mpi, args = self.MPI, self.mpi, self.args
        fn()
        self.sync()
        mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        reps = int(np.clip(args.min_time / 3 / max(once, 1e-7), 1, args.max_reps))
        blocks = []
        for _ in range(3):
            mpi.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            self.sync()
            blocks.append(mpi.allreduce((time.perf_counter() - t0) / reps, op=MPI.MAX))
        return statistics.median(blocks)

    def verified(self, n):
        ok = bool(self.cp.array_equal(self.out[:n], self.want[:n]))
        return bool(self.mpi.allreduce(ok, op=self.MPI.LAND))

    def run(self, fn, n):
        self.out[:n] = -1
        seconds = self.time(fn)
        return seconds, self.verified(n)

    # ---- what is measured
    def ring(self, comm):
        return lambda n: C.ring_all_reduce(comm, self.x[:n], out=self.out[:n])

    def mpi_staged(self, n):
        x, out, host = self.x[:n], self.out[:n], self.pinned[:n]
        backend.to_host_into(x, host, blocking=False)
        self.sync()
        self.mpi.Allreduce(self.MPI.IN_PLACE, [host, self.MPI.FLOAT], op=self.MPI.SUM)
        backend.to_device_into(out, host)
        self.sync()

    def mpi_device(self, n):                        # CUDA-aware MPI only (mpi_buffer refuses otherwise)
        self.sync()
        x, out = T.mpi_buffer(self.x[:n])[0], T.mpi_buffer(self.out[:n])[0]
        self.mpi.Allreduce([x, self.MPI.FLOAT], [out, self.MPI.FLOAT], op=self.MPI.SUM)


def use_transport(comm, name):
    """Switch the communicator's device transport (collective); returns why not, or None."""
    want, _, sync = name.partition("/")
    try:
        transport, note = T.choose(comm, want)
    except mtcomm.CommError as e:
        return str(e)
    if comm.transport is not None:
        comm.transport.close()
    comm.transport, comm.transport_note = transport, note
    if sync:
        transport.sync = sync
    return None


def init(check_collectives):
    kwargs = {}
    if "check_collectives" in inspect.signature(mtcomm.init).parameters:      # issue 15's option
        kwargs["check_collectives"] = check_collectives
    return mtcomm.init(**kwargs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--max-mib", type=cli.largest_mib, default=256, help="largest message, MiB (sizes from 1 KiB, x4 steps)")
    ap.add_argument("--configs", nargs="*", action=cli.Distinct, default=["ring/cuda-ipc", "ring/cuda-ipc/host",
                    "ring/pinned-staging",
                                                    "ring/cuda-aware-mpi", "mpi/staged", "mpi/device", "nccl"],
                    help="what to measure: ring/TRANSPORT[/host], mpi/staged, mpi/device, nccl (those that cannot "
                         "run here are named with the reason)")
    ap.add_argument("--min-time", type=cli.positive_float, default=0.3, help="seconds measured per point (3 blocks)")
    ap.add_argument("--max-reps", type=cli.positive_int, default=200, help="calls per block at most")
    ap.add_argument("--check-collectives", action="store_true",
                    help="compare every call's arguments across ranks first (issue 15's check)")
    ap.add_argument("--tiny", action="store_true", help="CI: 1 KiB and 16 KiB, one call per block")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results there (default: no file)")
    args = ap.parse_args(argv)
    if args.tiny:
        for option in sorted(cli.given_options(ap, argv) & {"--max-mib", "--min-time", "--max-reps"}):
            cli.refuse(ap, option, "--tiny", "--tiny sets the sizes, 1 KiB and 16 KiB, and one call per block")
    args.sizes = [1024 << (2 * k) for k in range(20) if (1024 << (2 * k)) <= args.max_mib * (1 << 20)]
    if args.tiny:
        args.sizes, args.min_time, args.max_reps = [1024, 16384], 0.0, 1
    backend.set_device("cuda")
    comm = init(args.check_collectives)
    if comm.size < 2:
        ap.error("a ring all-reduce on one rank sends nothing (busbw's 2(p-1)/p is 0): start it with mpiexec -n 2 "
                 "or more")
    bench = Bench(comm, args)
    p, rank = comm.size, comm.rank
    negotiated, note = T.describe(comm), comm.transport_note
    results, unavailable, syncs = {}, {}, {}

    def measure(name, fn):
        rows = []
        for size in args.sizes:
            seconds, ok = bench.run(lambda: fn(size // 4), size // 4)
            rows.append({"bytes": size, "seconds": seconds, "busbw_GBps": busbw(size, seconds, p), "verified": ok})
        results[name] = rows

    for name in args.configs:
        if name.startswith("ring/") and name != "ring/nccl":
            why = use_transport(comm, name[len("ring/"):])
            if why:
                unavailable[name] = why
                continue
            measure(name, bench.ring(comm))
            syncs[name] = getattr(comm.transport, "sync", None)
        elif name == "mpi/staged":
            measure(name, bench.mpi_staged)
        elif name == "mpi/device":
            if not T.mpi_is_cuda_aware():
                unavailable[name] = "MPI is not CUDA-aware: a device buffer cannot be handed to it"
                continue
            measure(name, bench.mpi_device)
        elif name == "nccl":
            from minitrain.comm.nccl import NCCLCommunicator
            try:
                nccl = NCCLCommunicator(comm)
            except mtcomm.CommError as e:
                unavailable["nccl"] = str(e).split("] ", 1)[-1]
                continue
            measure("ring/nccl", bench.ring(nccl))
            measure("nccl/all_reduce", lambda n: nccl.nccl_all_reduce(bench.x[:n], out=bench.out[:n]))
        else:
            raise SystemExit(f"unknown config {name!r}")
    report = {"device": backend.describe_device(), "world_size": p, "mpi": bench.MPI.Get_library_version().splitlines()[0],
              "negotiated_transport": negotiated, "note": note, "check_collectives": args.check_collectives,
              "sizes": args.sizes, "results": results, "ipc_sync": {k: v for k, v in syncs.items() if v},
              "unavailable": unavailable, "goals": goals(results, p)}
    if rank == 0:
        print_report(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    failed = [name for name, rows in results.items() if not all(r["verified"] for r in rows)]
    if failed:
        raise SystemExit(f"wrong all-reduce results: {failed}")
    return 0


def at(results, name, nbytes):
    for row in results.get(name, []):
        if row["bytes"] == nbytes:
            return row
    return None


def goals(results, p):
    out = {}
    ipc = at(results, "ring/cuda-ipc", GOAL_IPC_BYTES)
    if ipc:
        out["ring_cuda_ipc_busbw_64MiB_GBps"] = {"measured": ipc["busbw_GBps"], "goal": GOAL_IPC_GBPS}
    staged, anchor = results.get("ring/pinned-staging"), results.get("mpi/staged")
    if staged and anchor:
        ratios = [a["seconds"] / s["seconds"] for s, a in zip(staged, anchor)]
        big = [r for r, s in zip(ratios, staged) if s["bytes"] >= 1 << 20] or ratios
        out["ring_staged_over_mpi_staged"] = {"by_size": ratios, "geomean_from_1MiB": float(np.exp(np.mean(np.log(big)))),
                                              "goal": GOAL_STAGED_RATIO}
    return out


def fmt_size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def print_report(r):
    names = list(r["results"])
    print(f"ring all-reduce, float32, {r['world_size']} ranks on {r['device']}; {r['mpi']}")
    print(f"negotiated transport: {r['negotiated_transport']}" + (f" ({r['note']})" if r["note"] else "")
          + f"; check_collectives {'on' if r['check_collectives'] else 'off'}")
    print("bus bandwidth GB/s (nccl-tests: bytes/time x 2(p-1)/p); time per call in brackets")
    for name, sync in r["ipc_sync"].items():
        print(f"{name}: ordering by {'interprocess CUDA events' if sync == 'event' else 'host stream syncs'}")
    print(f"{'size':>8} " + " ".join(f"{n:>24}" for n in names))
    for i, size in enumerate(r["sizes"]):
        cells = []
        for n in names:
            row = r["results"][n][i]
            mark = "" if row["verified"] else " WRONG"
            cells.append(f"{row['busbw_GBps']:>9.2f} ({row['seconds'] * 1e6:>9.1f} us){mark}")
        print(f"{fmt_size(size):>8} " + " ".join(f"{c:>24}" for c in cells))
    for name, why in r["unavailable"].items():
        print(f"{name}: not measured: {why}")
    g = r["goals"]
    if "ring_cuda_ipc_busbw_64MiB_GBps" in g:
        e = g["ring_cuda_ipc_busbw_64MiB_GBps"]
        print(f"ring over cuda-ipc at 64 MiB: {e['measured']:.1f} GB/s bus bandwidth (goal >= {e['goal']:.0f})")
    if "ring_staged_over_mpi_staged" in g:
        e = g["ring_staged_over_mpi_staged"]
        print("ring over pinned-staging / MPI_Allreduce staged alike (time ratio, > 1: the ring is faster): "
              + ", ".join(f"{fmt_size(s)} {x:.2f}" for s, x in zip(r["sizes"], e["by_size"]))
              + f"; geometric mean from 1 MiB {e['geomean_from_1MiB']:.2f} (goal >= {e['goal']})")


if __name__ == "__main__":
    sys.exit(main())
