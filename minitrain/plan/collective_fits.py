"""The collectives calibrated: minitrain's own algorithms timed under mpiexec -n p (wall clock, the calling
thread's busy CPU, and as a job meets them after the anchor's compute) and fitted to t = steps·alpha +
bytes·beta with each algorithm's own step and byte counts (comm/collectives.py's cost table).
"""
import json
import math
import os
import time

import numpy as np

# steps and bytes per rank of each algorithm (p ranks, N bytes): comm/collectives.py's table
COLLECTIVES = {
    "p2p": lambda p, n: (1, n),
    "ring_all_reduce": lambda p, n: (2 * (p - 1), 2 * (p - 1) / p * n),
    "ring_reduce_scatter": lambda p, n: (p - 1, (p - 1) / p * n),
    "ring_all_gather": lambda p, n: (p - 1, (p - 1) / p * n),
    "broadcast": lambda p, n: (math.ceil(math.log2(p)), math.ceil(math.log2(p)) * n),
    "all_to_all": lambda p, n: (p - 1, (p - 1) / p * n),      # pairwise exchange: p-1 rounds (alltoallv.py)
}


def fit_alpha_beta(points, name, p):
    """Least squares of t = steps·alpha + bytes·beta over [(nbytes, seconds)], in relative error (each
    point weighted by 1/t, so that small messages count as much as large ones); both kept >= 0."""
    rows = [COLLECTIVES[name](p, n) for n, _ in points]
    a = np.array(rows, np.float64)
    t = np.array([s for _, s in points], np.float64)
    (alpha, beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    if beta <= 0:
        alpha, beta = float(np.min(t / a[:, 0])), 1e-12
    if alpha <= 0:
        alpha, beta = 1e-7, float(np.median(t / a[:, 1]))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "points": [[int(n), float(s)] for n, s in points]}


ROUNDS = 3     # in-a-job rounds, each over every collective and size in turn, taken seconds apart


