"""The GPT job's axes combined (dp x pp x cp x tp, ZeRO on dp x cp, zero-bubble schedules, experts
under pipelines, dropout) at 4 and 8 ranks: each layout trains with one process's losses (float64, 1e-10, 10
steps). The axes' own tests (test_context_parallel, test_gpt_zero, test_gpt_zero_bubble, test_moe_3d,
test_expert_parallel) each vary one; this file checks that they meet."""
import numpy as np
import pytest
from gpt_layouts import run_layouts

JOB = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 4, "--block-size", 16,
       "--batch-size", 4, "--sample-chars", 0, "--steps", 10]
LAUNCHES = {   # ranks -> {name: extra options}
    4: {"cp2 dp2 zero1": ["--cp", 2, "--dp", 2, "--zero", 1],
        "cp2 pp2 zbv": ["--cp", 2, "--pp", 2, "--schedule", "zbv", "--microbatches", 2],
        "pp2 dp2 zb_h1 zero2": ["--pp", 2, "--dp", 2, "--schedule", "zb_h1", "--microbatches", 2, "--zero", 2],
        "moe pp2 dp2 zbv": ["--moe-experts", 4, "--pp", 2, "--dp", 2, "--schedule", "zbv"],
        "tp2 dp2 dropout": ["--tp", 2, "--dp", 2, "--dropout", 0.1],
        "cp2 dp2 dropout": ["--cp", 2, "--dp", 2, "--dropout", 0.1]},
    8: {"pp2 cp2 tp2 zb_h1 zero1": ["--pp", 2, "--cp", 2, "--tp", 2, "--schedule", "zb_h1", "--microbatches", 2,
                                    "--zero", 1],
        "dp2 cp2 tp2 ulysses zero3": ["--dp", 2, "--cp", 2, "--tp", 2, "--cp-method", "ulysses", "--zero", 3]},
}
ONE_PROCESS = {"dense": [], "moe": ["--moe-experts", 4, "--moe-groups", 2],   # the MoE run's groups: dp x m
               "dropout": ["--dropout", 0.1]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("axes"), JOB, LAUNCHES, ONE_PROCESS)


@pytest.mark.parametrize("name", [name for layouts in LAUNCHES.values() for name in layouts])
def test_the_axes_combined_train_with_one_process_s_losses(runs, name):
    """With dropout too: every site's mask is one process's at the rows, positions and heads a rank holds."""
    reports, one = runs
    report = reports[name]
    reference = one[next((kind for kind in ("moe", "dropout") if kind in name.split()), "dense")]
    assert report["world_size"] == (8 if name in LAUNCHES[8] else 4)
    for axis in ("dp", "pp", "tp"):
        assert report[axis] == (2 if f"{axis}2" in name.split() else 1)
    assert report["cp"]["size"] == (2 if "cp2" in name.split() else 1)
    assert report["zero"] == next((int(w[-1]) for w in name.split() if w.startswith("zero")), 0)
    assert len(report["losses"]) == len(reference["losses"]) == 10
    np.testing.assert_allclose(report["losses"], reference["losses"], rtol=1e-10, atol=0)
    # the validation losses: the forward alone through the mesh (GPT3D.eval_step), no rank holding the whole model
    for key in ("initial_val_loss", "final_val_loss"):
        assert report[key] == pytest.approx(reference[key], rel=1e-12), key
    if name.startswith("moe"):
        assert report["moe"]["tokens_dropped"] == reference["moe"]["tokens_dropped"]
        np.testing.assert_allclose(report["moe"]["aux_loss"], reference["moe"]["aux_loss"], rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", [name for layouts in LAUNCHES.values() for name in layouts if "cp2" in name.split()])
def test_the_cp_block_reads_a_rank_with_blocks(runs, name):
    """Under zbv stage 0 holds only the embedding and the head: the "cp" block reads the first rank with blocks
    (rank 2 there), its bytes the formula's and its cp ranks' work balanced, not rank 0's 0 B beside a NaN."""
    cp = runs[0][name]["cp"]
    assert cp["bytes_from"] == ("rank 2" if "zbv" in name.split() else "rank 0")
    assert cp["bytes_per_step"] == cp["bytes_formula"] > 0
    assert cp["compute_max_over_mean"] == 1.0


def test_validation_runs_in_eval_mode(runs):
    """The validation before training is the forward in eval mode, dropout off: one process's without dropout."""
    for name in ("tp2 dp2 dropout", "cp2 dp2 dropout"):
        report, reference = runs[0][name], runs[1]["dense"]
        assert report["initial_val_loss"] == pytest.approx(reference["initial_val_loss"], rel=1e-12)
        assert report["losses"][0] != pytest.approx(reference["losses"][0], rel=1e-6)      # dropout did train
