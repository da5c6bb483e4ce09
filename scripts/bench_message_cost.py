"""What one point-to-point message costs its caller, warm and right after a compute, beside MPI's own;
and how late it lands at a rank that waits for it, sleeping or yielding.

    python scripts/bench_message_cost.py [--repeats 60] [--bytes 65536] [--evict-mib 16] [--wait-us 300]

A pipeline stage posts each message right after its forward or backward, whose arithmetic has just
evicted the caches: the Python and MPI code of a send then runs from memory, not from cache. This
script times, at p = 2, the caller's side of minitrain's isend (rank 0) and irecv (rank 1), the
communicator with its guard (flight record, byte counts), and of mpi4py's Isend / Irecv on the same
buffer, each with warm caches and right after a matmul that streams --evict-mib MiB through them.
Median of --repeats; ratios to mpi4py's in the same run. Then the receiver's wake-up: rank 1
waits in wait_all for a message that rank 0 sends --wait-us later, once with a pipeline receive's
poll that sleeps at once and once with the one that yields first (messages.waiting_poll: 1 ms of
sched_yield, then 50 us sleeps); the latency is from the send posted to the wait returning (one
clock for both processes of a host). It launches itself under mpiexec.
"""
import argparse
import json
import time

import numpy as np

from minitrain import cli


def worker(args):
    from mpi4py import MPI

    from minitrain import comm as C
    from minitrain.parallel.pipeline.messages import SLEEP_S, YIELD_S
    comm = C.init()
    mpi, peer = comm.mpi_comm, 1 - comm.rank
    buf, into = np.ones(args.bytes // 4, np.float32), np.empty(args.bytes // 4, np.float32)
    side = int(np.sqrt(args.evict_mib * 2 ** 20 / 4 / 2))
    evict = np.random.default_rng(0).random((2, side, side), dtype=np.float32)
    # (name, rank 0's call, rank 1's call): each rank times its own side of the same message
    pairs = [("minitrain", lambda: comm.isend(buf, peer, 5), lambda: comm.irecv(into, peer, 5)),
             ("mpi4py", lambda: mpi.Isend([buf, MPI.BYTE], peer, 7), lambda: mpi.Irecv([into, MPI.BYTE], peer, 7))]
    mine = {}
    for cold in (False, True):
        for name, send, recv in pairs:
            call, times = send if comm.rank == 0 else recv, []
            for _ in range(args.repeats):
                comm.barrier()
                if cold:
                    evict[0] @ evict[1]
                start = time.perf_counter()
                request = call()
                times.append(time.perf_counter() - start)
                request.Wait() if hasattr(request, "Wait") else comm.wait_all([request])
            mine[f"{name} {'send' if comm.rank == 0 else 'recv'} {'cold' if cold else 'warm'}"] = float(np.median(times))
    for name, poll in (("sleeping", (0.0, SLEEP_S)), ("yielding", (YIELD_S, SLEEP_S))):
        latencies = []
        for _ in range(args.repeats):
            comm.barrier()
            if comm.rank == 0:
                time.sleep(args.wait_us * 1e-6)
                posted = time.perf_counter()
                comm.wait_all([comm.isend(buf, peer, 9)])
                mpi.send(posted, dest=peer, tag=10)
            else:
                request = comm.irecv(into, peer, 9)
                comm.wait_all([request], poll=poll)
                latencies.append(time.perf_counter() - mpi.recv(source=peer, tag=10))
        if comm.rank == 1:
            mine[f"latency {name}"] = float(np.median(latencies))
    both = mpi.gather(mine, root=0)
    if comm.rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({k: v for part in both for k, v in part.items()}, f)


def message_bytes(text):
    """--bytes: a message of float32 elements, so a positive multiple of 4."""
    value = cli.positive_int(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"must be a multiple of 4 (float32 elements), got {text}")
    return value


def wait_us(text):
    """--wait-us: microseconds the sender waits, each of the repeats (a second or more would be minutes in all)."""
    value = cli.nonneg_float(text)
    if value >= 1e6:
        raise argparse.ArgumentTypeError(f"must be below 1e6 (one second, waited by each repeat), got {text}")
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--repeats", type=cli.positive_int, default=60, help="messages per call and cache state")
    ap.add_argument("--bytes", type=message_bytes, default=65536, help="the message's size (a multiple of 4)")
    ap.add_argument("--evict-mib", type=cli.positive_float, default=16.0, help="MiB the matmul before a 'cold' call streams")
    ap.add_argument("--wait-us", type=wait_us, default=300.0, help="how long after the receiver starts waiting the sender sends")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        return worker(args)
    from minitrain.testing import run_worker
    out = run_worker(__file__, 2, ["--repeats", args.repeats, "--bytes", args.bytes, "--evict-mib", args.evict_mib,
                                   "--wait-us", args.wait_us])
    print(f"one message of {args.bytes} B at p = 2, the caller's time (median of {args.repeats}); cold: right after "
          f"a matmul streaming {args.evict_mib:g} MiB")
    print(f"  {'call':<16} {'warm':>9} {'cold':>9} {'cold / mpi4py cold':>19}")
    for side in ("send", "recv"):
        for name in ("minitrain", "mpi4py"):
            warm, cold = out[f"{name} {side} warm"], out[f"{name} {side} cold"]
            print(f"  {name + ' ' + side:<16} {warm * 1e6:>7.1f}us {cold * 1e6:>7.1f}us "
                  f"{cold / out[f'mpi4py {side} cold']:>18.2f}x")
    sleeping, yielding = out["latency sleeping"], out["latency yielding"]
    print(f"landing at a rank that waits ({args.wait_us:g} us before the send): sleeping {sleeping * 1e6:.1f}us, "
          f"yielding {yielding * 1e6:.1f}us ({yielding / sleeping:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
