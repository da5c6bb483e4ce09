"""The planner (minitrain/plan): the papers' figures from its CLI, its bad-input rules, its options
mirroring the jobs', its shortcuts equal to the long way, and the 175B search (its speed: scripts/bench_planner.py)."""
import argparse
import contextlib
import io
import itertools
import json
import os
from fractions import Fraction

import pytest

from minitrain import plan
from minitrain.parallel.pipeline import formula_bubble_fraction, get_schedule, simulate
from minitrain.plan.activations import gpt_pieces, mlp_pieces
from minitrain.plan.alpha_beta import collective
from minitrain.plan.bubble import _bubble
from minitrain.plan.merge import merge
from minitrain.plan.stages import _in_flight, counts_in_flight, in_flight, stage_chunks
from minitrain.plan.walks import pipeline_walk
from minitrain.plan.work import gpt_block_work, gpt_ends_work, mlp_layer_work
from minitrain.plan.__main__ import main, parser

GPT3 = "--n-layer 96 --n-embd 12288 --n-head 96 --block-size 2048 --vocab-size 51200"


def cli(args):
    """Run ``python -m minitrain.plan ARGS --json`` in-process; the parsed JSON."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args.split() + ["--json"]) == 0
    return json.loads(out.getvalue())


def refused(args):
    """The CLI's error for an impossible layout (exit status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(args.split())
    assert exit_.value.code == 2
    return err.getvalue()


# ---------------------------------------------------------------- the papers
@pytest.mark.parametrize("stage, gb", [(0, 120e9), (1, 31.40625e9), (2, 16.640625e9), (3, 1.875e9)])
def test_zero_figure_1_per_device_from_the_cli(stage, gb):
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB."""
    result = cli(f"params --num-params 7.5e9 --world 64 --zero {stage} --accounting paper")
    assert result["memory_bytes"]["total"] == gb
    assert result["memory_bytes"]["activations"] == 0


# Korthikanti et al. 2022, Table 2, GPT-3 175B (a = 96, h = 12288, s = 2048), t = 8, per layer and sequence (b = 1),
# bytes: sbh = 25,165,824 times 34 + 5as/h = 114; 10 + 24/t + 5as/(ht) = 23; (34 + 80)/8; 10 + 24/8; 34/8; 2
TABLE_2 = [("none", False, 1, 2_868_903_936), ("none", False, 8, 578_813_952), ("none", True, 8, 358_612_992),
           ("selective", False, 8, 327_155_712), ("selective", True, 8, 106_954_752), ("full", False, 8, 50_331_648)]


@pytest.mark.parametrize("recompute, sp, t, expected", TABLE_2)
def test_korthikanti_table_2_per_layer_activations_of_gpt3(recompute, sp, t, expected):
    assert plan.korthikanti_layer_bytes(2048, 1, 12288, 96, t, sp, recompute) == expected


def test_paper_accounting_of_a_whole_gpt3_replica_is_96_layers_of_table_2_plus_the_ends():
    """The CLI's activations under --accounting paper: 96 layers of the Table 2 row, plus the embedding's
    dropout mask sbh/t and the head's inputs and fp32 logits 4sbh/t + 4sbV/t (pp = 1: one stage)."""
    result = cli(f"gpt {GPT3} --tp 8 --world 8 --batch-size 1 --accounting paper --precision fp16")
    sbh = 2048 * 12288
    ends = sbh / 8 + 4 * sbh / 8 + 4 * 2048 * 51200 / 8
    assert result["memory_bytes"]["activations"] == pytest.approx(96 * 578_813_952 + ends, abs=1)
    # model states: 2 + 2 + 12 bytes per parameter of the tp shard (LayerNorms and biases are not split)
    states = result["memory_bytes"]
    assert states["params"] * 8 == pytest.approx(2 * result["num_params"], rel=0.01)
    assert states["params"] == states["grads"] and states["optimizer_state"] == 6 * states["params"]


@pytest.mark.parametrize("schedule, chunks, expected", [("gpipe", 1, Fraction(3, 11)), ("1f1b", 1, Fraction(3, 11)),
                                                       ("interleaved_1f1b", 2, Fraction(3, 19))])
def test_bubble_is_the_papers_formula(schedule, chunks, expected):
    """GPipe's (p-1)/(m+p-1) and the interleaved schedule's (p-1)/(v·m+p-1), from the simulator (on a datasheet
    machine: no calibrated message cost between the stages, which would add its own wait)."""
    result = cli(f"gpt --n-layer 8 --n-head 4 --n-embd 64 --vocab-size 64 --batch-size 16 --pp 4 --world 4 "
                 f"--microbatches 8 --schedule {schedule} --chunks {chunks} --machine a100-80gb")
    assert result["bubble_fraction"] == pytest.approx(float(expected), abs=1e-9)


def test_narayanan_flops_per_iteration_with_recomputation():
    """Narayanan et al. 2021, eq. 3: 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)), exactly, for GPT-3 175B."""
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    formula = 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * l * h))
    result = cli(f"gpt {GPT3} --batch-size {B} --tp 8 --pp 8 --world 1024 --microbatches 96 --recompute full "
                 f"--precision bf16 --machine a100-80gb")
    assert result["flops_per_iteration"] == formula
    no_recompute = plan.flops_per_iteration(plan.GPT(V, s, l, 96, h), plan.Layout(batch_size=B))
    assert formula - no_recompute == 24 * B * s * l * h * h * (1 + Fraction(s, 6 * h))     # one forward less


# Narayanan et al. 2021: Table 1 (1T: 128 layers, h 25600, 160 heads, t 8, p 64, 3072 GPUs, batch 3072, 163
# TFLOP/s per GPU; 145.6B: 80 layers, h 12288, t 8, p 8, 1536 GPUs, batch 2304, 148) and Table 2 (PTD-P, GPT-3
# 175B on 384 GPUs, t 8 x p 12, batch 1536: 153 TFLOP/s per GPU)
THROUGHPUT = [("--n-layer 128 --n-embd 25600 --n-head 160 --world 3072 --batch-size 3072 --pp 64 --microbatches 512", 163),
              ("--n-layer 80 --n-embd 12288 --n-head 96 --world 1536 --batch-size 2304 --pp 8 --microbatches 96", 148),
              ("--n-layer 96 --n-embd 12288 --n-head 96 --world 384 --batch-size 1536 --pp 12 --microbatches 384", 153)]


