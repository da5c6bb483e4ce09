"""The GPT job's mixture of experts (--moe-experts ..., examples/gpt_moe.py): in float64 two data-parallel
ranks train with one process's losses, dropless and with a capacity factor (one process given the same
--moe-groups drops the same tokens); the --json "moe" block; the options refused in one line; a resume
with another MoE configuration refused by name. A tiny GPT; both multi-rank runs in one mpiexec launch."""
import json
import sys

import numpy as np
import pytest

from minitrain.testing import run_mpi
from test_resume_guards import refused, run

from minitrain.examples import gpt

MOE = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 2, "--block-size", 16,
       "--batch-size", 4, "--sample-chars", 4, "--steps", 10, "--moe-experts", 4, "--moe-top-k", 2]
CAPACITY = ["--moe-capacity-factor", 1.0]


def one_process(tmp_path, name, extra):
    out = tmp_path / f"{name}.json"
    status, _, err = run(gpt, MOE + extra + ["--json", out])
    assert status == 0, err
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Dropless and with a capacity factor, on 2 data-parallel ranks (default --moe-groups: 2, one per rank)."""
    d = tmp_path_factory.mktemp("moe")
    argv = [str(a) for a in MOE]
    script = (f"import sys; from minitrain.examples import gpt; a = {argv!r}; "
              f"assert gpt.main(a + ['--json', {str(d / 'dropless.json')!r}]) == 0; "
              f"assert gpt.main(a + {[str(a) for a in CAPACITY]!r} + ['--json', {str(d / 'capacity.json')!r}]) == 0")
    run_mpi([sys.executable, "-c", script], n=2, timeout=240)
    return {name: json.loads((d / f"{name}.json").read_text()) for name in ("dropless", "capacity")}


def assert_same_run(report, reference):
    assert len(report["losses"]) == len(reference["losses"]) == 10
    np.testing.assert_allclose(report["losses"], reference["losses"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(report["moe"]["aux_loss"], reference["moe"]["aux_loss"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(report["moe"]["load_max_over_mean"], reference["moe"]["load_max_over_mean"],
                               rtol=1e-12, atol=0)
    assert report["moe"]["tokens_dropped"] == reference["moe"]["tokens_dropped"]


def test_dropless_dp2_trains_with_one_process_s_losses(two_ranks, tmp_path):
    report = two_ranks["dropless"]
    assert report["dp"] == 2 and report["moe"]["tokens_dropped"] == 0
    assert_same_run(report, one_process(tmp_path, "one", ["--moe-groups", 2]))


def test_with_a_capacity_factor_dp2_drops_what_one_process_drops_over_the_same_groups(two_ranks, tmp_path):
    report = two_ranks["capacity"]
    assert report["moe"]["tokens_dropped"] > 0
    assert_same_run(report, one_process(tmp_path, "groups2", CAPACITY + ["--moe-groups", 2]))
    other = one_process(tmp_path, "groups1", CAPACITY)   # capacity over the whole batch: other tokens dropped
    assert other["moe"]["tokens_dropped"] != report["moe"]["tokens_dropped"]


def test_the_json_moe_block_and_the_table_line(tmp_path):
    out = tmp_path / "r.json"
    status, stdout, err = run(gpt, MOE + CAPACITY + ["--moe-every", 2, "--json", out])
    assert status == 0, err
    moe = json.loads(out.read_text())["moe"]
    assert set(moe) == {"load_max_over_mean", "tokens_dropped", "aux_loss"}
    assert len(moe["load_max_over_mean"]) == len(moe["aux_loss"]) == 10
    assert all(1 <= x <= 4 for x in moe["load_max_over_mean"]) and isinstance(moe["tokens_dropped"], int)
    assert all(0 < a <= 4 * 0.01 for a in moe["aux_loss"])     # one layer: alpha ... E·alpha
    assert f"tokens dropped {moe['tokens_dropped']}," in stdout
    dense = tmp_path / "dense.json"
    assert run(gpt, MOE[:-4] + ["--json", dense])[0] == 0
    assert "moe" not in json.loads(dense.read_text())


@pytest.mark.parametrize("extra, needle", [
    (["--moe-top-k", 5], "--moe-top-k 5 exceeds --moe-experts 4"),
    (["--moe-every", 3], "--moe-every 3 exceeds --n-layer 2"),
    (["--moe-groups", 3], "--batch-size 4 does not split into --moe-groups 3 groups of whole rows\n"),
    (["--dp", 2, "--microbatches", 3], "--batch-size 4 does not split into --moe-groups 6 groups of whole rows (its "
                                       "default: one per data-parallel replica and micro-batch)"),
    (["--moe-groups", 3, "--dp", 2], "--moe-groups 3 is not a multiple of the 2 data-parallel replicas"),
    (["--moe-capacity-factor", 0], "argument --moe-capacity-factor: must be > 0"),
    (["--moe-experts", -1], "argument --moe-experts: must be >= 0"),
    (["--moe-top-k", 0], "argument --moe-top-k: must be >= 1"),
    (["--moe-aux-loss-coef", -1], "argument --moe-aux-loss-coef: must be >= 0"),
    (["--moe-experts", 0], "--moe-top-k is not supported with --moe-experts 0"),
])
def test_refused_in_one_line(extra, needle):
    refused(gpt, MOE + extra, needle)


def test_a_resume_with_another_moe_configuration_is_refused_by_name(tmp_path):
    d = tmp_path / "ckpt"
    assert run(gpt, MOE + ["--steps", 2, "--save-dir", d])[0] == 0
    status, _, err = run(gpt, MOE[:-3] + ["8", "--steps", 4, "--save-dir", d, "--resume",
                              "--override-opt-param-scheduler"])
    assert status != 0 and "moe_experts = 4 (--moe-experts), this one 8" in err, err
    dense = MOE[:-4] + ["--steps", 4, "--save-dir", d, "--resume", "--override-opt-param-scheduler"]
    status, _, err = run(gpt, dense)
    assert status != 0 and "moe_experts = 4 (--moe-experts), this one 0" in err, err


def test_a_step_s_figures_are_the_largest_load_ratio_over_layers_the_drops_and_aux_losses_summed():
    import minitrain
    from minitrain import nn
    from minitrain.examples.gpt_common import moe_layers, moe_step
    minitrain.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, moe_experts=4,
                                moe_top_k=1, moe_capacity_factor=0.5, moe_every=1))
    idx = np.random.default_rng(0).integers(0, 11, (4, 8))
    model(idx, idx)
    stats = [layer.statistics() for layer in moe_layers(model)]
    ratios = [s["load_max_over_mean"] for s in stats]
    assert len(stats) == 3 and len(set(ratios)) > 1             # the layers differ: max is not any one's
    ratio, dropped, aux = moe_step(model)
    assert ratio == max(ratios) and dropped == sum(s["tokens_dropped"] for s in stats) > 0
    assert aux == pytest.approx(sum(s["aux_loss"] for s in stats), rel=1e-12)


def test_under_cp_the_groups_are_checked_against_the_dp_replicas_not_the_ranks(monkeypatch):
    """mpirun -n 4 ... --cp 2: 2 data-parallel replicas, so 2 default groups (6 rows split) and --moe-groups 2
    is a multiple of them; the checks once counted 4 replicas and refused both."""
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert gpt.parse_args([str(a) for a in MOE + ["--cp", 2, "--batch-size", 6]]).cp == 2
    assert gpt.parse_args([str(a) for a in MOE + ["--cp", 2, "--moe-groups", 2]]).moe_groups == 2
    refused(gpt, MOE + ["--cp", 2, "--moe-groups", 3], "--moe-groups 3 is not a multiple of the 2 data-parallel replicas")
    refused(gpt, MOE + ["--cp", 2, "--ep", 4], "--ep 4 does not divide the 2 data-parallel ranks")
