"""The GPT job in mixed precision (--precision bf16|fp16) on the mesh's axes against one process in the same
precision on the same global batches. 16-bit rounding follows the order of summation (a tp rank sums half a
matmul's inner dimension, a replica half the batch), so the runs cannot agree to fp64's 1e-12: they agree to
bf16's rounding: a gradient summed in another order rounds apart by 2^-8 relative (bf16's unit roundoff), and a
step's parameters are the fp32 masters rounded to bf16, a unit in the last place apart where that moved a master
across a rounding boundary. The tolerance is 2^-8 on the losses and the gradient norms (measured gaps: below
2^-9.5); a dropped gradient all-reduce, a step skipped by some ranks only, or the loss scale left in the
clipping norm moves them by far more (tried on purpose: see the report of this change).
fp16 with --init-scale 2^17 overflows in its first step, in the first stage's gradients more than the last's: every
rank of the mesh skips it, as one process does (over dp the replicas' gradients are divided before they are summed,
as PyTorch's DDP and Megatron do: a sum that divided after would overflow at a scale one process's does not).
The MoE job on plain data parallelism (gpt_moe.py, dp4 ep2) seeds its backward with the scale / dp too: seeded
with the whole scale, a replica's gradients were dp times one process's and it skipped the second step as well.
"""
import numpy as np
import pytest
from gpt_layouts import run_layouts

TOLERANCE = 2.0 ** -8           # bf16's unit roundoff: one rounding of a weight
JOB = ["--no-progress", "--n-layer", 2, "--n-embd", 16, "--n-head", 2, "--block-size", 8, "--batch-size", 4,
       "--sample-chars", 0, "--steps", 4, "--lr", 0.01]
BF16, FP16 = ["--precision", "bf16"], ["--precision", "fp16", "--init-scale", 2 ** 17]
MOE = ["--moe-experts", 4, "--moe-aux-loss-coef", 1.0]   # a balancing loss that moves the router
LAYOUTS = {   # one 4-rank launch: name -> options (the first word: the one-process run it equals)
    "fp16 pp2 tp2 sp": FP16 + ["--pp", 2, "--tp", 2, "--sequence-parallel", "--microbatches", 2],
    "fp16 dp2 tp2 zero1": FP16 + ["--dp", 2, "--tp", 2, "--zero", 1],
    "bf16 pp2 dp2 zb_h1 zero3": BF16 + ["--pp", 2, "--dp", 2, "--schedule", "zb_h1", "--microbatches", 2, "--zero", 3],
    "bf16 cp2 dp2 zero2": BF16 + ["--cp", 2, "--dp", 2, "--zero", 2],
    "fp16-moe tp2 ep2": FP16 + MOE + ["--tp", 2, "--ep", 2],
    "fp16-moe4 dp4 ep2": FP16 + MOE + ["--ep", 2],      # gpt_moe.py's job: plain data parallelism over experts
    "fp16-moe tp2 ep2 zero1": FP16 + MOE + ["--tp", 2, "--ep", 2, "--zero", 1],   # the dense and the experts' shards
    "bf16-moe tp2 ep2 zero3": BF16 + MOE + ["--tp", 2, "--ep", 2, "--zero", 3],   # step on one verdict, one scale
}
ONE_PROCESS = {"bf16": BF16, "fp16": FP16, "fp16-moe": FP16 + MOE + ["--moe-groups", 2],   # groups: dp x m
               "bf16-moe": BF16 + MOE + ["--moe-groups", 2],
               "fp16-moe4": FP16 + MOE + ["--moe-groups", 4]}