@pytest.mark.parametrize("sizes, reported", THROUGHPUT)
def test_predicted_throughput_of_the_papers_runs_on_a100s(sizes, reported):
    """The datasheet A100 profile's prediction for Megatron's runs, against the TFLOP/s per GPU they report
    (docs/measured.md: how far off, and why). A bound, not a fit: within 25%."""
    result = cli(f"gpt {sizes} --block-size 2048 --vocab-size 51200 --tp 8 --recompute full --precision fp16 "
                 f"--machine a100-80gb")
    tflops = result["flops_per_iteration"] / result["step_time_s"]["total"] / result["layout"]["world"] / 1e12
    assert reported / 1.25 < tflops < reported * 1.25
    assert result["fits"]


# ---------------------------------------------------------------- the command line
def test_json_has_the_issues_keys():
    result = cli("mlp --world 2")
    assert set(result["memory_bytes"]) == {"params", "grads", "optimizer_state", "activations", "comm_buffers", "total"}
    assert set(result["step_time_s"]) == {"compute", "comm", "bubble", "total"}
    assert {"bubble_fraction", "fits", "flops_per_iteration", "layout"} <= set(result)
    assert result["step_time_s"]["total"] == pytest.approx(sum(result["step_time_s"][k] for k in ("compute", "comm", "bubble")))
    assert set(result["category_peaks"]) == set(result["memory_bytes"]) - {"total"}


def test_every_key_the_json_prints_is_in_the_conventions():
    """docs/conventions.md's "The planner's JSON" names every key plan --json prints, the layout's and the
    categories' too, and names none that it does not print."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "docs" / "conventions.md").read_text()
    bullet = text.split("- **The planner's JSON**")[1].split("\n- **")[0].split("\n## ")[0]
    documented = set(re.findall(r"`([a-z_]+)`", bullet))
    printed = set()
    for args in ("gpt --pp 2 --world 2", "mlp --world 2", "params --num-params 1e9 --world 2"):
        result = cli(args)
        printed |= set(result) | set(result["layout"]) | set(result["memory_bytes"]) | set(result["category_peaks"])
        printed |= set(result["step_time_s"] or {}) | {result["model"]}
        for stage in result["memory_bytes_per_stage"]:
            printed |= set(stage)
    assert printed - documented == set()
    assert documented - printed == set()


PEAK_CASES = ["mlp --strategy zero2 --world 2", "mlp --strategy zero3 --world 4 --precision bf16",
              "mlp --world 2 --strategy pipeline --schedule zb_h1", "mlp --world 4 --strategy pipeline "
              "--schedule interleaved_1f1b --chunks 2 --layers 7", "gpt --world 1 --dropout 0.1",
              "gpt --tp 2 --pp 2 --microbatches 4 --world 4", "gpt --zero 2 --world 2",
              "params --num-params 7.5e9 --world 64 --zero 3", "gpt --pp 2 --world 2 --accounting paper"]


@pytest.mark.parametrize("args", PEAK_CASES)
def test_memory_bytes_is_the_peak_moment_and_category_peaks_each_category_s_own(args):
    result = cli(args)
    parts, peaks = result["memory_bytes"], result["category_peaks"]
    assert sum(v for k, v in parts.items() if k != "total") == parts["total"]          # one moment: the peak
    assert all(parts[c] <= peaks[c] for c in peaks)
    assert parts["total"] <= sum(peaks.values())
    for stage in result["memory_bytes_per_stage"]:
        assert sum(stage[c] for c in stage["category_peaks"]) == stage["total"]


def test_zero2_s_gradient_peak_is_not_at_the_total_s_peak():
    """The issue's case: the categories' own peaks sum to more than the total (421,496 vs 408,204 B)."""
    result = cli("mlp --strategy zero2 --world 2")
    assert result["memory_bytes"]["total"] == 408_204 and sum(result["category_peaks"].values()) == 421_496
    assert result["memory_bytes"]["grads"] < result["category_peaks"]["grads"]


@pytest.mark.parametrize("args", ["gpt --pp 2 --n-layer 3 --world 2", "gpt --pp 4 --n-layer 2 --world 4",
                                  "gpt --pp 2 --chunks 2 --schedule interleaved_1f1b --microbatches 2 --n-layer 3 --world 2"])
def test_every_gpt_pipeline_the_job_runs_is_planned(args):
    """GPT3D cuts embedding + blocks + head into the stages, whatever the blocks' count."""
    result = cli(args)
    assert len(result["memory_bytes_per_stage"]) == result["layout"]["pp"]


def test_the_planner_refuses_what_the_pipeline_job_refuses():
    assert "--recompute is not supported with --strategy pipeline" in refused(
        "mlp --strategy pipeline --recompute full --world 2")
    assert "--precision is not supported with --strategy pipeline (each stage runs in fp32 or fp64" in refused(
        "mlp --strategy pipeline --precision bf16 --world 2")
    ranked = cli("mlp --world 4 --precision fp16 --search")          # nor does the search offer one
    assert ranked and all(r["layout"]["pp"] == 1 for r in ranked)
    assert any(r["layout"]["pp"] > 1 for r in cli("mlp --world 4 --precision fp32 --search"))
    assert "--microbatches 17 exceeds the 16 rows of the largest replica's batch" in refused(
        "gpt --pp 2 --dp 2 --world 4 --batch-size 31 --microbatches 17")
    assert cli("gpt --pp 2 --dp 2 --world 4 --batch-size 31 --microbatches 16")["layout"]["microbatches"] == 16


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_the_planner_plans_dropout_under_cp_as_the_job_runs_it(method):
    """The job trains with dropout under cp (one process's masks), so the planner plans it: the masks' work priced
    (ring: its queries' rows of the attention mask drawn forward and again backward, inside the ring's node)."""
    plain, dropped = (cli(f"gpt --cp 2 --cp-method {method} --world 2" + extra) for extra in ("", " --dropout 0.1"))
    assert dropped["layout"]["cp"] == plain["layout"]["cp"] == 2
    assert dropped["step_busy_s"] > plain["step_busy_s"]
    if method == "ring":     # B·H rows of s = T/cp queries, each drawn over all T keys, forward and backward
        from minitrain.plan.context import ring_attention_work
        for work in ring_attention_work(6, 4, 5, 2, dropout=True):
            assert work.ops[("dropout", None)] == [6 * 4 * 8, 1]


