"""One collective's seconds, Hockney's alpha-beta model: t = steps·alpha + bytes·beta (ring all-reduce:
2(p-1) steps, 2(p-1)/p·N bytes; RS / AG: half of that; all-to-all: p-1 pairwise rounds; p2p: 1 step, N
bytes), alpha and beta calibrated per algorithm and p by python -m minitrain.plan calibrate, else the
machine's link constants.
"""


def collective(machine, name, nbytes, p, node_span=None, busy=False, after_compute=False, in_job=False):
    """Seconds of one collective over p ranks (calibrated alpha/beta of that algorithm at the nearest
    measured p, its best case: the wait for a rank that arrives late is the compute's, priced at the slowest
    rank's median pace, typical(); else the machine's link constants with the ring's step and byte counts).
    Over one rank it moves nothing but still costs a call. ``busy``: only what the calling thread computes outside its
    waits (its copies, reductions and calls; calibrated alike; a datasheet machine: the call). ``after_compute``:
    called right after a layer's arithmetic, as tensor parallelism's collectives are: its Python and copies run
    from memory, not cache (the calibrated "cold_busy" fit, where measured: 2-3x the best case's busy CPU); the
    wall is the best case's plus that much, or the "job_" fit where larger: between two collectives each rank
    computes alike, and each waits for the other's jitter and wakes from its sleep (a 2-rank tensor-parallel
    GPT step waited 1.2 ms at its 31 collectives' header exchanges, where each rank meets the other first).
    ``in_job``: run on the progress thread while the ranks compute (FSDP's gathers and scatters), at the calibrated
    "job_" fit where measured (ranks unaligned, after a compute: 2-3x the best case on a 2-core machine, and
    ZeRO-3 + recomputation's step waited 1.5 ms for collectives the best case priced at 0.67 ms: measured.md)."""
    call = machine.get("collective_call_s", 0.0)
    if p <= 1:
        return call
    steps, sent = ring_steps(name, nbytes, p)
    table = machine.get("collectives", {}).get(name)
    if name == "all_to_all" and not table:       # pairwise exchange: p-1 rounds of a send and a receive each
        table = machine.get("collectives", {}).get("p2p")
    if table:
        fit = table[min(table, key=lambda k: (abs(int(k) - p), -int(k)))]
        own = "cold_busy_alpha_s" in fit
        q = None if own else _nearest_cold(table, p)
        if after_compute and (own or q):                     # its own CPU work longer by this much, wall and busy
            # (the array's copies and the call's Python from memory, not cache; where the ranks outnumber the
            # cores calibrate fits no cold CPU: the same array's excess at the nearest p that has one)
            cold_fit, at = (fit, (steps, sent)) if own else (table[q], ring_steps(name, nbytes, int(q)))
            extra = max(0.0, fitted(cold_fit, *at, "cold_busy_") - fitted(cold_fit, *at, "busy_"))
            if busy:
                if own:
                    return fitted(fit, steps, sent, "cold_busy_")
                return (fitted(fit, steps, sent, "busy_") if "busy_alpha_s" in fit else call) + extra
            # its wall at least as a job meets it: each rank waits for the other's jitter, and wakes from a sleep
            job = fitted(fit, steps, sent, "job_") if "job_alpha_s" in fit else 0.0
            return max(fitted(fit, steps, sent) + extra, job)
        if busy:
            return fitted(fit, steps, sent, "busy_") if "busy_alpha_s" in fit else call
        if in_job and "job_alpha_s" in fit:
            return fitted(fit, steps, sent, "job_")
        return fitted(fit, steps, sent)                      # the ranks arriving apart: in typical()
    if busy:
        return call
    links = machine["links"]
    link = links["intra_node"] if node_span is not None and node_span <= machine.get("gpus_per_node", 1) \
        else links["inter_node"]
    return steps * link["alpha_s"] + sent / link["bytes_per_s"]


def ring_steps(name, nbytes, p):
    """(steps, bytes each rank sends) of one collective of ``nbytes`` over p ranks."""
    return {"p2p": (1, nbytes), "all_to_all": (p - 1, (p - 1) / p * nbytes),   # pairwise, p-1 rounds
            "ring_all_reduce": (2 * (p - 1), 2 * (p - 1) / p * nbytes),
            "ring_reduce_scatter": (p - 1, (p - 1) / p * nbytes),
            "ring_all_gather": (p - 1, (p - 1) / p * nbytes)}[name]


def _nearest_cold(table, p):
    """The key of the nearest p with a "cold_busy_" fit (calibrated where the ranks fit the cores), or None."""
    cold = [k for k in table if "cold_busy_alpha_s" in table[k]]
    return min(cold, key=lambda k: (abs(int(k) - p), -int(k))) if cold else None


def fitted(fit, steps, sent, kind=""):
    """steps·alpha + bytes·beta of one calibrated fit: ``kind`` "" (the best case's wall), "busy_",
    "cold_busy_" or "job_" (calibrate's fits of the same collective, plan/collective_fits.py)."""
    return steps * fit[kind + "alpha_s"] + sent * fit[kind + "beta_s_per_byte"]
