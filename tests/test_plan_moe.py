"""The planner's new axes (plan/experts.py) against the GPT job's own ledger, every rank: experts on 2
data-parallel ranks (dropless, capacity, every other block), with --ep 2, under tp (with sequence
parallelism too) and pp (GPT3D), dense
with --cp (ring, Ulysses, x tp) and --zero 1/2/3 (x tp, x pp): memory per rank within 5% (peak total;
params, grads, optimizer state). Then the formulas: ep shards the experts' bytes exactly by E/ep, cp
divides the activations, the all-to-alls carry tokens·k rows, (ep-1)/ep of them away; --search keeps to
the constraints and names a sane layout for Mixtral-8x7B and a DeepSeek-V3-like model on 1024 GPUs."""
import contextlib
import io
import json
import sys
from dataclasses import replace

import numpy as np
import pytest

from minitrain import plan
from minitrain.plan import context, experts
from minitrain.plan.__main__ import main, search
from minitrain.plan.activations import gpt_block_bytes
from minitrain.plan.alpha_beta import collective
from minitrain.plan.layer_costs import axes_comm
from minitrain.testing import run_mpi

JOB = ["--no-progress", "--precision", "fp64", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size",
       "32", "--batch-size", "8", "--sample-chars", "4", "--steps", "3", "--moe-experts", "4", "--moe-top-k", "2"]
RUNS = {"dropless": [], "capacity": ["--moe-capacity-factor", "1.25"], "every2": ["--n-layer", "4", "--moe-every", "2"],
        "tp2 sp": ["--tp", "2", "--sequence-parallel"]}      # each tp rank routes its own s/t tokens
STATES = ("params", "grads", "optimizer_state")