@pytest.mark.parametrize("argv, needle", [
    ("mlp --strategy ddp --schedule gpipe --world 2", "--schedule is not supported with --strategy ddp"),
    ("mlp --strategy zero3 --sync-every 2 --world 2", "--sync-every is not supported with --strategy zero3"),
    ("mlp --strategy zero3 --bucket-cap-mb 5 --world 2", "--bucket-cap-mb is not supported with --strategy zero3"),
    ("gpt --pp 1 --schedule zbv --world 2", "--schedule is not supported with --pp 1"),
    # the planner's own options where nothing reads them
    ("gpt --top 3 --world 2", "--top is not supported with one layout (only --search ranks layouts"),
    ("gpt --moe-load 1 --world 2", "--moe-load is not supported with --moe-experts 0"),
    ("gpt --moe-shared 1 --world 2", "--moe-shared is not supported with --moe-experts 0"),
    ("gpt --expert-hidden 8 --world 2", "--expert-hidden is not supported with --moe-experts 0"),
    ("params --num-params 1e9 --world 4 --threads 2", "--threads is not supported with params"),
    ("gpt --threads 3 --world 2 --machine cpu-2core", "--threads 3 exceeds the 2 cores of machine cpu-2core"),
    ("gpt --threads 1 --world 2 --machine a100-80gb", "--threads is not supported with machine a100-80gb (a GPU"),
    # what --search picks itself
    ("gpt --pp 2 --world 4 --search", "--pp is not supported with --search (it picks the strategy, dp x tp x pp"),
    ("mlp --strategy zero3 --world 2 --search", "--strategy is not supported with --search"),
    ("gpt --threads 1 --world 2 --search", "--threads is not supported with --search (it prices each layout at"),
])
def test_the_planner_refuses_an_option_its_job_would_refuse_not_plans_without_it(argv, needle):
    """The job's own rules (examples/options.py), so that a layout is never planned with an option silently dropped;
    the job's corpus does not bound a planned GPT's sizes (any GPT by its sizes)."""
    assert needle in refused(argv)
    assert cli("gpt --block-size 100000 --vocab-size 256 --world 2")["layout"]["world"] == 2


def test_device_memory_decides_fits():
    need = cli("mlp --world 2 --strategy zero3")["memory_bytes"]["total"]
    assert cli(f"mlp --world 2 --strategy zero3 --device-memory {need}")["fits"]
    assert not cli(f"mlp --world 2 --strategy zero3 --device-memory {need - 1}")["fits"]
    ranked = cli(f"mlp --world 2 --search --device-memory {need}")
    assert ranked and all(r["fits"] and r["memory_bytes"]["total"] <= need for r in ranked)
    assert any(r["layout"]["zero"] == 3 for r in ranked) and not any(r["layout"]["zero"] == 0 and r["layout"]["pp"] == 1
                                                                     for r in ranked)


def _job_parser(kind):
    """The job's own argparse parser (the planner must accept every option of it)."""
    from minitrain.examples import gpt, mlp
    captured = {}
    original = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        captured["parser"] = self
        return original(self, [], namespace)
    argparse.ArgumentParser.parse_args = grab
    try:
        (mlp if kind == "mlp" else gpt).parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured["parser"]


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_every_option_of_the_job_is_accepted_by_the_planner(kind):
    job = _job_parser(kind)
    planner = parser()
    for action in job._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            if action.nargs == 0:
                argv = [option]
            elif action.choices:
                argv = [option, str(list(action.choices)[-1])]
            else:
                argv = [option, str(action.default if action.default not in (None, "") else 2)]
            planner.parse_args([kind, *argv])          # an unknown option or value exits


@pytest.mark.parametrize("args, constraint, nearest", [
    ("gpt --tp 2 --pp 2 --dp 2 --world 6", "dp x pp x tp must equal the world size", "(dp, pp) in"),
    ("gpt --n-head 6 --n-embd 96 --tp 4 --world 4", "heads not divisible by tp", "nearest valid --tp: 2 or 3"),
    ("gpt --n-layer 1 --pp 4 --world 4", "3 layers cannot fill pp x chunks", "nearest valid --n-layer: 2 or more"),
    ("mlp --strategy pipeline --schedule zbv --layers 2 --world 4", "3 Linear layers cannot fill pp x chunks = 8",
     "--layers 7 or more, or --dp 4 (pp = world / dp)"),       # the MLP job's option: it has no --pp
])
def test_impossible_layouts_are_refused_naming_the_constraint_and_the_nearest_valid_choices(args, constraint, nearest):
    message = refused(args)
    assert constraint in message and nearest in message and "Traceback" not in message


def test_a_batch_the_micro_batches_do_not_divide_is_planned_with_its_largest_micro_batch(capsys):
    """The jobs cut it unevenly (64 rows into 5: 13, 13, 13, 13, 12), so the planner takes it too."""
    assert main("mlp --strategy pipeline --microbatches 5 --world 2".split()) in (0, None)
    assert "m=5 x b=13" in capsys.readouterr().out


# ---------------------------------------------------------------- shortcuts equal the long way
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_in_flight_counts_beyond_4p_are_the_schedules_own(name, p):
    for m in (4 * p + 1, 5 * p, 7 * p + 3):
        for s in range(p):
            assert in_flight(name, p, m, s) == _in_flight(name, p, m, s)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_bubble_beyond_2p_equals_the_full_simulation(name, v):
    for (p, m), (f, b) in itertools.product(((2, 8), (4, 12), (3, 9), (4, 4), (3, 2)), ((1.0, 2.7), (1.0, 0.4))):
        if name == "interleaved_1f1b" and m < p:
            continue                            # interleaving needs m >= p (the schedule refuses fewer)
        span, idle = _bubble(name, p, m, v, f, b)
        full = simulate(get_schedule(name, p, m, chunks=v), forward_cost=f, backward_cost=b)
        assert span == pytest.approx(full["total_time"], rel=1e-9)
        assert idle / span == pytest.approx(formula_bubble_fraction(name, p, m, v), rel=1e-9)


def test_one_chunk_walk_equals_the_walk_over_the_schedules_actions():
    model = plan.GPT(vocab_size=65, block_size=32, n_layer=6, n_head=4, n_embd=64)
    for schedule, m in (("1f1b", 2), ("1f1b", 6), ("gpipe", 3)):
        layout = plan.Layout(world=3, batch_size=12, pp=3, microbatches=m, schedule=schedule, recompute="selective",
                             extras={"parallel_job": True})
        pieces = gpt_pieces(model, layout, layout.micro_batch_size)
        for s, chunks in enumerate(stage_chunks(pieces, layout)):
            local = sum(x.params for ps in chunks.values() for x in ps)
            fast = pipeline_walk(in_flight(schedule, 3, m, s), chunks, layout, local, 5)
            slow = pipeline_walk(get_schedule(schedule, 3, m)[s], chunks, layout, local, 5)
            assert fast == slow


