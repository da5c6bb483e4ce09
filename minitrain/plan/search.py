"""--search: every valid layout of a model on its ranks that fits, fastest first (the planner's one search).

The GPT's candidates are plan/layout.py's layouts (dp x pp x cp x tp x ep, ZeRO, recomputation, micro-batches), with
context parallelism at the powers of two that leave each rank CP_MIN_TOKENS tokens or more, then ZB-H1 and ZB-V in
place of 1F1B where they could beat the fastest found; the MLP's are its data-parallel strategies and its pipelines;
params' the ZeRO stages with and without offload, smallest first.
"""
import math
from dataclasses import replace

from ..parallel.pipeline.schedules import SPLIT_BACKWARD, default_chunks
from . import MLP_PIPELINE_PRECISIONS, Layout, LayoutError, check, layouts, predict

CP_MIN_TOKENS = 1024            # --search tries context parallelism down to this many tokens per rank


def search(model, base, machine, accounting, device_memory):
    """Every valid layout of ``model`` on base.world ranks that fits, fastest first (params: smallest)."""
    if model.kind == "gpt":          # cp: powers of two that leave each rank 1024 tokens or more (or the one asked)
        cps = {base.cp} | {c for c in (2, 4, 8, 16, 32, 64) if model.block_size // c >= CP_MIN_TOKENS}
        candidates = layouts(model, base.world, base.batch_size, precision=base.precision, optimizer=base.optimizer,
                             cps={1} | cps)
    elif model.kind == "params":
        candidates = [Layout(world=base.world, dp=base.world, zero=z, precision=base.precision,
                             optimizer=base.optimizer, offload=o, batch_size=base.world)
                      for z in range(4) for o in (False, True)]
    else:
        candidates = []
        for strategy in ("ddp", "zero1", "zero2", "zero3"):
            candidates.append(Layout(**{**base.fields(), "dp": base.world, "pp": 1, "zero": int(strategy[-1])
                                        if strategy != "ddp" else 0, "microbatches": 1}))
        pipelines = base.precision in MLP_PIPELINE_PRECISIONS
        for dp in (d for d in range(1, base.world + 1) if pipelines and base.world % d == 0 and base.world // d > 1):
            for m in (1, 2, 4, 8, 16):
                for schedule in ("gpipe", "1f1b", "zb_h1"):
                    candidates.append(Layout(**{**base.fields(), "dp": dp, "pp": base.world // dp, "zero": 0,
                                                "microbatches": m, "schedule": schedule, "chunks": 1,
                                                "recompute": "none", "offload": False, "offload_activations": False}))
    fitting = lambda layout: _fitting(model, layout, machine, accounting, device_memory)     # noqa: E731
    results = [(layout, r) for layout, r in ((x, fitting(x)) for x in candidates) if r is not None]
    if model.kind == "gpt":
        results += _zero_bubble(results, fitting)
    key = (lambda r: r["memory_bytes"]["total"]) if model.kind == "params" else (lambda r: r["step_time_s"]["total"])
    return sorted((r for _, r in results), key=key)


def _fitting(model, layout, machine, accounting, device_memory):
    """The prediction for a valid layout that fits, else None."""
    try:
        check(model, layout)
    except LayoutError:
        return None
    result = predict(model, layout, machine, accounting, device_memory, per_stage=False, time_if_unfit=False)
    return result if result["fits"] else None


def _zero_bubble(results, fitting, tries=16):
    """ZB-H1 and ZB-V in place of 1F1B, for the pipelined layouts whose compute and communication alone (a
    zero-bubble schedule's least: it keeps them and adds W's second visit) beat the fastest step found so far,
    the ``tries`` most promising. (Every layout under every schedule would take minutes at 512 devices.)"""
    fastest = min((r["step_time_s"]["total"] for _, r in results), default=math.inf)
    least = lambda r: r["step_time_s"]["total"] - r["step_time_s"]["bubble"]       # noqa: E731
    found = []
    # the most promising: ZB-H1 leaves about a third of 1F1B's bubble (Qi et al. 2024, sec. 3)
    pipelined = sorted(((layout, r) for layout, r in results if layout.pp > 1 and layout.schedule == "1f1b"),
                       key=lambda lr: least(lr[1]) + lr[1]["step_time_s"]["bubble"] / 3)
    for layout, r in pipelined[:tries]:
        if least(r) >= fastest:
            continue
        for schedule in SPLIT_BACKWARD:
            variant = replace(layout, schedule=schedule, chunks=default_chunks(schedule))
            result = fitting(variant)
            if result is not None:
                found.append((variant, result))
                fastest = min(fastest, result["step_time_s"]["total"])
    return found