def _worker(out_path, sizes, rounds=ROUNDS):
    """Under mpiexec: time every collective at every size (best of 8, slowest rank), by the wall clock and by
    the CPU time the calling thread spends outside its waits (its copies, reductions and calls: the part a
    shared machine distorts least, which the jobs report as busy); and as a job meets it ("job_*": the median
    of 9, each called after the anchor's few milliseconds of compute, without a barrier, so the ranks arrive
    apart and the caches are the compute's: on this 2-core machine 1.5-3x the best case; only where the ranks
    fit the cores); and its busy CPU right after that compute with the ranks aligned ("cold_busy_*": the
    collective's own Python and copies run from memory, not cache, as a tensor-parallel layer's collectives do
    after its matmuls: 2-3x the warm busy CPU here); rank 0 writes JSON. The in-a-job medians are the lowest of
    ``rounds`` rounds (ROUNDS; --quick: 1), each over every collective and size, so that they are taken
    seconds apart: a spell of another load on one core lasts 0.3-1 s here, and two rounds of one size 30 ms
    apart both fell in one (a 2-rank all-gather's in-a-job fixed cost read 106-335 us over four calibrations,
    and priced ZeRO-3 3.7x its step). Between rounds, one series of the anchor for typical_job
    (job_overheads._typical_in_a_job)."""
    from .. import backend, comm as mtcomm
    c = mtcomm.init()
    backend.hold_host_memory()          # freed memory kept, as the jobs run (else the anchor faults after a 16 MiB one)
    xp, sync = backend.xp(), backend.synchronize
    results = {}
    from ..comm.waiting import waiting_cpu_seconds
    from .anchor import anchor
    from .job_overheads import measure_in_a_job, typical_series
    # ranks that outnumber the cores take turns: an in-a-job median would count the turns, which the planner
    # already charges to the compute (its ranks / cores factor); there, the best case only
    fits_the_cores = backend.get_device() != "cpu" or c.size <= (os.cpu_count() or 1)

    def timed(op, n, aligned, after_compute):
        """(wall, busy CPU outside the waits) of n calls of op: each after a barrier (``aligned``) and/or
        right after the anchor's compute (``after_compute``)."""
        walls, own = [], []
        for _ in range(n):
            if aligned:
                c.barrier()
            if after_compute:
                anchor()
            t, cpu = time.perf_counter(), time.thread_time() - waiting_cpu_seconds()
            op()
            sync()
            walls.append(time.perf_counter() - t)
            own.append(time.thread_time() - waiting_cpu_seconds() - cpu)
        return walls, own

    arrays = {n: (xp.ones(n // 4, np.float32), xp.empty(n // 4, np.float32)) for n in sizes}
    names = [name for name in COLLECTIVES if name != "p2p" or c.size >= 2]
    ops = {(name, n): _op(c, mtcomm, name, *arrays[n]) for name in names for n in sizes}
    best = {key: timed(op, 9, aligned=True, after_compute=False) for key, op in ops.items()}

    def in_a_job(key):
        job, _ = timed(ops[key], 9, aligned=False, after_compute=True)     # as a job meets it
        _, own = timed(ops[key], 9, aligned=True, after_compute=True)      # all ranks at once
        return float(np.median(job)), float(np.median(own))
    typical = []
    lowest = lowest_of_rounds(list(ops), in_a_job, rounds if fits_the_cores else 0,
                              lambda: typical.append(typical_series(c)) if c.size == 2 else None)
    for name in names:
        points, busy, job_points, cold_points = [], [], [], []
        for n in sizes:
            times, own = best[name, n]
            mine = np.array([min(times[1:]), min(own[1:]), *lowest.get((name, n), (0.0, 0.0))])
            slowest = mtcomm.all_reduce(c, mine, op="max")                # best of 8, as the others
            points.append((n, float(slowest[0])))
            busy.append((n, float(slowest[1])))
            job_points.append((n, float(slowest[2])))
            cold_points.append((n, float(slowest[3])))
        if c.rank == 0:
            results[name] = fit_alpha_beta(points, name, c.size)
            for kind, measured in [("busy_", busy)] + ([("job_", job_points), ("cold_busy_", cold_points)]
                                                        if fits_the_cores else []):
                results[name].update({kind + k: v for k, v in fit_alpha_beta(measured, name, c.size).items()})
    if c.size == 2:
        results["overheads"] = measure_in_a_job(c, typical_runs=typical or None)
    if c.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def lowest_of_rounds(keys, measure, rounds, between):
    """{key: the lowest over ``rounds`` rounds of each figure measure(key) returns}: each round measures every
    key in turn, then calls ``between``, so that one key's rounds are taken seconds apart and a spell of
    another load lasts through one of them, not all."""
    lowest = {}
    for _ in range(rounds):
        for key in keys:
            lowest[key] = tuple(np.minimum(lowest.get(key, np.inf), measure(key)))
        between()
    return lowest


def _op(c, mtcomm, name, x, buf):
    """One call of the collective ``name`` on x (p2p: rank 0 sends x to rank 1's buf)."""
    if name == "p2p":
        def op():
            if c.rank == 0:
                c.send(x, 1, tag=7)
            elif c.rank == 1:
                c.recv(buf, 0, tag=7)
        return op
    rows = x[:x.size // c.size * c.size].reshape(c.size, -1)    # p equal blocks, as Ulysses and the experts send
    return {"all_to_all": lambda: mtcomm.all_to_all_single(c, rows, [1] * c.size, [1] * c.size),
            "ring_all_reduce": lambda: mtcomm.ring_all_reduce(c, x),
            "ring_reduce_scatter": lambda: mtcomm.ring_reduce_scatter(c, x),
            "ring_all_gather": lambda: mtcomm.ring_all_gather(c, x[:x.size // c.size], total=x.size // c.size * c.size),
            "broadcast": lambda: mtcomm.broadcast(c, buf, root=0)}[name]