def test_zero_bubble_walks_free_at_b_what_w_does_not_need():
    """ZB-H1's B frees what only the input gradients needed; what the weights' nodes saved stays until W
    (autograd/deferred.py). One layer keeping K bytes, D of them for W, in F0 B0 F1 B1 W0 W1: the most at once is
    F1's K beside B0's D (or, where D > K, both Ds before W0), not two micro-batches' K; W makes the gradients."""
    from minitrain.parallel.pipeline import Action
    from minitrain.plan.activations import Piece
    layout = plan.Layout(world=2, batch_size=4, pp=2, microbatches=2, schedule="zb_h1", precision="fp64")
    order = [Action(k, mb) for k, mb in (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1))]
    for K, D in ((100, 30), (100, 100), (100, 160)):   # D > K: a recomputed block's B saves again what W needs
        peak, total, at_peak = pipeline_walk(order, {0: [Piece("layer", [[10]], K, deferred=D)]}, layout, 10, 0)
        assert peak["activations"] == max(K + D, 2 * D)          # (after B1: both micro-batches' D)
        assert peak["grads"] == 8 * 10 and at_peak["activations"] + at_peak["grads"] <= total
    # W goes through the layers in B's order: the last layer's gradients are made while the first still holds
    # its D, which is then the worst moment
    first, last = Piece("first", [], 100, deferred=500), Piece("last", [[1000]], 100, deferred=30)
    order = [Action(k, 0) for k in "FBW"]
    peak, total, at_peak = pipeline_walk(order, {0: [first, last]}, layout, 1000, 0)
    assert (at_peak["activations"], at_peak["grads"]) == (500, 8 * 1000)
    model = plan.MLP((64, 256, 256, 256, 10))
    layout = plan.Layout(world=2, batch_size=64, pp=2, microbatches=4, schedule="zb_h1")
    pieces = mlp_pieces(model, layout, layout.micro_batch_size, in_pipeline=True)
    assert [p.deferred for p in pieces[:-1]] == [p.kept for p in pieces[:-1]]      # a Linear's input, a ReLU's
    assert pieces[-1].kept - pieces[-1].deferred == 16 * 10 * 4 + 4                # output: W needs them; not the loss's


def test_zero_bubble_v_holds_1f1b_s_activations_in_the_paper_s_accounting():
    """ZB-V (Qi et al. 2024, sec. 3): its peak activation memory is 1F1B's, p micro-batches' worth of one stage,
    whatever m; W frees a micro-batch's activations, B does not (counted once, not twice)."""
    model = plan.GPT(vocab_size=65, block_size=32, n_layer=6, n_head=4, n_embd=64)
    machine = plan.load_machine("cpu-2core")

    def activations(schedule, m):
        layout = plan.Layout(world=2, batch_size=2 * m, pp=2, microbatches=m, schedule=schedule,
                             chunks=2 if schedule == "zbv" else 1)
        return plan.predict(model, layout, machine, accounting="paper")["memory_bytes"]["activations"]
    one_f_one_b = activations("1f1b", 4)
    for m in (4, 8, 16):
        assert activations("1f1b", m) == one_f_one_b
        assert one_f_one_b <= activations("zbv", m) <= 1.05 * one_f_one_b   # (the V puts embedding and head on rank 0)


@pytest.mark.parametrize("name, v", [("zb_h1", 1), ("zbv", 2)])
def test_zero_bubble_time_model_is_the_simulator_with_w(name, v):
    """B and W each half the backward, as the runtime splits a Linear's; beyond 2p micro-batches the
    idle time is constant (interpolated between ratios 1.5^k: within 0.5%)."""
    for p, m in ((2, 8), (4, 12), (3, 9), (4, 17)):
        span, idle = _bubble(name, p, m, v, 1.0, 2.7)
        full = simulate(get_schedule(name, p, m), forward_cost=1.0, backward_cost=1.35, weight_cost=1.35)
        assert span == pytest.approx(full["total_time"], rel=5e-3)
        assert idle / span == pytest.approx(full["bubble_fraction"], rel=5e-3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "pipedream_2bw"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_planner_lays_out_the_stages_the_job_runs(schedule, world):
    """The job's options through the planner's mirror of its parser: the same default MLP (enough layers
    for every stage), and the same cut and placement as PipelineParallel (partition.stage_layout)."""
    from types import SimpleNamespace
    from minitrain import nn
    from minitrain.examples.mlp import parse_args
    from minitrain.parallel.pipeline import PipelineParallel
    from minitrain.parallel.pipeline.schedules import default_chunks
    if schedule == "interleaved_1f1b" and world == 3:
        return
    v = default_chunks(schedule, 2 if schedule == "interleaved_1f1b" else None)
    for layers in (None, 2 * world * v + 1):
        options = ["--strategy", "pipeline", "--schedule", schedule, "--microbatches", str(2 * world),
                   "--batch-size", str(8 * world)] + (["--chunks", "2"] if v == 2 and schedule != "zbv" else []) + \
            ([] if layers is None else ["--layers", str(layers)])
        model, layout = plan.mlp_from_args(parse_args(options)[0], world)
        hidden = max(2, world * v) if layers is None else layers
        assert model.sizes == tuple([64] + [128] * hidden + [10]) and layout.chunks == v
        pieces = mlp_pieces(model, layout, layout.micro_batch_size, in_pipeline=True)
        planned = {(rank, chunk): len(ps) for rank, stage in enumerate(stage_chunks(pieces, layout))
                   for chunk, ps in stage.items()}
        for rank in range(world):
            pipe = PipelineParallel(nn.MLP(list(model.sizes)), SimpleNamespace(size=world, rank=rank), schedule,
                                    2 * world, chunks=v)
            ran = {(row["rank"], row["chunk"]): len(row["layers"]) for row in pipe.stage_rows}
            assert ran == planned, (rank, ran, planned)
            assert {c: len(stage) for c, stage in pipe.stages.items()} == \
                {c: n for (r, c), n in planned.items() if r == rank}


def test_one_chunk_walk_with_more_micro_batches_in_flight_after_the_first_backward():
    """A hand-made order (F0 F1 B0 F2 F3 B1 B2 B3): more in flight after the first backward than before."""
    from minitrain.parallel.pipeline import Action
    actions = [Action(k, mb) for k, mb in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("F", 3), ("B", 1), ("B", 2), ("B", 3))]
    model = plan.GPT(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=64)
    layout = plan.Layout(batch_size=8, microbatches=4, recompute="full", extras={"parallel_job": True})
    chunks = {0: gpt_pieces(model, layout, 2)}
    local = sum(x.params for x in chunks[0])
    assert counts_in_flight(actions) == (2, 3)
    assert pipeline_walk(counts_in_flight(actions), chunks, layout, local, 0) == \
        pipeline_walk(actions, chunks, layout, local, 0)