def reference(name):
    return name.split()[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("mixed"), JOB, {4: LAYOUTS}, ONE_PROCESS, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_mesh_trains_in_mixed_precision_as_one_process_does(runs, name):
    reports, one = runs
    report, single = reports[name], one[reference(name)]
    assert report["precision"] == single["precision"] == reference(name)[:4]
    assert single["ranks"][0]["skipped_steps"] == single["skipped_steps"]
    assert report["skipped_steps"] == single["skipped_steps"]
    assert [r["skipped_steps"] for r in report["ranks"]] == [single["skipped_steps"]] * 4   # every rank alike
    assert report["loss_scale"] == single["loss_scale"]
    np.testing.assert_allclose(report["losses"], single["losses"], rtol=TOLERANCE, atol=0)
    assert [g is None for g in report["grad_norms"]] == [g is None for g in single["grad_norms"]]
    np.testing.assert_allclose([g for g in report["grad_norms"] if g is not None],
                               [g for g in single["grad_norms"] if g is not None], rtol=TOLERANCE, atol=0)
    assert report["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=TOLERANCE)


def test_fp16_overflows_then_steps_with_a_halved_scale(runs):
    """2^17 overflows the first step's fp16 gradients: skipped (no norm), the next three taken at 2^16; bf16 has no
    loss scale and skips nothing."""
    single = runs[1]["fp16"]
    assert single["skipped_steps"] == 1 and single["loss_scale"] == 2.0 ** 16
    assert single["grad_norms"][0] is None and min(single["grad_norms"][1:]) > 0
    assert runs[1]["bf16"]["skipped_steps"] == 0 and runs[1]["bf16"]["loss_scale"] == 1.0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_planner_predicts_the_ledger_s_peak_in_mixed_precision(runs, name):
    """The planner given the job's --precision (what plan_comparison hands it) against the heaviest rank's ledger:
    the fp32 master weights, moments and (while stepping) gradients, the 16-bit activations, and what stays fp32
    (LayerNorm's 1/σ, the log-probabilities of the loss); within 1% (ring attention's blocks: a few hundred bytes)."""
    planner = runs[0][name]["planner"]
    assert planner["predicted"]["memory_bytes"] == pytest.approx(planner["measured"]["memory_bytes"], rel=0.01)


def test_the_model_states_are_mixed_precision_s_bytes(runs):
    """2 bytes a parameter and a gradient, 12 for AdamW's fp32 moments and master: ZeRO-1's shard over dp 2 holds
    half the masters and moments, the ledger as the layout expects (the JSON's zero_memory)."""
    report = runs[0]["fp16 dp2 tp2 zero1"]
    for rank in report["zero_memory"]["ranks"]:
        assert rank["expected"] == rank["measured"]
        assert rank["measured"]["optimizer_state"] == 3 * rank["measured"]["params"]     # 12 bytes x half, 2 x all
    one = runs[1]["bf16"]["ranks"][0]["memory"]["persistent"]
    assert one["optimizer_state"] == 6 * one["params"] == 6 * one["grads"]


@pytest.mark.parametrize("name", ["fp16-moe tp2 ep2 zero1", "bf16-moe tp2 ep2 zero3"])
def test_the_dense_and_the_experts_shards_step_one_after_the_other(runs, name):
    """ZeRO with ep > 1: the dense shard (over dp) and the experts' (over dp / ep, wider) each keep fp32 masters
    and moments, and fp32 gradients only while they step, one after the other: the gradients' peak is the 16-bit
    ones and the larger fp32 copy, as the planner counts it (their sum would be the whole shard's and more)."""
    import contextlib
    import io
    import json
    from minitrain.plan.__main__ import main
    model = JOB[JOB.index("--n-layer"):JOB.index("--sample-chars")]
    options = [str(x) for x in model + LAYOUTS[name] + ["--moe-groups", 2]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["gpt", *options, "--world", "4", "--json"]) == 0
    peaks = json.loads(out.getvalue())["memory_bytes_per_stage"][0]["category_peaks"]
    states = ("params", "grads", "optimizer_state", "comm_buffers")       # (the activations: the routing's load)
    for rank in runs[0][name]["ranks"]:
        assert {c: rank["memory"]["peak"][c] for c in states} == {c: peaks[c] for c in states}