def cli(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The job's --json of each run on 2 ranks (one mpiexec launch)."""
    d = tmp_path_factory.mktemp("plan_moe")
    calls = "; ".join(f"assert gpt.main({JOB + extra + ['--json', str(d / name) + '.json']!r}) == 0"
                      for name, extra in RUNS.items())
    run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; {calls}"], n=2, timeout=300)
    return {name: json.loads((d / f"{name}.json").read_text()) for name in RUNS}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_memory_per_rank_is_the_job_s_ledger_within_5_percent(measured, name):
    predicted = json.loads(cli(["gpt", *JOB, *RUNS[name], "--world", "2", "--json"]))
    assert predicted["num_params"] == measured[name]["num_params"]
    for rank in measured[name]["ranks"]:
        peak = rank["memory"]["peak"]
        assert predicted["memory_bytes"]["total"] == pytest.approx(peak["total"], rel=0.05), rank
        for c in STATES + ("activations",):
            assert predicted["category_peaks"][c] == pytest.approx(peak[c], rel=0.05), (c, rank)
        if name != "capacity":    # dropless, what a layer keeps does not depend on the routing: the ledger's count
            assert predicted["category_peaks"]["activations"] == pytest.approx(peak["activations"], rel=0.01)


def test_the_job_s_json_gives_every_rank_s_ledger(measured):
    ranks = measured["dropless"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(set(r["memory"]["persistent"]) == set(STATES) and r["memory"]["peak"]["total"] > 0 for r in ranks)


def test_the_job_prints_the_planner_beside_what_it_measured(measured, capsys):
    """--show-plan with experts (one process) and the JSON's "planner" block (2 ranks): the same prediction."""
    from minitrain.examples import gpt
    assert gpt.main(JOB + ["--steps", "2", "--show-plan"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("planner"))
    assert "predicted" in line and "refuses" not in line
    compared = measured["dropless"]["planner"]
    assert compared["world"] == 2 and compared["predicted"]["memory_bytes"] == pytest.approx(
        compared["measured"]["memory_bytes"], rel=0.05)


def test_memory_with_expert_parallelism_is_the_job_s_ledger_within_5_percent(tmp_path):
    """ep 2 on 2 ranks. The planner plans balanced routing: with 2 experts top-2 every token goes to both, so
    the ledger's count comes out (within 1%); with 4 a real routing moves some rows between the ranks."""
    runs = {"two": ["--moe-experts", "2"], "four": []}
    calls = "; ".join(f"assert gpt.main({JOB + extra + ['--ep', '2', '--json', str(tmp_path / name)]!r}) == 0"
                      for name, extra in runs.items())
    run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; {calls}"], n=2, timeout=300)
    for name, extra in runs.items():
        predicted = json.loads(cli(["gpt", *JOB, *extra, "--ep", "2", "--world", "2", "--json"]))
        for rank in json.loads((tmp_path / name).read_text())["ranks"]:
            peak = rank["memory"]["peak"]
            assert predicted["memory_bytes"]["total"] == pytest.approx(peak["total"], rel=0.05), (name, rank)
            for c in STATES + ("comm_buffers",):     # the dense gradients' buckets alone: experts reduce apart
                assert predicted["category_peaks"][c] == pytest.approx(peak[c], rel=0.05), (name, c)
            if name == "two":
                assert predicted["memory_bytes"]["total"] == pytest.approx(peak["total"], rel=0.01)


def test_the_job_plans_its_own_routing_s_load(tmp_path):
    """The default GPT with 4 experts over ep 2 routes unevenly (the busiest rank takes 1.5-1.7x an even share
    in its first steps): the job asks the planner at its measured load, which then counts its heaviest rank's
    ledger (within 0.1%), where even routing is 18% below; a capacity's drops make it below 1, as counted.
    With full recomputation one block's activations are held at a time: the job plans at its busiest layer's
    load, as if every layer were that busy (the planner cannot know which will be): at or above the heaviest
    rank, within 5%. A capacity under cp: the same, on the rank whose tokens kept the most rows; and the cp bytes
    its "cp" block reports are attention's (== the formula), the experts' routing counted beside them."""
    out, full, capped = tmp_path / "moe.json", tmp_path / "full.json", tmp_path / "capped.json"
    capped_cp = tmp_path / "capped_cp.json"
    job = ["--steps", "6", "--sample-chars", "1", "--no-progress", "--dp", "2", "--moe-experts", "4", "--ep", "2"]
    calls = "; ".join(f"assert gpt.main({job + extra + ['--json', str(path)]!r}) == 0"
                      for path, extra in ((out, []), (full, ["--recompute", "full"]),
                                          (capped, ["--ep", "1", "--moe-capacity-factor", "1.0"]),
                                          (capped_cp, ["--ep", "1", "--dp", "1", "--cp", "2",
                                                       "--moe-capacity-factor", "1.0"])))
    run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; {calls}"], n=2, timeout=300)
    report = json.loads(out.read_text())
    compared, heaviest = report["planner"], max(r["memory"]["peak"]["total"] for r in report["ranks"])
    assert 1.3 < compared["moe_load"] <= 2
    assert compared["predicted"]["memory_bytes"] == pytest.approx(heaviest, rel=1e-3)
    assert compared["predicted"]["memory_bytes_even_routing"] < 0.9 * heaviest
    recomputed = json.loads(full.read_text())
    heaviest_full = max(r["memory"]["peak"]["total"] for r in recomputed["ranks"])
    assert recomputed["planner"]["moe_load"] > compared["moe_load"]          # one layer busier than the two
    assert heaviest_full <= recomputed["planner"]["predicted"]["memory_bytes"] <= 1.05 * heaviest_full
    # a capacity on one rank's experts: they take the rows kept, fewer than routed (a load below 1)
    dropping = json.loads(capped.read_text())
    heaviest_capped = max(r["memory"]["peak"]["total"] for r in dropping["ranks"])
    assert dropping["planner"]["moe_load"] < 1
    assert dropping["planner"]["predicted"]["memory_bytes"] == pytest.approx(heaviest_capped, rel=1e-3)
    # and over cp ranks, which plan the group's drops together: each rank's experts take its tokens' kept rows
    dropping_cp = json.loads(capped_cp.read_text())
    assert dropping_cp["planner"]["moe_load"] < 1 and dropping_cp["moe"]["tokens_dropped"] > 0
    assert dropping_cp["planner"]["predicted"]["memory_bytes"] == pytest.approx(
        max(r["memory"]["peak"]["total"] for r in dropping_cp["ranks"]), rel=1e-3)
    # its "cp" block: attention's bytes are their formula's; the experts' routing is counted beside them, per
    # layer (2) an all-gather of the rank's choices (16 rows x 16 positions x k 2, int64) and an all-reduce of
    # the group's 4 counts (fp32)
    cp = dropping_cp["cp"]
    assert cp["bytes_per_step"] == cp["bytes_formula"] > 0
    assert cp["experts_bytes_per_step"] == 2 * (16 * 16 * 2 * 8 + 4 * 4)
    # the step is the median step: priced at the median step's load, which the planner's CLI prices alike
    assert 1 <= compared["moe_load_step"] < compared["moe_load"]
    at_step = json.loads(cli(["gpt", "--steps", "6", "--dp", "2", "--moe-experts", "4", "--ep", "2", "--world", "2",
                              "--threads", str(compared["threads"]), "--moe-load", repr(compared["moe_load_step"]),
                              "--json"]))
    assert compared["predicted"]["step_busy_s"] == at_step["step_busy_s"]


def test_each_pipeline_stage_is_planned_at_its_own_ranks_load():
    """gpt_common.stage_routing_loads: a stage's peak load is routing_load's over its own ranks (the first step
    left out), 1 for a stage without MoE layers: what one stage's layers routed is not another's memory."""
    from minitrain.comm import ThreadWorld
    from minitrain.examples.gpt_common import routing_load, stage_routing_loads
    routing = {0: [[(40, 10)], [(12, 10)], [(14, 10)]], 1: [[(10, 10)], [(8, 10)], [(10, 10)]],     # stage 0
               2: [[(10, 10)], [(20, 10)], [(16, 10)]], 3: [[(10, 10)], [(0, 10)], [(4, 10)]]}      # stage 1
    loads = ThreadWorld(4).run(lambda comm: stage_routing_loads(comm, routing[comm.rank], 2, comm.rank // 2, 2))
    assert loads == [[1.4, 2.0]] * 4                           # 4.0 in stage 0's first step is left out
    assert ThreadWorld(4).run(lambda comm: routing_load(comm, routing[comm.rank], 2))[0][0] == 2.0
    dense_last = {0: [[(10, 10)], [(15, 10)]], 1: [[(10, 10)], [(5, 10)]], 2: [[], []], 3: [[], []]}
    loads = ThreadWorld(4).run(lambda comm: stage_routing_loads(comm, dense_last[comm.rank], 2, comm.rank // 2, 2))
    assert loads == [[1.5, 1.0]] * 4


def test_an_expert_parallel_pipeline_plans_each_stage_at_its_own_load(tmp_path):
    """--dp 2 --pp 2 --ep 2: an untrained router sent one of the last stage's ranks every row (a load of 2.0),
    while the first stage's busiest rank took 1.2-1.5x its share. Each stage planned at its own ranks' load,
    the planner's memory is the heaviest rank's ledger (within 0.1%); at the last stage's 2.0 the first stage
    would be planned 33% above it."""
    out = tmp_path / "eppp.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.gpt", "--steps", "6", "--sample-chars", "1", "--no-progress",
             "--dp", "2", "--pp", "2", "--microbatches", "2", "--moe-experts", "4", "--ep", "2", "--json", out], n=4,
            timeout=300)
    report = json.loads(out.read_text())
    compared, heaviest = report["planner"], max(r["memory"]["peak"]["total"] for r in report["ranks"])
    first, last = compared["moe_load_per_stage"]
    assert first < last == compared["moe_load"]
    assert compared["predicted"]["memory_bytes"] == pytest.approx(heaviest, rel=1e-3)


def test_one_process_plans_the_rows_its_capacity_kept(tmp_path):
    """One process with a capacity: its experts take fewer rows than routed (a load below 1), which the job
    hands the planner as the multi-rank jobs do: the prediction is its ledger's (within 0.1%)."""
    from minitrain.examples import gpt
    out = tmp_path / "one.json"
    assert gpt.main(JOB + ["--moe-capacity-factor", "1.0", "--json", str(out)]) == 0
    compared = json.loads(out.read_text())["planner"]
    assert compared["moe_load"] < 1
    assert compared["predicted"]["memory_bytes"] == pytest.approx(compared["measured"]["memory_bytes"], rel=1e-3)


def test_the_busiest_rank_s_load_of_the_peak_step_and_of_the_median_step():
    """gpt_common.routing_load: per step the busiest rank's rows its experts took over its own routed rows,
    at most ep; for memory the most loaded step after the first (whose end makes the optimizer's state), for
    the step's time the median step. A step's rows are its layers' together, or for the peak with per_layer
    (full recomputation) its busiest layer's. A capacity that drops rows makes it below 1."""
    from minitrain.comm import ThreadWorld
    from minitrain.examples.gpt_common import routing_load
    routing = {0: [[(40, 10)], [(12, 10)], [(10, 10)], [(30, 10)], [(11, 10)]],
               1: [[(0, 10)], [(8, 10)], [(10, 10)], [(0, 10)], [(9, 10)]]}
    loads = ThreadWorld(2).run(lambda comm: routing_load(comm, routing[comm.rank], 2))
    for peak, step in loads:                  # per step 4 (at most 2), 1.2, 1.0, 3 (at most 2), 1.1
        assert peak == 2 and step == pytest.approx(1.2)
    first_only = {0: [[(40, 10)], [(12, 10)]], 1: [[(0, 10)], [(8, 10)]]}
    assert ThreadWorld(2).run(lambda comm: routing_load(comm, first_only[comm.rank], 2))[0][0] == 1.2
    assert routing_load(None, [], 1) == (1.0, 1.0)
    dense = ThreadWorld(2).run(lambda comm: routing_load(comm, [[], [], []], 1))      # no MoE layer anywhere
    assert dense == [(1.0, 1.0)] * 2
    dropped = [[(9, 10)], [(7, 10)], [(8, 10)]]                              # one rank, a capacity
    assert routing_load(None, dropped, 1) == (0.8, 0.8)
    two_layers = {0: [[(1, 1)], [(8, 5), (2, 5)], [(6, 5), (6, 5)]], 1: [[(1, 1)], [(2, 5), (8, 5)], [(4, 5), (4, 5)]]}
    together = ThreadWorld(2).run(lambda comm: routing_load(comm, two_layers[comm.rank], 2))
    busiest_layer = ThreadWorld(2).run(lambda comm: routing_load(comm, two_layers[comm.rank], 2, per_layer=True))
    assert together == [(1.2, pytest.approx(1.0))] * 2            # per step 1.0 and 1.2 (rank 0's third)
    assert busiest_layer == [(1.6, pytest.approx(1.0))] * 2       # 8/5 in a layer; the time's load unchanged


def test_memory_with_context_parallelism_is_the_job_s_ledger_within_1_percent(tmp_path):
    """A dense GPT over cp ranks (GPT3D): ring (zig-zag) and Ulysses, with tp and under a pipeline; Ulysses
    keeps what one process keeps on a/cp heads, the ring its log-sum-exp and output in place of the scores
    (its blocks in transit are not the ledger's); and experts under cp, each rank routing its s/cp tokens.
    Every rank's stage."""
    dense = JOB[:JOB.index("--moe-experts")] + ["--n-embd", "64", "--n-head", "4", "--block-size", "64"]
    experts = JOB[JOB.index("--moe-experts"):]
    # few tokens a rank: an expert's backward makes more gradient bytes than it frees, so the step's worst moment
    # is the lowest MoE layer's last expert's c_proj; top-k = E routes every token to every expert, an even load
    few = ["--n-embd", "32", "--block-size", "16", "--batch-size", "2", "--moe-experts", "8", "--moe-top-k", "8"]
    runs = {"ring": (["--cp", "2"], 2), "ulysses": (["--cp", "2", "--cp-method", "ulysses"], 2),
            "ring_tp": (["--cp", "2", "--tp", "2"], 4), "ring_pp": (["--cp", "2", "--pp", "2", "--microbatches", "2"], 4),
            "ring_experts": (["--cp", "2"] + experts, 2), "ring_experts_few_tokens": (["--cp", "2"] + few, 2)}
    for name, (extra, n) in runs.items():
        argv = dense + extra + ["--json", str(tmp_path / name)]
        run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; assert gpt.main({argv!r}) == 0"], n=n,
                timeout=300)
        predicted = json.loads(cli(["gpt", *dense, *extra, "--world", str(n), "--json"]))
        stages, ranks = predicted["memory_bytes_per_stage"], json.loads((tmp_path / name).read_text())["ranks"]
        for rank in ranks:                     # the mesh (pp, dp, cp, tp): a stage's ranks are consecutive
            stage = stages[rank["rank"] // (len(ranks) // len(stages))]
            assert stage["total"] == pytest.approx(rank["memory"]["peak"]["total"], rel=0.01), (name, rank)
            if name == "ring_experts_few_tokens":     # the moment inside the experts, to 32 values
                assert stage["total"] == pytest.approx(rank["memory"]["peak"]["total"], abs=256), rank


def test_memory_with_zero_on_the_gpt_s_dp_axis_is_the_job_s_ledger_within_a_tenth_of_a_percent(tmp_path):
    """GPT3D's ZeRO (parallel/zero_3d.py): a flat gradient of the stage through the step, stages 2 and 3 a
    gradient shard, stage 3 a parameter shard and the stage gathered once a step, each over the dp x cp
    replicas (one replica's too); every rank's stage."""
    dense = JOB[:JOB.index("--moe-experts")] + ["--n-embd", "64", "--n-head", "4", "--block-size", "64"]
    runs = {"z1": (["--zero", "1", "--dp", "2"], 2), "z2": (["--zero", "2", "--dp", "2"], 2),
            "z3_tp": (["--zero", "3", "--dp", "2", "--tp", "2"], 4),
            "z2_pp": (["--zero", "2", "--dp", "2", "--pp", "2", "--microbatches", "2"], 4),
            # over dp x cp (each cp rank holds the same parameters), and over one replica too (a ZeRO of one)
            "z1_cp": (["--zero", "1", "--cp", "2"], 2), "z3_pp_one_replica": (["--zero", "3", "--pp", "2"], 2),
            # activations on the host: the step's peak is the gradients' reduce-scatter (full buffer and shard)
            "z3_offload_activations": (["--zero", "3", "--dp", "2", "--offload-activations"], 2)}
    for name, (extra, n) in runs.items():
        argv = dense + extra + ["--json", str(tmp_path / name)]
        run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; assert gpt.main({argv!r}) == 0"], n=n,
                timeout=300)
        predicted = json.loads(cli(["gpt", *dense, *extra, "--world", str(n), "--json"]))
        stages, ranks = predicted["memory_bytes_per_stage"], json.loads((tmp_path / name).read_text())["ranks"]
        for rank in ranks:                     # the mesh (pp, dp, tp): a stage's ranks are consecutive
            stage = stages[rank["rank"] // (len(ranks) // len(stages))]
            assert stage["total"] == pytest.approx(rank["memory"]["peak"]["total"], rel=1e-3), (name, rank)
            for c in STATES:
                assert stage["category_peaks"][c] == pytest.approx(rank["memory"]["peak"][c], rel=0.05), (name, c)


@pytest.mark.parametrize("ranks, zero", [(2, 1), (4, 1), (2, 2), (4, 2), (2, 3)])
def test_zero_with_experts_under_ep_is_planned_as_the_job_runs_it(monkeypatch, ranks, zero):
    """--zero with --ep: the job trains GPT3D (not nn.GPT under DDP, which has no ZeRO), the dense states over
    dp, the experts' over the dp/ep ranks that hold the same experts; ZeRO-1's reduce-scatter lands in a shard
    of each, ZeRO-2/3 drop the dense full gradient before the experts' shard is made (ExpertZero). 2 experts
    top-2: every token goes to both, so the routing is even. Every category of every rank to the byte (ZeRO-3's
    0-d placeholders aside)."""
    from minitrain.plan import validate
    options = f"--steps 3 --sample-chars 1 --dp {ranks} --moe-experts 2 --ep 2 --zero {zero}"
    monkeypatch.setitem(validate.RUNS, "probe", ("gpt", ranks, options))
    for r in validate.run("probe", "cpu-2core", timeout=120)["ranks"]:
        predicted = {**r["predicted"]["category_peaks"], "total": r["predicted"]["total"]}
        for c in (*STATES, "comm_buffers", "activations", "total"):
            assert abs(predicted[c] - r["measured"][c]) <= 64, (c, predicted, r["measured"])


def test_the_experts_zero_under_cp_holds_the_model_states_the_planner_counts(tmp_path):
    """cp2 x dp2 --ep 2 with ZeRO-1 and 3: the dense states sharded over the 4 dp x cp replicas, the experts'
    over the 2 ranks holding the same ones (an ep group per cp coordinate): the planner's peaks of the model
    states are every rank's ledger's, byte for byte (the activations follow the routing)."""
    layout = ["--dp", "2", "--cp", "2", "--ep", "2"]
    calls = "; ".join(f"assert gpt.main({JOB + layout + ['--zero', z, '--json', str(tmp_path / z)]!r}) == 0"
                      for z in ("1", "3"))
    run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; {calls}"], n=4, timeout=300)
    for z in ("1", "3"):
        predicted = json.loads(cli(["gpt", *JOB, *layout, "--zero", z, "--world", "4", "--json"]))["category_peaks"]
        for rank in json.loads((tmp_path / z).read_text())["ranks"]:
            peak = rank["memory"]["peak"]
            assert {c: predicted[c] for c in STATES + ("comm_buffers",)} == {c: peak[c] for c in
                                                                              STATES + ("comm_buffers",)}, (z, rank)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_step_s_zero_collectives_span_the_dp_x_cp_replicas(monkeypatch, zero):
    """GPT3D reduce-scatters the gradients and all-gathers the parameters over dp x cp (each cp rank holds the
    same parameters): the planner prices the two collectives over those 4 ranks, not dp's 2."""
    from minitrain.plan import time as ptime
    calls = []

    def spy(machine, name, nbytes, p, *args, **kwargs):
        calls.append((name, p))
        return collective(machine, name, nbytes, p, *args, **kwargs)
    monkeypatch.setattr(ptime, "collective", spy)
    model = plan.GPT(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
    layout = plan.Layout(world=4, dp=2, cp=2, batch_size=4, zero=zero, precision="fp64",
                         extras={"parallel_job": True})
    plan.predict(model, layout, plan.load_machine("cpu-2core"))
    assert ("ring_reduce_scatter", 4) in calls and ("ring_all_gather", 4) in calls
    assert not {("ring_reduce_scatter", 2), ("ring_all_gather", 2)} & set(calls)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_recomputation_under_cp_sends_the_forward_s_blocks_again_in_backward(method):
    """The recomputed core (selective) or block (full) runs its ring or all-to-alls again in backward: the
    planner adds the forward's communication to the backward's (the job's bytes: test_context_parallel)."""
    model = plan.GPT(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
    machine = plan.load_machine("cpu-2core")
    (fwd, bwd), _ = axes_comm(model, plan.Layout(world=2, cp=2, cp_method=method, batch_size=4), 4, machine, False)
    for recompute in ("selective", "full"):
        layout = plan.Layout(world=2, cp=2, cp_method=method, batch_size=4, recompute=recompute)
        (fwd_again, bwd_again), _ = axes_comm(model, layout, 4, machine, False)
        assert fwd_again == fwd > 0 and bwd_again == pytest.approx(bwd + fwd, rel=1e-12)


def test_memory_with_experts_under_tp_and_pp_is_the_job_s_ledger_within_5_percent(tmp_path):
    """GPT3D with MoE layers replicated on the tp ranks: tp 2, pp 2 (1F1B, 2 micro-batches), dp 2 x tp 2."""
    runs = {"tp": (["--tp", "2"], 2), "pp": (["--pp", "2", "--microbatches", "2"], 2),
            "dp_tp": (["--dp", "2", "--tp", "2"], 4)}
    for name, (extra, n) in runs.items():
        argv = JOB + extra + ["--json", str(tmp_path / name)]
        run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; assert gpt.main({argv!r}) == 0"], n=n,
                timeout=300)
        predicted = json.loads(cli(["gpt", *JOB, *extra, "--world", str(n), "--json"]))
        stages, ranks = predicted["memory_bytes_per_stage"], json.loads((tmp_path / name).read_text())["ranks"]
        for rank in ranks:
            stage = stages[rank["rank"] // (len(ranks) // len(stages))]
            assert stage["total"] == pytest.approx(rank["memory"]["peak"]["total"], rel=0.05), (name, rank)
            assert stage["category_peaks"]["params"] == rank["memory"]["peak"]["params"]   # experts whole on tp


# ---------------------------------------------------------------- the formulas
MOE = plan.GPT(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64, moe_experts=8, moe_top_k=2,
               moe_every=2)


@pytest.mark.parametrize("zero", [0, 1])
def test_more_ep_shards_the_experts_bytes_exactly_by_the_formula(zero):
    """params (and with ZeRO-1 the optimizer state, sharded over the dp/ep ranks that hold the same experts)
    fall by exactly the experts ep takes away: MoE layers x (E/ep) x (2hf + f + h)."""
    got = {}
    for ep in (1, 2, 4, 8):
        layout = plan.Layout(world=8, dp=8, ep=ep, zero=zero, batch_size=8, precision="fp32",
                             extras={"parallel_job": True})
        got[ep] = plan.predict(plan.check(MOE, layout) and MOE, layout, "cpu-2core")["category_peaks"]
        assert experts.expert_params_per_rank(MOE, layout) == 2 * (8 // ep) * (2 * 64 * 256 + 256 + 64)
    one = 2 * (2 * 64 * 256 + 256 + 64)                               # one expert in each of the 2 MoE layers
    for ep in (2, 4, 8):
        assert got[1]["params"] - got[ep]["params"] == 4 * one * (8 - 8 // ep)
    if zero:      # ZeRO-1: Adam's two fp32 moments of the dense parameters over dp, of the experts over dp/ep
        for ep in (1, 2, 4, 8):
            n_exp = one * 8 // ep
            local = got[ep]["params"] // 4
            assert got[ep]["optimizer_state"] == 8 * (-(-local // 8) - -(-n_exp // 8) + -(-n_exp // (8 // ep)))
        assert got[8]["optimizer_state"] - got[1]["optimizer_state"] < 8 * one     # each rank: 1/8 of all experts


def test_all_to_all_bytes_are_tokens_times_top_k_and_the_share_that_leaves():
    """Each of the four all-to-alls of a layer moves the routed rows' (ep-1)/ep; the forward's split sizes
    before them (expert_parallel_moe.split_sizes) are a fifth; full recomputation's backward sends the forward's
    again (`gpt --dp 2 --ep 2 --recompute full` measures 1.5x the bytes of --recompute none), selective's does not."""
    for k in (1, 2, 4):
        model = replace(MOE, moe_top_k=k)
        for ep in (2, 4):
            layout = plan.Layout(world=4, dp=4, ep=ep, batch_size=8, precision="bf16")
            tokens = 2 * 64                                            # 2 rows of 64 tokens per rank
            assert experts.all_to_all_bytes(model, layout, 2) == tokens * k * 64 * 2 * (ep - 1) / ep
            machine = plan.load_machine("a100-80gb")
            (_, _), (f, b) = axes_comm(model, layout, 2, machine, False)
            assert b == 2 * collective(machine, "all_to_all", tokens * k * 64 * 2, ep, ep)
            # the forward first exchanges its split sizes: the (ep, E/ep) int64 count table, an all-to-all
            assert f == b + collective(machine, "all_to_all", 8 * model.moe_experts, ep, ep)
            # full recomputation runs the block's forward again in backward, its five all-to-alls with it
            (_, _), (f_full, b_full) = axes_comm(model, replace(layout, recompute="full"), 2, machine, False)
            assert f_full == f and b_full == pytest.approx(b + f, rel=1e-12)
            assert axes_comm(model, replace(layout, recompute="selective"), 2, machine, False)[1] == (f, b)


def test_context_parallelism_divides_the_activations_by_cp():
    """Every per-token array is s/cp long; ring attention keeps no score matrix (its log-sum-exp and output
    instead), Ulysses a/cp heads' scores over the whole sequence."""
    dense = plan.GPT(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64)
    for model in (dense, MOE):
        for moe in ((False, True) if model.moe_experts else (False,)):
            base = plan.Layout(world=1, batch_size=2, precision="fp32")
            one = gpt_block_bytes(model, base, 2, moe)[0] - 4 * context.attention_core_values(model, base, 2)
            for cp in (2, 4):
                for method in ("ring", "ulysses"):
                    layout = replace(base, world=cp, cp=cp, cp_method=method)
                    kept = gpt_block_bytes(model, layout, 2, moe)[0]
                    core = 4 * context.attention_core_values(model, layout, 2)
                    constant = 4 * (2 * 4 * 2 + 1) if moe else 0          # the balancing loss: per group, not token
                    assert kept - core - constant == pytest.approx((one - constant) / cp, rel=1e-12)
                    scores = 2 * 4 * 64 * 64
                    assert core == 4 * (2 * 4 * 32 // cp * 2 + 2 * 64 // cp * 64 if method == "ring" else scores / cp)


def test_moe_flops_take_k_experts_per_token_instead_of_one_mlp():
    B, s, h, E, L = 8, 64, 64, 8, 4
    layout = plan.Layout(batch_size=B)
    dense = plan.GPT(vocab_size=64, block_size=s, n_layer=L, n_head=4, n_embd=h)
    for k in (1, 2):
        moe = replace(MOE, moe_top_k=k, moe_every=1)
        mlp = 3 * 2 * B * s * 2 * h * 4 * h                           # one MLP's forward + backward
        router = 3 * 2 * B * s * h * E
        assert plan.flops_per_iteration(moe, layout) - plan.flops_per_iteration(dense, layout) == L * (
            (k - 1) * mlp + router)


def refused(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2 and "Traceback" not in err.getvalue()
    return err.getvalue()


def test_each_constraint_of_the_new_axes_is_refused_in_one_line_with_the_nearest_valid():
    sizes = "gpt --n-head 4 --n-embd 64 --block-size 24"
    assert "nearest valid --ep: 1 or 2" in refused(f"{sizes} --moe-experts 4 --world 6 --ep 3")      # ep | E
    assert "--ep 4 does not divide --dp 2" in refused(f"{sizes} --moe-experts 4 --world 2 --ep 4")   # ep | dp
    assert "--ep is not supported with --moe-experts 0" in refused(f"{sizes} --world 2 --ep 2")   # the job's rule
    assert "2 x --cp 8" in refused(f"{sizes} --world 8 --cp 8")                                     # 2cp | s
    assert refused(f"{sizes} --world 8 --cp 8").endswith("nearest valid --cp: 2 or 4\n")          # | world too
    assert refused(f"{sizes} --world 10 --cp 10").endswith("nearest valid --cp: 1 or 2\n")    # not 4: 4 ∤ 10
    assert refused("gpt --block-size 15 --world 2 --cp 2").endswith("nearest valid --cp: 1\n")     # odd: no ring
    assert "nearest valid --cp: 2 or 4" in refused(f"{sizes} --world 8 --cp 8 --cp-method ulysses")  # cp | heads
    assert "dp x pp x tp x cp" in refused(f"{sizes} --world 8 --cp 2 --dp 2")
    assert refused("gpt --world 8 --cp 2 --tp 4 --sequence-parallel --block-size 20").endswith(   # as the job: s/cp
        "--block-size 20 / --cp 2 is not divisible by --tp 4 (sequence parallelism); nearest valid --block-size: 16 or 24\n")
    assert refused(f"{sizes} --world 8 --cp 8").count("\n") == 1
    assert "between 1 and --ep 2" in refused(f"{sizes} --moe-experts 4 --world 2 --ep 2 --moe-load 2.5")
    assert "between 1 and --ep 2 (below 1 only where a capacity factor drops rows)" in refused(
        f"{sizes} --moe-experts 4 --world 2 --ep 2 --moe-load 0.5")
    assert "between 0 and 1" in refused(f"{sizes} --moe-experts 4 --world 2 --moe-capacity-factor 1 --moe-load 1.5")
    assert "a load of 1; leave --moe-load out" in refused(f"{sizes} --moe-experts 4 --world 2 --moe-load 1.5")
    for fine in ("--ep 2 --moe-load 0.5", "--moe-load 0.8"):                # drops: fewer rows than routed
        assert json.loads(cli(f"{sizes} --moe-experts 4 --world 2 --moe-capacity-factor 1 {fine} --json".split()))


def test_gshard_groups_the_job_refuses_are_not_planned_and_the_default_is_one_per_micro_batch():
    """--moe-groups G: the job refuses G not a multiple of dp x micro-batches or not dividing the global batch;
    the planner once planned them (capacity counted over max(1, G // (dp·m)) groups: a number for a run that
    cannot start). The default is the job's, one group per micro-batch of each replica, on every layout
    --search tries."""
    sizes = "gpt --n-head 4 --n-embd 64 --block-size 24 --moe-experts 4 --moe-capacity-factor 1"
    assert "--moe-groups 1 is not a multiple of the 2 data-parallel replicas" in refused(
        f"{sizes} --world 2 --moe-groups 1")
    assert "of the 2 data-parallel replicas x 2 micro-batches" in refused(f"{sizes} --world 2 --microbatches 2 "
                                                                          "--moe-groups 2")
    assert "--batch-size 16 does not split into --moe-groups 32 groups" in refused(f"{sizes} --world 1 --moe-groups 32")
    assert refused(f"{sizes} --world 2 --moe-groups 3").count("\n") == 1
    assert refused(f"{sizes} --world 3 --batch-size 8").endswith(            # the default dp x m = 3, as the job
        "--batch-size 8 does not split into --moe-groups 3 groups of whole rows (its default: one per data-parallel "
        "replica and micro-batch) (the job refuses it too)\n")
    planned = lambda options: json.loads(cli(f"{sizes} {options} --json".split()))     # noqa: E731
    assert planned("--world 2") == planned("--world 2 --moe-groups 2")               # the default: dp x m
    assert planned("--world 2")["memory_bytes"] != planned("--world 2 --moe-groups 4")["memory_bytes"]
    model = plan.GPT(vocab_size=64, block_size=24, n_layer=2, n_head=4, n_embd=64, moe_experts=4, moe_capacity_factor=1)
    for layout in (plan.Layout(world=4, dp=4, batch_size=16), plan.Layout(world=4, dp=2, pp=2, microbatches=4,
                                                                           batch_size=16)):
        assert experts.local_groups(model, layout) == 1
        assert experts.local_groups(replace(model, moe_groups=16), layout) == 16 // (layout.dp * layout.microbatches)


def test_a_routing_s_load_adds_the_rows_the_busiest_rank_takes_beyond_an_even_share():
    """--moe-load L: the busiest ep rank's experts take L x the routed rows M, so every value kept per routed
    row (the experts' input h, regrouped expert by expert where a rank holds 2, and their hidden 3f') grows by
    (L - 1)·M."""
    base = ["gpt", *JOB, "--ep", "2", "--world", "2", "--json"]
    even, double = (json.loads(cli(base + extra)) for extra in ([], ["--moe-load", "2"]))
    M, h, f = 4 * 32 * 2, 32, 4 * 32                      # 4 sequences of 32 tokens a rank, top-2
    assert double["category_peaks"]["activations"] - even["category_peaks"]["activations"] == 2 * 8 * M * (h + 3 * f)
    assert double["layout"]["moe_load"] == 2
    machine, layout = plan.load_machine(), plan.Layout(world=2, dp=2, ep=2, batch_size=16)
    runs = [plan.predict(MOE, replace(layout, moe_load=load), machine) for load in (1.0, 2.0, 1.0)]
    busy = [run["step_busy_s"] for run in runs]
    assert busy[0] < busy[1] and busy[2] == busy[0]       # the busiest rank's experts work through more rows
    comm = [run["step_time_s"]["comm"] for run in runs]
    assert comm[0] < comm[1] and comm[2] == comm[0]       # and its all-to-alls bring and send back more


@pytest.mark.parametrize("options", [
    "--cp 2 --cp-method ulysses --ep 2 --zero 1 --moe-experts 4 --moe-capacity-factor 1.25 --dp 2 --world 4",
    "--cp 2 --cp-method ring --pp 2 --schedule interleaved_1f1b --chunks 2 --n-layer 4 --microbatches 4 --world 4",
    "--pp 2 --schedule gpipe --microbatches 4 --ep 2 --dp 2 --moe-experts 2 --moe-every 2 --world 4",
    "--zero 3 --ep 4 --moe-experts 8 --moe-top-k 1 --moe-aux-loss-coef 0.1 --moe-groups 4 --world 4"])
def test_the_options_the_job_gains_this_round_are_planned(options):
    """--cp, --cp-method, --ep, --zero, --moe-*, --schedule zb_h1|zbv: the names the GPT job takes."""
    result = json.loads(cli(["gpt", *options.split(), "--json"]))
    lay = result["layout"]
    assert result["fits"] and lay["dp"] * lay["pp"] * lay["tp"] * lay["cp"] == 4
    for name in ("cp", "ep", "zero", "schedule", "cp_method"):
        flag = f"--{name.replace('_', '-')} "
        if flag in options + " ":
            assert str(lay[name]) == options.split(flag)[1].split()[0], name

    for schedule in ("zb_h1", "zbv"):        # the job's zero-bubble schedules, planned
        result = json.loads(cli(f"gpt --pp 2 --world 2 --microbatches 4 --n-layer 4 --schedule {schedule} --json".split()))
        assert result["layout"]["schedule"] == schedule and result["layout"]["chunks"] == (2 if schedule == "zbv" else 1)


# ---------------------------------------------------------------- the search
def test_search_keeps_to_the_constraints_of_every_axis():
    """Every layout layouts() enumerates (and so --search ranks, which tries cp down to 1024 tokens per rank
    and the cp asked for) splits the world exactly, tp | heads, cp | s (2cp: ring's zig-zag), ep | dp and E."""
    model = replace(MOE, n_head=4, block_size=32)
    ranked = search(model, plan.Layout(world=16, batch_size=16, precision="fp32", cp=4),
                    plan.load_machine("a100-80gb"), "minitrain", None)
    assert {r["layout"]["cp"] for r in ranked} == {1, 4}
    seen = set()
    for lay in [r["layout"] for r in ranked] + [x.as_dict() for x in plan.layouts(model, 16, 16, zeros=(0,))]:
        assert lay["dp"] * lay["pp"] * lay["tp"] * lay["cp"] == 16
        assert model.n_head % lay["tp"] == 0 and lay["dp"] % lay["ep"] == 0 and model.moe_experts % lay["ep"] == 0
        assert model.block_size % (2 * lay["cp"] if lay["cp_method"] == "ring" else lay["cp"]) == 0
        assert lay["pp"] <= model.n_layer + 2
        seen.add((lay["cp"], lay["ep"]))
    assert {ep for _, ep in seen} == {1, 2, 4, 8} and {cp for cp, _ in seen} == {1, 2, 4, 8, 16}


def test_search_tries_the_zero_bubble_schedules_and_finds_the_fastest_of_every_schedule():
    """--search tries ZB-H1 and ZB-V in place of 1F1B on the pipelined layouts that could beat the fastest found
    (not every layout: minutes at 512 devices). A 1.3B-like GPT on 16 devices of 4 GiB: the fastest of every layout
    under every schedule (enumerated here) is a zero-bubble one, and the search finds it; 1F1B's is slower."""
    model = plan.GPT(vocab_size=51200, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    base, machine, capacity = plan.Layout(world=16, batch_size=16, precision="bf16"), plan.load_machine("a100-80gb"), 2 ** 32
    ranked = search(model, base, machine, "minitrain", capacity)
    best = None
    for lay in plan.layouts(model, 16, 16, precision="bf16", cps={1, 2}):
        for variant in [lay] + ([replace(lay, schedule="zb_h1"), replace(lay, schedule="zbv", chunks=2)] if lay.pp > 1
                                else []):
            try:
                r = plan.predict(model, variant, machine, device_memory=capacity, per_stage=False, time_if_unfit=False)
            except plan.LayoutError:
                continue
            if r["fits"] and (best is None or r["step_time_s"]["total"] < best["step_time_s"]["total"]):
                best = r
    assert best["layout"]["schedule"] in ("zb_h1", "zbv")
    assert ranked[0]["describe"] == best["describe"] and ranked[0]["step_time_s"] == best["step_time_s"]
    as_1f1b = [r for r in ranked if r["describe"] == best["describe"].replace(" zbv v=2", " 1f1b").replace(" zb_h1", " 1f1b")]
    assert as_1f1b and as_1f1b[0]["step_time_s"]["total"] > best["step_time_s"]["total"]


@pytest.mark.slow
@pytest.mark.parametrize("name, eps", [("mixtral-8x7b", {4, 8}), ("deepseek-v3", {16, 32, 64, 128, 256})])
def test_named_configurations_on_1024_gpus_pick_a_sane_layout(name, eps):
    """The best fitting layout of the named model (ZeRO-1, no recomputation, to keep the test short) shards
    the experts: Mixtral's 8 over 4 or 8 ranks, DeepSeek's 256 over many."""
    argv = ["gpt", "--model", name]
    model, base = plan.gpt_from_args(main_args(argv), 1024, 32000 if name.startswith("mixtral") else 129280)
    candidates = plan.layouts(model, 1024, base.batch_size, precision="bf16", zeros=(1,), recomputes=("none",),
                              cps={1, 2, 4})
    machine = plan.load_machine("h100-80gb")
    fit = [r for r in (plan.predict(model, lay, machine, per_stage=False, time_if_unfit=False) for lay in candidates)
           if r["fits"]]
    best = min(fit, key=lambda r: r["step_time_s"]["total"])
    assert best["layout"]["ep"] in eps and best["memory_bytes"]["total"] <= 80 * 2 ** 30, best["describe"]


def test_leaving_out_the_experts_between_the_first_and_the_last_two_changes_no_prediction(monkeypatch):
    """moe_backward_moments walks 256 experts as 3: along the experts before the last every moment moves by the
    same step, so any maximum of the walks lies at an end. Few tokens a rank (an expert makes more gradient bytes
    than it frees: the worst moment is the last expert's c_proj) and many, every ZeRO stage and recomputation,
    with and without ep and pipelines: every stage's predicted memory is the same as with every expert walked."""
    def predictions():
        plan.activations._gpt_pieces.cache_clear()
        out = []
        for model in (replace(MOE, block_size=8, n_embd=16, moe_experts=16, moe_top_k=16, moe_every=1),
                      replace(MOE, moe_experts=16)):
            for lay in plan.layouts(model, 8, 8, precision="fp32", cps={1}):
                out.append(plan.predict(model, lay, plan.load_machine("a100-80gb"))["memory_bytes_per_stage"])
        return out

    trimmed = predictions()
    every = experts.moe_backward_moments
    monkeypatch.setattr(experts, "moe_backward_moments", lambda *a: every(*a, every_expert=True))
    assert predictions() == trimmed and len(trimmed) > 100


def main_args(argv):
    from minitrain.plan.__main__ import parser
    from minitrain.plan.configs import NAMED
    return parser(defaults=NAMED[argv[-1]]).parse_args(argv)


def test_the_planner_prices_each_collective_the_expert_data_parallel_step_runs():
    """After backward, ExpertDataParallel reduces the experts' gradients as one array and their used-flags over
    the expert data-parallel group, and clips by a sum of squares over the ep group: at dp 4, ep 2 (groups of
    2 each), the calls, groups and bytes the planner prices (plan/time.py's expert_dp_collectives) are the ones
    that run (4 threads, the job's model and wrappers)."""
    from minitrain import nn
    from minitrain.comm import ThreadWorld
    from minitrain.parallel.expert_data_parallel import ExpertDataParallel, expert_parallel_groups
    from minitrain.parallel.expert_parallel_moe import shard_experts
    from minitrain.plan.time import expert_dp_collectives
    config = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4, moe_every=1)
    x = np.arange(32).reshape(4, 8) % 16

    def step(comm):
        ep_comm, expert_dp_comm = expert_parallel_groups(comm, 2)
        model = nn.GPT(nn.GPTConfig(**config))
        shard_experts(model, ep_comm)
        ddp = ExpertDataParallel(model, comm, ep_comm, expert_dp_comm)
        ddp(x[comm.rank:comm.rank + 1], x[comm.rank:comm.rank + 1])[1].backward()
        for c in (ep_comm, expert_dp_comm):
            c.stats.reset()
        ddp.reduce_expert_gradients()
        ddp.clip_grad_norm_(1.0)
        calls = [sum(e["calls"] for e in c.stats.by_name.values()) for c in (expert_dp_comm, ep_comm)]
        return calls, sum(p.data.nbytes for p in ddp.experts), len(ddp.experts)
    for calls, nbytes, tensors in ThreadWorld(4).run(step):
        planned = expert_dp_collectives(plan.GPT(**config), plan.Layout(world=4, dp=4, ep=2, batch_size=4))
        assert planned == [("ring_all_reduce", nbytes, 2), ("ring_all_reduce", 8 * tensors, 2), ("ring_all_reduce", 8, 2)]
        assert calls == [2, 1]                          # two over the expert data-parallel group, one over ep


def test_each_collective_of_the_expert_data_parallel_step_adds_its_own_cpu_to_the_step(monkeypatch):
    """predict() charges every (name, bytes, ranks) of expert_dp_collectives to the step's busy CPU: one more in
    the list adds exactly that collective's busy part (a data-parallel MoE job under ep)."""
    from minitrain.plan import time as plan_time
    machine, model = plan.load_machine("cpu-2core"), plan.GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2,
                                                               n_embd=32, moe_experts=4)
    layout = plan.Layout(world=4, dp=4, ep=2, batch_size=8, extras={"moe_dp_job": True})
    before = plan.predict(model, layout, machine)["step_busy_s"]
    listed = plan_time.expert_dp_collectives
    monkeypatch.setattr(plan_time, "expert_dp_collectives", lambda m, l: listed(m, l) + [("ring_all_reduce", 8, 2)])
    after = plan.predict(model, layout, machine)["step_busy_s"]
    assert after - before == pytest.approx(collective(machine, "ring_all_reduce", 8, 2, 4, busy=True), rel=1e-9)


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_under_cp_each_moe_layer_sums_its_balancing_counts_once_and_the_planner_prices_what_it_sends(capacity):
    """Experts under cp (GPT3D, each rank routing its own tokens): a step's only collectives on the cp
    communicator besides the ring's messages are, per MoE layer and micro-batch, one all-reduce of its G x E
    counts and, with a capacity, one all-gather of every rank's choices (N·k integers); the planner adds
    exactly those to the MoE block's forward (plan/layer_costs.py)."""
    import minitrain as mt
    from minitrain import nn
    from minitrain.comm import ThreadWorld
    from minitrain.parallel.gpt_3d import GPT3D
    from minitrain.plan.layer_costs import axes_comm
    config = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4, moe_groups=2,
                  moe_capacity_factor=capacity)
    x = np.arange(32).reshape(4, 8) % 16

    def step(comm):
        mt.set_default_dtype(np.float64)
        model = GPT3D(nn.GPT(nn.GPTConfig(**config)), comm, cp=2)
        cp = model.mesh.comm("cp")
        cp.stats.reset()
        model.train_step(x, x)
        return {name: (e["calls"], e["bytes_sent"]) for name, e in cp.stats.by_name.items() if e["calls"]}
    choices = 4 * 4 * 2 * 8                            # a rank's: 4 rows x 4 positions x k = 2, int64
    for collectives in ThreadWorld(2).run(step):       # 2 layers: G 2 x E 4 counts, fp64; the choices, p - 1 = 1 hop
        assert collectives == {"recursive_doubling_all_reduce": (2, 2 * 2 * 4 * 8),
                               **({"ring_all_gather": (2, 2 * choices)} if capacity else {})}
    machine = plan.load_machine("cpu-2core")
    layout = plan.Layout(world=2, cp=2, batch_size=4, precision="fp64")
    (dense, _), (moe, _) = axes_comm(plan.GPT(**config), layout, 4, machine, busy=False)
    priced = collective(machine, "ring_all_reduce", 2 * 4 * 8, 2, 2, after_compute=True)
    if capacity:
        priced += collective(machine, "ring_all_gather", 2 * choices, 2, 2, after_compute=True)
    assert moe - dense == pytest.approx(priced, rel=1e-12)


@pytest.mark.parametrize("cp, capacity", [(1, None), (1, 1.0), (2, 1.0)])
def test_under_sequence_parallelism_an_moe_block_prices_the_attention_s_tp_collectives_and_its_routing(cp, capacity):
    """With --sequence-parallel each tp rank routes its own tokens: an MoE block's tp collectives are the
    attention's alone (half a dense block's: no MLP to gather or scatter for), and its routing adds, per
    micro-batch, the G x E counts summed over the cp x tp ranks, P's G x E summed over the tp ranks and, with a
    capacity, the choices of all cp x tp ranks gathered (N·k integers each, N the rank's s/(cp·t) tokens)."""
    from minitrain.plan.layer_costs import gpt_layer_costs
    from minitrain.plan.costs import Costs
    model = plan.GPT(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_embd=16, moe_experts=4, moe_every=2,
                     moe_capacity_factor=capacity)
    machine = plan.load_machine("cpu-2core")
    layout = plan.Layout(world=2 * cp, tp=2, cp=cp, sequence_parallel=True, batch_size=4, precision="fp64")
    (dense, dense_b), (moe, moe_b) = axes_comm(model, layout, 4, machine, busy=False)
    table = 1 * 4 * 8                                  # one group of 4 experts per micro-batch, fp64
    priced = (collective(machine, "ring_all_reduce", table, 2 * cp, 2 * cp, after_compute=True)
              + collective(machine, "ring_all_reduce", table, 2, 2, after_compute=True))
    if capacity:                                       # 4 rows x 16/(cp·2) positions x k 2, int64, from each rank
        priced += collective(machine, "ring_all_gather", 4 * 16 // (2 * cp) * 2 * 8 * 2 * cp, 2 * cp, 2 * cp,
                             after_compute=True)
    assert moe - dense == pytest.approx(priced, rel=1e-12)
    costs = gpt_layer_costs(model, layout, 4, Costs(machine, "fp64", 1, 1.0, False), machine)
    block, moe_block = costs[1], costs[2]              # forward, backward comm: the attention's half, and the routing
    assert moe_block[1] - moe == pytest.approx((block[1] - dense) / 2, rel=1e-12) and block[1] > dense
    assert moe_block[3] - moe_b == pytest.approx((block[3] - dense_b) / 2, rel=1e-12)


@pytest.mark.parametrize("ep", [1, 2])
def test_under_sequence_parallelism_the_planner_sums_the_experts_and_routers_gradients_over_tp(monkeypatch, ep):
    """Each tp rank's experts and routers (and LayerNorms, wpe, row-parallel biases) saw its own tokens:
    TensorParallelGPT sums their gradients over tp at the step's end. The planner prices that all-reduce at the
    bytes of the replicated parameters a rank holds (dp 2 x tp 2, 2 MoE layers of 4 experts, E/ep each), and
    nothing of it without sequence parallelism (the bytes each stage sends: tests/test_plan_tensor_parallel.py)."""
    import minitrain as mt
    from minitrain import nn
    from minitrain.comm import ThreadWorld
    from minitrain.parallel.gpt_3d import GPT3D
    from minitrain.plan import time as plan_time
    config = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4, moe_groups=2)

    def held(comm):
        mt.set_default_dtype(np.float64)
        model = GPT3D(nn.GPT(nn.GPTConfig(**config)), comm, dp=2, tp=2, ep=ep, sequence_parallel=True)
        return sum(q.size for q in model.model.replicated)
    priced = []
    monkeypatch.setattr(plan_time, "collective", lambda m, name, nbytes, p, *a, **k: priced.append((name, nbytes, p))
                        or 0.0)
    layout = plan.Layout(world=4, dp=2, tp=2, ep=ep, sequence_parallel=True, batch_size=4, precision="fp64")
    plan_time.predict_time(plan.GPT(**config), layout, plan.load_machine("cpu-2core"))
    for elements in ThreadWorld(4).run(held):
        assert ("ring_all_reduce", elements * 8, 2) in priced
    priced.clear()
    plan_time.predict_time(plan.GPT(**config), replace(layout, sequence_parallel=False), plan.load_machine("cpu-2core"))
    assert not any(nbytes == elements * 8 for _, nbytes, _ in priced)