def _matmul_flops(work):
    return sum(2 * batch * m * k * n for m, k, n, batch in work.mm)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_time_model_does_the_matmuls_the_flops_count_counts(recompute):
    """The Work the time model charges holds exactly the matmul FLOPs of flops_per_iteration (per rank,
    per micro-batch: x dp x tp x m gives the whole step's)."""
    model = plan.GPT(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=64)
    layout = plan.Layout(world=4, batch_size=16, dp=2, tp=2, microbatches=2, recompute=recompute)
    b = layout.micro_batch_size
    block_f, block_b = gpt_block_work(model, layout, b)
    (emb_f, emb_b), (head_f, head_b) = gpt_ends_work(model, layout, b)
    per_rank = (3 * (_matmul_flops(block_f) + _matmul_flops(block_b)) + _matmul_flops(head_f) + _matmul_flops(head_b)
                + _matmul_flops(emb_f) + _matmul_flops(emb_b))
    assert per_rank * layout.dp * layout.tp * layout.microbatches == plan.flops_per_iteration(model, layout)
    mlp = plan.MLP((64, 96, 96, 10))
    mlp_layout = plan.Layout(world=2, dp=2, batch_size=32)
    work = mlp_layer_work(mlp, mlp_layout, 16)
    assert sum(_matmul_flops(f) + _matmul_flops(w) for f, w in work) * 2 == plan.flops_per_iteration(mlp, mlp_layout)


@pytest.mark.slow
def test_calibrate_measures_this_machine_and_the_planner_uses_it(tmp_path):
    """``plan calibrate --quick``: every constant measured and positive (matmul rates square, by rows and
    batched; the library's ops; the Python per node, per parameter, of DDP, FSDP and a pipeline's action in a
    2-rank job; the anchor), alpha/beta fitted for each collective at p = 2 under mpiexec (the experts' and
    Ulysses' all_to_all_single among them), wall and busy;
    and as a job meets it; predictions from that file; two calibrations merge into their best."""
    out = tmp_path / "machine.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out)]) == 0
    machine = json.loads(out.read_text())
    from minitrain.plan.ops import PASSES
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        assert all(rate > 0 for _, rate in machine["matmul_flops"][dtype]["1"])
        assert all(rate > 0 for _, rate in machine["matmul_batched_flops"][dtype]["1"])
        assert all(rate > 0 for row in machine["matmul_rows_flops"][dtype]["1"]["flops"] for rate in row)
        assert all(v > 0 for v in machine["elementwise_s_per_element"][dtype].values())
        assert set(machine["ops"][dtype]) == set(PASSES), dtype
        assert all(a >= 0 and b >= 0 and a + b > 0 for a, b in machine["ops"][dtype].values())
    for key in ("numpy_call_s", "autograd_node_s", "optimizer_param_s", "collective_call_s",
                "trace_span_s", "ddp_step_s", "fsdp_unit_s", "anchor_cpu_time_s",
                "typical_alone", "typical_job", "typical_job_waited", "ring_pair_s"):
        assert machine[key] > 0, key
    # a pipeline's action and message: lines a + b·bytes fitted with a, b >= 0 (a = 0 where the intercept came
    # out negative: a quick calibration's small sizes measured cheapest per byte), positive for a message
    for line in ("pipeline_action", "pipeline_message"):
        assert machine[line + "_s"] >= 0 and machine[line + "_byte_s"] >= 0, line
        assert machine[line + "_s"] + machine[line + "_byte_s"] * 32768 > 0, line
    assert machine["leaf_grad_s"] >= 0      # 0 where a disturbed measurement put it all per node (1 in 6 here)
    for name in ("p2p", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast", "all_to_all"):
        fit = machine["collectives"][name]["2"]
        assert fit["alpha_s"] > 0 and fit["beta_s_per_byte"] > 0 and len(fit["points"]) >= 4
        assert fit["busy_alpha_s"] > 0 and fit["busy_beta_s_per_byte"] > 0
        if (os.cpu_count() or 1) >= 2:                        # in a job: where the 2 ranks fit the cores
            assert fit["job_alpha_s"] > 0 and fit["job_beta_s_per_byte"] > 0 and len(fit["job_points"]) >= 4
            assert fit["cold_busy_alpha_s"] > 0 and fit["cold_busy_beta_s_per_byte"] > 0    # right after compute
            assert len(fit["cold_busy_points"]) >= 4
    result = cli(f"mlp --world 2 --machine {out}")
    assert 0 < result["step_time_s"]["comm"] < result["step_time_s"]["total"]
    loaded = {**machine, "numpy_call_s": 2 * machine["numpy_call_s"], "anchor_cpu_time_s": 2 * machine["anchor_cpu_time_s"]}
    merged = merge([loaded, machine])                   # the least loaded calibration, whole
    assert merged["numpy_call_s"] == machine["numpy_call_s"] and merged["ops"] == machine["ops"]


def _fit(alpha, beta, job_alpha, job_beta):
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "busy_alpha_s": alpha / 2, "busy_beta_s_per_byte": beta / 2,
            "job_alpha_s": job_alpha, "job_beta_s_per_byte": job_beta, "points": [], "job_points": []}


