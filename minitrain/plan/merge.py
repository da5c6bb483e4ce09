"""The best of several measurements: point by point, cell by cell, op by op and key by key (the rounds of
one calibration), and several calibrations of one machine merged into one (calibrate --merge, --comm-only).
"""
import math

from .alpha_beta import fitted
from .collective_fits import COLLECTIVES


# what the communication code's cost decides: recalibrated alone (--comm-only) when only that code changed
COMM_SCALARS = ("collective_call_s", "ddp_step_s", "ddp_byte_s", "fsdp_unit_s", "pipeline_action_s",
                "pipeline_action_byte_s", "pipeline_message_s", "pipeline_message_byte_s")


def merge(machines, comm_only=None):
    """Several calibrations of one machine as one: the least loaded whole (its anchor ran fastest; every
    constant in it was measured under that same load, which the jobs' own anchor then scales), with the
    collective fits, measured apart under mpiexec, that predict the least time for 1 MiB. How
    machines/cpu-2core.json was made. (Calibrations without an anchor: the first.) ``comm_only``: an earlier
    calibration keeps everything but the communication's costs, which come from these (the collectives as
    above, COMM_SCALARS each the least): for a change to the communication code alone (cpu-2core.json's
    collectives were remeasured so when every collective began checking its header with a neighbour)."""
    measured = ", ".join(m["measured"] for m in machines)
    if comm_only is not None:
        out = {**comm_only, **_least([{k: m[k] for k in COMM_SCALARS if k in m} for m in machines])}
        out["measured"] = f"{comm_only['measured']}; communication costs: the best of {measured}"
    else:
        out = dict(min(machines, key=lambda m: m.get("anchor_cpu_time_s", math.inf)))
        out["measured"] = f"{out['measured']}, the least loaded of: {measured}"
    out["collectives"] = {name: {p: _best_collective(machines, name, p)
                                 for p in sorted({q for m in machines for q in m["collectives"].get(name, {})})}
                          for name in COLLECTIVES}
    return out


def _best_collective(machines, name, p):
    """Of several calibrations' fits of one collective at p ranks, the best case's and the in-a-job one's
    that predict the least time for 1 MiB, chosen apart (the least disturbed of each)."""
    def one_mib(fit, kind=""):
        return fitted(fit, *COLLECTIVES[name](int(p), 1 << 20), kind)
    fits = [m["collectives"][name][p] for m in machines if p in m["collectives"].get(name, {})]
    out = dict(min(fits, key=one_mib))
    in_job = [fit for fit in fits if "job_alpha_s" in fit]
    if in_job:
        out.update({k: v for k, v in min(in_job, key=lambda fit: one_mib(fit, "job_")).items() if k.startswith("job_")})
    return out


def _most(curves):
    """Point by point, the fastest of several measurements of one [[n, FLOP/s]] curve."""
    return [[n, max(c[i][1] for c in curves)] for i, (n, _) in enumerate(curves[0])]


def _most_grid(grids):
    """Cell by cell, the fastest of several measurements of one rows x width grid."""
    return {**grids[0], "flops": [[max(g["flops"][i][j] for g in grids) for j in range(len(row))]
                                  for i, row in enumerate(grids[0]["flops"])]}


def _least_fits(tables, n=32768):
    """Op by op, the fit of several (per call, per element) that predicts the least time for n elements."""
    return {k: min((t[k] for t in tables if k in t), key=lambda fit: fit[0] + n * fit[1])
            for k in set().union(*tables)}


def _least(dicts):
    """Key by key, the smallest of several measurements of the same seconds."""
    return {k: min(d[k] for d in dicts if k in d) for k in set().union(*dicts)}