def test_merge_comm_only_keeps_the_compute_and_takes_the_least_communication_costs():
    """calibrate --merge A B --comm-only BASE: BASE whole but for the collectives (the best case and the in-a-job
    fits each from the calibration that predicts the least for 1 MiB, apart) and COMM_SCALARS (each the least)."""
    base = {"measured": "base", "anchor_cpu_time_s": 1.0, "numpy_call_s": 1e-6, "ddp_step_s": 9.0, "fsdp_unit_s": 9.0,
            "collectives": {"p2p": {"2": _fit(1e-5, 1e-10, 1e-5, 1e-10)}}}
    a = {"measured": "a", "anchor_cpu_time_s": 0.5, "numpy_call_s": 5e-6, "ddp_step_s": 2.0, "fsdp_unit_s": 1.0,
         "collectives": {"p2p": {"2": _fit(2e-5, 1e-10, 9e-5, 1e-10)}, "ring_all_gather": {"2": _fit(1e-4, 1e-9, 3e-4, 1e-9)}}}
    b = {"measured": "b", "anchor_cpu_time_s": 0.7, "numpy_call_s": 5e-6, "ddp_step_s": 1.0, "fsdp_unit_s": 3.0,
         "collectives": {"p2p": {"2": _fit(3e-5, 1e-10, 4e-5, 1e-10)}}}
    out = merge([a, b], comm_only=base)
    assert out["numpy_call_s"] == 1e-6 and out["anchor_cpu_time_s"] == 1.0           # the base's compute
    assert out["ddp_step_s"] == 1.0 and out["fsdp_unit_s"] == 1.0                      # each the least
    p2p = out["collectives"]["p2p"]["2"]
    assert p2p["alpha_s"] == 2e-5 and p2p["job_alpha_s"] == 4e-5                       # a's best case, b's in a job
    assert out["collectives"]["ring_all_gather"]["2"]["job_alpha_s"] == 3e-4
    assert out["measured"] == "base; communication costs: the best of a, b"
    whole = merge([a, b])
    assert whole["numpy_call_s"] == 5e-6 and whole["ddp_step_s"] == 2.0                # the least loaded (a), whole


def test_collectives_cost_their_best_case_and_the_late_rank_is_the_computes():
    """A collective is priced at its best-case fit, whatever calibrate measured in a job (ranks arriving apart:
    the wait for the later one is priced with the compute, plan/time.typical); its busy part at the busy fit."""
    machine = {"collectives": {"ring_all_reduce": {"2": _fit(1e-5, 1e-10, 4e-5, 2e-10)},
                               "p2p": {"2": _fit(1e-5, 1e-10, 4e-5, 2e-10)}}}
    n = 1 << 20
    assert collective(machine, "ring_all_reduce", n, 2) == pytest.approx(2 * 1e-5 + n * 1e-10)
    assert collective(machine, "p2p", n, 2) == pytest.approx(1e-5 + n * 1e-10)
    assert collective(machine, "ring_all_reduce", n, 2, busy=True) == pytest.approx(2 * 0.5e-5 + n * 0.5e-10)


def test_tensor_parallel_layouts_pay_for_their_collectives_and_inter_node_links_cost_more():
    """A layout built in Python (as --search builds them) pays tp's collectives: 8 ranks of one node on
    NVLink, 32 across four nodes on InfiniBand."""
    model = plan.GPT(vocab_size=51200, block_size=2048, n_layer=8, n_head=32, n_embd=4096)
    comm = {t: plan.predict(model, plan.Layout(world=t, tp=t, batch_size=4, precision="bf16"),
                            "a100-80gb")["step_time_s"]["comm"] for t in (8, 32)}
    a100 = plan.load_machine("a100-80gb")
    per_block = 4 * collective(a100, "ring_all_reduce", 4 * 2048 * 4096 * 2, 8, 8)   # 2 forward, 2 backward
    assert comm[8] >= 8 * per_block and comm[32] > 4 * comm[8]


# ---------------------------------------------------------------- scale
def test_search_over_every_layout_of_gpt3_175b_on_1024_gpus(monkeypatch):
    """All dp x pp x tp factorings x ZeRO 0-3 x recompute x micro-batch sizes (x SP), the best ten printed
    (how long it takes: scripts/bench_planner.py)."""
    args = f"gpt {GPT3} --batch-size 1536 --world 1024 --precision bf16 --machine a100-80gb --search".split()
    ranked = cli(" ".join(args))
    import minitrain.plan.__main__ as plan_main
    monkeypatch.setattr(plan_main, "search", lambda *a: ranked)   # the table of the same ranking (searched once)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(args)
    lines = buf.getvalue().splitlines()
    assert "layouts fit" in lines[0] and len(lines) == 11            # the best ten
    assert lines[1].split()[1] == ranked[0]["describe"].split()[0]
    times = [r["step_time_s"]["total"] for r in ranked]
    assert len(ranked) > 100 and times == sorted(times) and all(r["fits"] for r in ranked)
    assert all(r["layout"]["dp"] * r["layout"]["pp"] * r["layout"]["tp"] * r["layout"]["cp"] == 1024 for r in ranked)
    assert {r["layout"]["cp"] for r in ranked} == {1, 2} and {r["layout"]["ep"] for r in ranked} == {1}   # s/cp >= 1024
    assert {r["layout"]["zero"] for r in ranked} >= {0, 1} and {r["layout"]["recompute"] for r in ranked} >= {"none", "full"}


def test_what_the_planner_does_not_model_of_experts_is_refused_in_one_line():
    # experts are planned (tests/test_plan_moe.py); their dropout masks are not: a wrong number otherwise
    message = refused("gpt --moe-experts 4 --moe-top-k 2 --dropout 0.1")
    assert "--dropout with --moe-experts is not modelled" in message and "Traceback" not in message
    assert "Traceback" not in refused("gpt --moe-experts 4 --ep 3 --world 6")


def test_stages_alike_share_one_walk_and_stages_with_more_in_flight_hold_more():
    """Interior stages of the same layers are walked once per in-flight count (plan/memory.py): under 1F1B
    stage s keeps min(m, p - s) micro-batches, so two stages of the same blocks differ by one micro-batch's
    activations, exactly; under GPipe all keep m and are equal; each stage's dict is its own."""
    model = plan.GPT(vocab_size=64, block_size=32, n_layer=8, n_head=2, n_embd=32)
    base = dict(world=4, pp=4, batch_size=8, microbatches=8)
    one_f = plan.predict(model, plan.Layout(schedule="1f1b", **base), "cpu-2core")["memory_bytes_per_stage"]
    gpipe = plan.predict(model, plan.Layout(schedule="gpipe", **base), "cpu-2core")["memory_bytes_per_stage"]
    kept = gpipe[1]["activations"] / 8                       # one micro-batch's kept activations in these blocks
    assert kept > 0 and gpipe[1] == gpipe[2]
    assert one_f[1]["activations"] - one_f[2]["activations"] == kept      # 3 in flight against 2
    assert one_f[1]["params"] == one_f[2]["params"]
    gpipe[1]["category_peaks"]["activations"] += 1           # the walk is shared, the answers are not
    assert gpipe[2]["category_peaks"]["activations"] == gpipe[1]["category_peaks"]["activations"] - 1


def test_a_machine_file_that_is_not_one_is_refused_in_one_line(tmp_path):
    """plan, validate and calibrate --merge: a missing machine, a file that is not JSON, and JSON without the
    constants each end in one error line naming the file (exit status 2), never a traceback."""
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty.json").write_text("{}")
    cases = [(tmp_path / "none.json", "no machine"), (tmp_path / "broken.json", "cannot read the machine"),
             (tmp_path / "empty.json", "is not a machine's constants (no name, device, matmul_flops")]
    for path, said in cases:
        for argv in (f"mlp --machine {path}", f"validate --runs ddp-2 --machine {path}", f"calibrate --merge {path}"):
            message = refused(argv)
            assert said in message and str(path) in message and "Traceback" not in message, (argv, message)


def test_calibrate_refuses_what_it_cannot_honour_before_measuring(tmp_path, monkeypatch):
    """calibrate measures for a minute, so its command line is checked first: --out a folder ("out/", which would
    write a file "out") or in a missing one (the jobs' --json's rule), a p in --ranks twice (measured twice), a
    blank --name, --ranks or --quick with --merge (which measures nothing); by default it writes the cache,
    making its folder."""
    import minitrain.plan.calibrate as calibrate
    measured = []
    monkeypatch.setattr(calibrate, "calibrate", lambda ranks, quick: measured.append(ranks) or {"name": "here"})
    monkeypatch.setattr(calibrate, "DEFAULT_PATH", tmp_path / "cache" / "minitrain" / "machine.json")
    machine = str(calibrate.MACHINES / "cpu-2core.json")
    for argv, said in [(["--out", f"{tmp_path}/new/"], "argument --out: "), (["--ranks", "2", "2"], "argument --ranks: 2 given more than once"),
                       (["--ranks", "1"], "argument --ranks: must be >= 2, got 1 (a collective on one rank"),
                       (["--name", " "], "argument --name: "), (["--merge", machine, "--quick"], "--quick is not supported"),
                       (["--merge", machine, "--ranks", "3"], "--ranks is not supported with --merge")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            main(["calibrate", *argv])
        assert exit_.value.code == 2 and said in err.getvalue() and "Traceback" not in err.getvalue(), (argv, err.getvalue())
    assert not measured and not (tmp_path / "new").exists()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["calibrate", "--ranks", "2", "3"]) == 0
        assert main(["calibrate", "--merge", machine, "--name", "ci", "--out", str(tmp_path / "m.json")]) == 0
    assert measured == [[2, 3]] and json.loads(calibrate.DEFAULT_PATH.read_text()) == {"name": "here"}
    assert json.loads((tmp_path / "m.json").read_text())["name"] == "ci"


def test_zero_leaves_a_pipeline_s_bubble_fraction_as_it_is():
    """ZeRO's collectives come after the pipeline's flush: the bubble, and the pipeline's span it is a fraction
    of, are the same at every ZeRO stage (not the bubble over the ranks ZeRO's collectives span)."""
    results = [cli(f"gpt --pp 2 --dp 2 --microbatches 2 --world 4 --zero {z}") for z in range(4)]
    assert results[0]["bubble_fraction"] > 0.1
    for result in results[1:]:
        assert result["step_time_s"]["bubble"] == results[0]["step_time_s"]["bubble"]
        assert result["bubble_fraction"] == results[0]["bubble_fraction"]


def test_params_prints_memory_alone_and_its_search_ranks_by_memory():
    """plan params sizes model states: no step time (0 ms) printed beside them, its search the smallest first."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main("params --num-params 1e9 --world 4".split()) == 0
        assert main("params --num-params 1e9 --world 4 --search --top 2".split()) == 0
    text = out.getvalue()
    assert "memory per rank" in text and "the 2 smallest:" in text
    assert "step time" not in text and "s/step" not in text and "fastest" not in text
    result = cli("params --num-params 1e9 --world 4")
    assert result["step_time_s"] is result["step_busy_s"] is result["bubble_fraction"] is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):                      # a search nothing fits: no empty ranking
        assert main("mlp --world 4 --device-memory 1e3 --search".split()) == 0
    assert out.getvalue().startswith("0 layouts fit (") and "fastest" not in out.getvalue()


def test_a_named_model_s_sizes_are_not_options_the_command_line_gave():
    """--model's sizes are defaults: its experts' top-k beside --moe-experts 0 is not refused as if typed (the
    dense model of its sizes is planned); typed, it is."""
    assert cli("gpt --model mixtral-8x7b --moe-experts 0 --world 8")["num_params"] > 0
    assert "--moe-top-k is not supported with --moe-experts 0" in refused(
        "gpt --model mixtral-8x7b --moe-experts 0 --moe-top-k 2 --world 8")


def test_a_search_ranks_the_cp_asked_beside_its_own():
    """--cp is the one layout option --search takes (it tries cp only down to 1024 tokens a rank otherwise)."""
    assert {r["layout"]["cp"] for r in cli("gpt --cp 2 --world 4 --search")} == {1, 2}


def test_a_thread_count_between_the_calibrated_ones_is_priced_between_them():
    """calibrate measures 1 thread and the cores; a 2-rank job on 8 cores takes 4 a rank. It was priced on the
    8 threads' curve (as fast as twice its cores); now each rate is interpolated between 1 and 8, and beyond the
    calibrated counts the nearest is taken."""
    from minitrain.plan.costs import Costs
    base = plan.load_machine("cpu-2core")
    machine = {**base, "cores": 8}
    for key in ("matmul_flops", "matmul_batched_flops", "matmul_rows_flops"):
        machine[key] = {d: dict(v) for d, v in base[key].items()}
    slow = machine["matmul_flops"]["float64"]["1"]
    machine["matmul_flops"]["float64"] = {"1": slow, "8": [[n, 8 * r] for n, r in slow]}
    grid = machine["matmul_rows_flops"]["float64"]["1"]
    machine["matmul_rows_flops"]["float64"] = {"1": grid, "8": {**grid, "flops": [[8 * f for f in row]
                                                                                   for row in grid["flops"]]}}
    rates = {t: Costs(machine, "fp64", t) for t in (1, 4, 8, 16)}
    for (n, r1), (_, r4), (_, r8), (_, r16) in zip(*(rates[t].curve for t in (1, 4, 8, 16))):
        assert r4 == pytest.approx(r1 + 3 / 7 * (r8 - r1)) and r16 == r8 == pytest.approx(8 * r1)
    assert rates[4].grid["flops"][0][0] == pytest.approx(grid["flops"][0][0] * (1 + 3 / 7 * 7))
    layouts = {t: plan.Layout(world=1, dp=1, batch_size=256, threads=t, precision="fp64") for t in (1, 4, 8)}
    times = {t: plan.predict(plan.MLP((64, 512, 512, 10)), layout, machine)["step_time_s"]["compute"]
             for t, layout in layouts.items()}
    assert times[1] > times[4] > times[8]


def test_a_job_s_start_up_leaves_the_planner_s_predictions_unloaded_until_asked():
    """Every rank imports the planner's option rules (examples/options.py) but only rank 0 asks for a prediction,
    at the end: the modules that predict load when first named (plan/__init__.py), not at every rank's start-up."""
    import subprocess
    import sys
    code = ("import sys, minitrain.examples.mlp, minitrain.examples.gpt\n"
            "heavy = ['minitrain.plan.' + m for m in ('memory', 'time', 'calibrate', 'counts', 'papers')]\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "from minitrain import plan\n"
            "plan.load_machine, plan.predict_time\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    before, after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.splitlines()
    assert before == "[]" and "'minitrain.plan.calibrate'" in after and "'minitrain.plan.time'" in after, (before, after)


def test_offloaded_states_are_on_the_host_and_on_a_cpu_count_against_its_one_memory():
    """ZeRO-3 + offload of 10^10 parameters on 4 ranks of the 2-core CPU machine: the device holds nothing at rest
    and the host 16 bytes per parameter of each rank's shard (ZeRO-Offload's fp16 shards, fp32 master and moments),
    which on a CPU is the same memory: it does not fit there (it was said to fit in 5.89 GiB with 0 B), and fits
    an 80 GB GPU beside a host that holds it."""
    model = plan.Params(10 ** 10)
    for machine, fits in (("cpu-2core", False), ("a100-80gb", True)):
        layout = plan.Layout(world=4, dp=4, zero=3, offload=True, precision="fp16", batch_size=4)
        result = plan.predict(model, layout, plan.load_machine(machine))
        shard = 10 ** 10 // 4
        assert result["memory_bytes"]["total"] == 0
        assert result["host_memory_bytes"] == {"params": 2 * shard, "grads": 2 * shard, "optimizer_state": 12 * shard,
                                               "total": 16 * shard}
        assert (result["fits"], result["fits_counts_host"]) == (fits, machine == "cpu-2core"), machine
    assert plan.predict(model, plan.Layout(world=4, dp=4, zero=3, precision="fp16", batch_size=4),
                        plan.load_machine("a100-80gb"))["host_memory_bytes"] is None


def test_offload_on_a_gpu_machine_fits_only_where_each_rank_s_share_of_its_host_holds_what_it_offloads():
    """A GPU machine's host (a100-80gb: a DGX A100's 2 TiB for its 8 GPUs) is shared by the ranks on it, min(world, 8):
    GPT-3's 175B under ZeRO-3 + offload puts 16 bytes a parameter of each shard on the host, 350 GB a rank on 8 ranks,
    more than a rank's 256 GiB (it was said to fit: nothing on the device), and 43.75 GB on 64; 13B on 4 ranks gets
    half the node each. --host-memory gives another host; refused where nothing is offloaded."""
    node, shard = 2 ** 41, lambda n, world: 16 * n // world
    for n, world, share, fits in ((175e9, 8, node // 8, False), (175e9, 64, node // 8, True), (13e9, 4, node // 4, True)):
        result = cli(f"params --num-params {n:.0f} --world {world} --zero 3 --offload --precision bf16 --machine a100-80gb")
        assert result["memory_bytes"]["total"] == 0 and result["host_memory_bytes"]["total"] == shard(int(n), world)
        assert (result["host_capacity_bytes"], result["fits"], result["fits_counts_host"]) == (share, fits, False), n
    bigger = cli("params --num-params 175e9 --world 8 --zero 3 --offload --precision bf16 --machine a100-80gb "
                 "--host-memory 4e12")
    assert (bigger["host_capacity_bytes"], bigger["fits"]) == (5 * 10 ** 11, True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main("params --num-params 175e9 --world 8 --zero 3 --offload --precision bf16 --machine a100-80gb".split())
    assert "total 0 B  -> fits in 80.00 GiB" in out.getvalue()                     # the device's verdict, then the host's
    assert "total 325.96 GiB  -> does NOT fit in its share of the host, 256.00 GiB" in out.getvalue()
    # --search tries every ZeRO stage with and without offload: only ZeRO-3 + offload fits, and only on a bigger host
    search = "params --num-params 175e9 --world 8 --precision bf16 --machine a100-80gb --search"
    assert cli(search) == [] and [r["describe"] for r in cli(search + " --host-memory 4e12")] == [
        "dp8 pp1 tp1 zero3+offload m=1 x b=1"]
    assert "--host-memory is not supported with a layout that offloads nothing" in refused(
        "params --num-params 1e9 --world 8 --zero 3 --machine a100-80gb --host-memory 4e12")
    assert "--host-memory is not supported with the gpt model" in refused("gpt --world 2 --machine a100-80gb --host-memory 1e12")
    assert cli("params --num-params 1e9 --world 8 --zero 3 --machine a100-80gb")["host_capacity_bytes"] is None
    tiny = cli("params --num-params 1e9 --world 8 --zero 3 --offload --machine a100-80gb --host-memory 0.5")
    assert (tiny["host_capacity_bytes"], tiny["fits"]) == (0, False)      # a host of no bytes holds nothing (it was unchecked)


@pytest.mark.slow
def test_zero3_offload_of_units_no_rank_count_divides_is_planned_to_the_byte(tmp_path):
    """FSDP pads each unit's flat shard on its own: at hidden 33 on 4 ranks the host holds 1,184 elements per rank, where
    padding the 4,729 parameters as one would say 1,183 (the planner's first host figure was 4 to 12 bytes short)."""
    import json
    import sys
    from minitrain.testing import run_mpi
    options = ["--strategy", "zero3", "--offload", "--hidden", "33", "--layers", "3"]
    out = tmp_path / "mlp.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.mlp", "--no-progress", "--epochs", "1", "--json", str(out),
             *options], n=4, timeout=120)
    planned = cli("mlp --world 4 " + " ".join(options))["host_memory_bytes"]
    for rank in json.loads(out.read_text())["ranks"]:
        assert {c: planned[c] for c in rank["memory"]["host"]} == rank["memory"]["host"], (rank["rank"], planned)
    assert planned["params"] == 4 * 1184
