"""The serving job, run as a user runs it: each cache scheme gives the same tokens, and the memory it
reports equals the formulas (kv_bytes_per_token, the contiguous reservation, under one block of waste
per sequence for paged) and the memory ledger; preemption keeps the tokens; bad input is refused."""
import gc
import json
import sys

import numpy as np
import pytest

import minitrain
from minitrain import nn
from minitrain.data import load_text
from minitrain.examples import generate
from minitrain.examples.serving_checkpoint import ServedCheckpoint, load_checkpoint
from minitrain.testing import run_mpi

SMALL = ["--train-steps", "2", "--n-embd", "32", "--n-head", "4", "--context", "40", "--num-prompts", "5",
         "--max-prompt-len", "17", "--max-new-tokens", "9"]
SERVE = SMALL[2:]                                  # with --checkpoint: nothing trained (--train-steps is refused)


def run(tmp_path, *args):
    out = tmp_path / f"gen{len(list(tmp_path.iterdir()))}.json"
    assert generate.main([*(SERVE if "--checkpoint" in args else SMALL), *args, "--json", str(out)]) == 0
    gc.collect()                                   # the job's model leaves the memory ledger
    return json.loads(out.read_text())


def test_every_scheme_gives_the_same_tokens_and_reports_memory_by_the_formulas(tmp_path, capsys):
    reports = {c: run(tmp_path, "--cache", c, *(["--block-size", "5"] if c == "paged" else []))
               for c in ("none", "contiguous", "paged")}
    tokens = reports["none"]["tokens"]
    assert len(tokens) == 5 and all(len(t) == 9 for t in tokens)
    per_token = 2 * 2 * 32 * 8                                       # 2 · n_layer · n_embd · itemsize (fp64)
    for name, r in reports.items():
        assert r["tokens"] == tokens, name
        assert {"tokens_per_second", "param_bytes", "num_sequences", "blocks_swapped", "preemptions",
                "kv_bytes_reserved", "kv_bytes_used", "kv_bytes_per_token"} <= set(r)
        assert (r["n_layer"], r["n_embd"], r["blocks_swapped"], r["preemptions"]) == (2, 32, 0, 0)
        assert r["param_bytes"] == r["num_params"] * 8 and r["tokens_per_second"] > 0
    assert reports["none"]["kv_bytes_reserved"] == reports["none"]["kv_bytes_per_token"] == 0
    lengths = reports["paged"]["prompt_lengths"]
    contiguous = reports["contiguous"]
    assert contiguous["kv_bytes_per_token"] == per_token and contiguous["num_sequences"] == 5
    assert contiguous["kv_bytes_reserved"] == 5 * 40 * per_token == contiguous["kv_ledger_peak"]
    assert contiguous["kv_bytes_used"] == sum(n + 9 - 1 for n in lengths) * per_token   # at the last step
    paged = reports["paged"]
    assert paged["kv_bytes_used"] == sum(n + 9 - 1 for n in lengths) * per_token   # at the last step
    assert paged["kv_bytes_reserved"] == sum(-(-(n + 8) // 5) for n in lengths) * 5 * per_token
    assert 0 <= paged["kv_bytes_reserved"] - paged["kv_bytes_used"] < paged["num_sequences"] * 5 * per_token
    assert paged["kv_bytes_reserved"] == paged["kv_ledger_bytes"] == paged["kv_ledger_peak"]
    out = capsys.readouterr().out
    assert "tokens/s" in out and "waste" in out and "blocks swapped to host 0" in out


def test_the_tokens_are_each_prompts_greedy_continuation_in_prompt_order(tmp_path):
    report = run(tmp_path, "--train-steps", "0", "--cache", "paged", "--block-size", "3", "--max-batch", "2")
    minitrain.set_default_dtype(np.float64)
    minitrain.manual_seed(0)                                         # the job's untrained model, rebuilt
    gpt = nn.GPT(nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=40, n_layer=2, n_head=4, n_embd=32))
    for prompt, tokens in zip(report["prompts"], report["tokens"]):
        expect = gpt.generate(np.array([prompt]), 9, temperature=0, cache=None)[0, len(prompt):]
        assert tokens == expect.tolist()


@pytest.mark.slow
def test_preemption_and_shared_prefixes_keep_the_tokens(tmp_path):
    from minitrain import memory        # what the process already holds (a notebook's training state) is not the job's
    memory.tracker().add("optimizer_state", "held by the test", 500_000)
    base = run(tmp_path, "--block-size", "4")
    # parameters + 8 blocks of 4 tokens: the longest sequence (17 + 9 = 26 tokens) fits, five do not
    capacity = base["param_bytes"] + 8 * 4 * base["kv_bytes_per_token"]
    swap = run(tmp_path, "--block-size", "4", "--device-memory", str(capacity), "--preempt", "swap")
    recompute = run(tmp_path, "--block-size", "4", "--device-memory", str(capacity), "--preempt", "recompute")
    assert swap["tokens"] == recompute["tokens"] == base["tokens"]
    assert swap["blocks_swapped"] == swap["blocks_swapped_in"] > 0 and swap["preemptions"] > 0
    assert recompute["blocks_swapped"] == 0 and recompute["preemptions"] > 0 and recompute["recomputed_tokens"] > 0
    assert swap["kv_ledger_peak"] <= 8 * 4 * base["kv_bytes_per_token"]
    shared = [run(tmp_path, "--cache", c, *(["--block-size", "3"] if c == "paged" else []), "--shared-prefix", "6")
              for c in ("none", "paged")]
    assert shared[0]["tokens"] == shared[1]["tokens"] and shared[1]["shared_tokens"] >= 6 * 4
    sampled = [run(tmp_path, "--cache", c, "--temperature", "0.8", "--top-k", "10", "--seed", "3")
               for c in ("none", "paged")]
    assert sampled[0]["tokens"] == sampled[1]["tokens"] != run(tmp_path, "--cache", "paged", "--seed", "3")["tokens"]
    memory.tracker().remove("held by the test")


@pytest.mark.parametrize("args, message", [
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--max-prompt-len", "45"],
     "is longer than the context of 40 tokens: --max-prompt-len 31 fits with --max-new-tokens 9"),
    (["--max-prompt-len", "35"], "at most 5 new tokens fit after it"),
    (["--max-prompt-len", "45", "--max-new-tokens", "40"],
     "longer than the context of 40 tokens, which --max-new-tokens 40 alone fills: give fewer new tokens"),
    (["--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
    (["--shared-prefix", "39"], "--shared-prefix 39 leaves no room in the context of 40 tokens"),
    (["--context", "1"], "a context of 1 token holds no prompt token beside a new one"),
    (["--cache", "ring"], "invalid choice"),
    (["--train-steps", "0", "--context", "30000", "--max-prompt-len", "25000", "--max-new-tokens", "2"],
     "prompts are cut from the corpus's validation text of 20,175 tokens: --shared-prefix 0 + --max-prompt-len "
     "25000 = 25,000 tokens take at most 20,174"),
])
def test_bad_options_are_refused_with_what_fits(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate.main([*SMALL, *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_device_that_cannot_hold_one_sequence_is_refused_with_what_fits(capsys):
    assert generate.main([*SMALL, "--train-steps", "0", "--block-size", "4", "--device-memory", "280000"]) == 2
    err = capsys.readouterr().err
    assert "blocks of 4 tokens" in err and "sequences of up to" in err and "Give a device memory of at least" in err
    assert generate.main([*SMALL, "--train-steps", "0", "--device-memory", "1000"]) == 2
    assert "the parameters alone take" in capsys.readouterr().err
    gc.collect()


@pytest.mark.slow
def test_tensor_parallel_job_generates_the_tokens_of_one_process(tmp_path):
    one = run(tmp_path, "--block-size", "4")
    out = tmp_path / "tp.json"
    run_mpi([sys.executable, "-m", "minitrain.examples.generate", *SMALL, "--block-size", "4", "--tp", "2",
             "--json", out], n=2, timeout=120)
    tp = json.loads(out.read_text())
    assert tp["tokens"] == one["tokens"]
    assert tp["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2        # per rank: half the heads
    assert tp["kv_bytes_reserved"] == one["kv_bytes_reserved"] // 2


def test_the_checkpoint_hook_refuses_clearly_when_there_is_nothing_to_load(tmp_path, capsys):
    from minitrain.examples import mlp
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    assert mlp.main(["--epochs", "1", "--hidden", "8", "--batch-size", "512", "--no-progress",
                     "--save-dir", str(tmp_path / "mlp")]) == 0
    capsys.readouterr()
    for folder, message in (("none", "none: no such directory"), ("empty", "no checkpoint in"),
                            ("a_file", "a_file: a file, not a directory"),
                            ("mlp", "was saved by the mlp job; this job serves the gpt job's checkpoints")):
        assert generate.main([*SERVE, "--checkpoint", str(tmp_path / folder)]) == 2
        assert message in capsys.readouterr().err, folder
    gc.collect()


@pytest.mark.slow
def test_the_job_serves_what_the_gpt_job_saved(tmp_path, capsys):
    """gpt --save-dir, then generate --checkpoint: the tokens are the saved weights' greedy continuations
    (rebuilt here from the checkpoint), not the untrained model's; a dtype mismatch is refused clearly."""
    from minitrain import checkpoint
    from minitrain.examples import gpt as gpt_job
    model = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32"]
    assert gpt_job.main(["--steps", "3", "--lr", "0.05", "--block-size", "40", "--batch-size", "4", "--precision",
                         "fp64", "--no-progress", "--save-dir", str(tmp_path / "ck"), "--save-every", "3", *model]) == 0
    report = run(tmp_path, "--checkpoint", str(tmp_path / "ck"), "--cache", "paged", "--block-size", "4")
    untrained = run(tmp_path, "--train-steps", "0")
    minitrain.set_default_dtype(np.float64)
    gpt = nn.GPT(nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=40, n_layer=2, n_head=4, n_embd=32))
    checkpoint.load(checkpoint.find_latest(tmp_path / "ck"), None, gpt, strict=False)
    for prompt, tokens in zip(report["prompts"], report["tokens"]):
        assert tokens == gpt.generate(np.array([prompt]), 9, temperature=0, cache=None)[0, len(prompt):].tolist()
    assert report["tokens"] != untrained["tokens"]
    gc.collect()


def test_a_checkpoint_saved_in_another_precision_is_cast_to_the_served_one_and_the_report_says_so(tmp_path, capsys):
    """As vLLM's --dtype and PyTorch's load_state_dict: the gpt job's fp32 checkpoint served with --precision fp64
    gives the tokens of its weights widened to float64 (exact), and the report's line says so; an fp64 checkpoint
    whose values float32 cannot hold is refused in one line naming the tensor, not served as inf."""
    from minitrain import checkpoint
    from minitrain.examples import gpt as gpt_job
    ck = tmp_path / "ck"
    assert gpt_job.main(["--steps", "1", "--n-embd", "32", "--n-layer", "1", "--no-progress", "--sample-chars", "1",
                         "--save-dir", str(ck)]) == 0
    capsys.readouterr()
    out = tmp_path / "served.json"
    assert generate.main(["--checkpoint", str(ck), "--precision", "fp64", "--num-prompts", "2", "--max-prompt-len", "8",
                          "--max-new-tokens", "4", "--json", str(out)]) == 0
    served = json.loads(out.read_text())
    assert (served["precision"], served["itemsize"], served["param_bytes"]) == ("fp64", 8, served["num_params"] * 8)
    assert served["weights"].endswith("step-00000001, its float32 weights cast to float64")
    assert f"; {served['weights']} (" in capsys.readouterr().out
    config = nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=32, n_layer=1, n_head=4, n_embd=32)
    minitrain.set_default_dtype(np.float32)
    gpt = nn.GPT(config)
    checkpoint.load(checkpoint.find_latest(ck), None, gpt, strict=False)
    minitrain.set_default_dtype(np.float64)
    gpt.to(np.float64)
    for prompt, tokens in zip(served["prompts"], served["tokens"]):
        assert tokens == gpt.generate(np.array([prompt]), 4, temperature=0, cache=None)[0, len(prompt):].tolist()
    huge = nn.GPT(config)                                       # float64, the default again
    huge.wte.weight.data[3, 5] = 1e300
    layout = {"job": "gpt", "precision": "fp64", "model": {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 32,
                                                           "vocab_size": config.vocab_size}}
    checkpoint.save(tmp_path / "huge", None, 1, huge, layout=layout)
    assert generate.main(["--checkpoint", str(tmp_path / "huge"), "--precision", "fp32", "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(": wte.weight holds 1e+300, beyond float32's range: serve it at the "
                                "checkpoint's precision (--precision fp64)") and "Traceback" not in err, err
    minitrain.set_default_dtype(np.float64)
    gc.collect()


def test_a_checkpoint_is_served_at_its_own_sizes_and_precision_unless_told_otherwise(tmp_path, capsys):
    """The gpt job's defaults saved (fp32, context 32), then generate --checkpoint DIR with no model option:
    the checkpoint's sizes and precision, as vLLM takes a model's config and dtype; an option given that differs
    is still refused by name; without --checkpoint the serving job's own defaults (fp64, context 64)."""
    from minitrain.examples import gpt as gpt_job
    ck = tmp_path / "ck"
    assert gpt_job.main(["--steps", "1", "--n-embd", "32", "--n-layer", "1", "--no-progress", "--sample-chars", "1",
                         "--save-dir", str(ck)]) == 0
    out = tmp_path / "served.json"
    assert generate.main(["--checkpoint", str(ck), "--num-prompts", "2", "--max-prompt-len", "8", "--max-new-tokens",
                          "4", "--json", str(out)]) == 0
    served = json.loads(out.read_text())
    assert (served["precision"], served["context"], served["n_layer"], served["n_embd"]) == ("fp32", 32, 1, 32)
    assert served["param_bytes"] == served["num_params"] * 4
    assert generate.main(["--checkpoint", str(ck), "--n-head", "2", "--max-prompt-len", "8", "--max-new-tokens",
                          "4"]) == 2
    assert "n_head = 4 (--n-head), this one 2" in capsys.readouterr().err
    args = generate.parse_args([])
    assert (args.precision, args.context, args.n_layer, args.n_head, args.n_embd) == ("fp64", 64, 2, 4, 64)
    assert (args.min_prompt_len, args.max_prompt_len, args.max_new_tokens) == (4, 24, 32)
    gc.collect()


def test_a_16_bit_checkpoint_is_served_in_16_bits(tmp_path):
    """The gpt job's bf16 checkpoint served with no --precision: bf16 weights and KV cache (the report said bf16
    while it served float32, the choices holding fp32 and fp64 alone), the tokens its bf16 weights give."""
    from minitrain import checkpoint
    from minitrain.backend import bfloat16
    from minitrain.examples import gpt as gpt_job
    ck, out = tmp_path / "ck", tmp_path / "served.json"
    assert gpt_job.main(["--steps", "1", "--n-embd", "32", "--n-layer", "1", "--no-progress", "--sample-chars", "1",
                         "--precision", "bf16", "--save-dir", str(ck)]) == 0
    assert generate.main(["--checkpoint", str(ck), "--num-prompts", "2", "--max-prompt-len", "8", "--max-new-tokens",
                          "4", "--json", str(out)]) == 0
    served = json.loads(out.read_text())
    assert (served["precision"], served["itemsize"], served["param_bytes"]) == ("bf16", 2, served["num_params"] * 2)
    minitrain.set_default_dtype(np.float32)
    gpt = nn.GPT(nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=32, n_layer=1, n_head=4, n_embd=32))
    checkpoint.load(checkpoint.find_latest(ck), None, gpt.to(bfloat16), strict=False)
    for prompt, tokens in zip(served["prompts"], served["tokens"]):
        assert tokens == gpt.generate(np.array([prompt]), 4, temperature=0, cache=None)[0, len(prompt):].tolist()
    minitrain.set_default_dtype(np.float64)
    gc.collect()


def test_lengths_not_given_fit_the_context_and_lengths_given_are_kept(tmp_path):
    """The gpt job's checkpoint has a context of 32, shorter than the serving defaults' 24 + 32 tokens: with no
    length given the job serves it (32 -> 16 new tokens, prompts up to 16), a length given is kept and the
    other fitted beside it, and one that cannot fit is still refused (test_bad_options_are_refused...)."""
    from minitrain.examples import gpt as gpt_job
    ck = tmp_path / "ck"
    assert gpt_job.main(["--steps", "1", "--n-embd", "32", "--n-layer", "1", "--no-progress", "--sample-chars", "1",
                         "--save-dir", str(ck)]) == 0
    out = tmp_path / "served.json"
    assert generate.main(["--checkpoint", str(ck), "--num-prompts", "3", "--json", str(out)]) == 0
    served = json.loads(out.read_text())
    assert served["context"] == 32 and served["max_new_tokens"] == 16
    assert max(served["prompt_lengths"]) <= 16 and min(served["prompt_lengths"]) >= 4
    fitted = lambda *a: [(x.min_prompt_len, x.max_prompt_len, x.max_new_tokens)       # noqa: E731
                         for x in [generate.parse_args([*a, "--train-steps", "0"])]][0]
    assert fitted("--context", "32") == (4, 16, 16)
    assert fitted("--context", "32", "--max-new-tokens", "30") == (2, 2, 30)
    assert fitted("--context", "32", "--max-prompt-len", "10") == (4, 10, 22)
    assert fitted("--context", "32", "--shared-prefix", "8") == (4, 12, 12)
    assert fitted("--shared-prefix", "8") == (4, 24, 32)                 # 8 + 24 + 32 = 64: the defaults fit
    assert fitted("--context", "200") == (4, 24, 32)
    gc.collect()


def test_one_checkpoint_gives_the_sizes_and_the_weights_while_newer_ones_are_saved(tmp_path):
    """The serving job pins the newest checkpoint at start-up: a gpt job that saves a newer one meanwhile
    (here it resumes for a second step) changes neither what the job was built from nor the weights it loads."""
    from minitrain import checkpoint
    from minitrain.examples import gpt as gpt_job
    ck, common = tmp_path / "ck", ["--n-layer", "1", "--n-embd", "32", "--no-progress", "--sample-chars", "1",
                                   "--save-dir"]
    assert gpt_job.main(["--steps", "1", *common, str(ck)]) == 0
    args = generate.parse_args(["--checkpoint", str(ck)])
    assert gpt_job.main(["--steps", "2", *common, str(ck), "--resume", "--use-checkpoint-opt-param-scheduler"]) == 0
    newest = checkpoint.find_latest(ck)
    assert newest != args.served.path and str(args.served.path).endswith("step-00000001")
    model = lambda: nn.GPT(nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=args.context,  # noqa: E731
                                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    minitrain.set_default_dtype(np.float32 if args.precision == "fp32" else np.float64)
    served, latest = model(), model()
    assert load_checkpoint(served, args.served) == args.served.path
    checkpoint.load(newest, None, latest, strict=False)
    assert not all(np.array_equal(p.data, q.data) for p, q in zip(served.parameters(), latest.parameters()))
    minitrain.set_default_dtype(np.float64)
    gc.collect()


@pytest.mark.slow
def test_the_job_serves_a_mixture_of_experts_the_gpt_job_saved(tmp_path, capsys):
    """An MoE checkpoint is served with its experts (from the manifest), dropless: the tokens are the
    saved model's greedy continuations, not a dense model's (which the checkpoint would not even fill)."""
    from minitrain import checkpoint
    from minitrain.examples import gpt as gpt_job
    model = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32"]
    assert gpt_job.main(["--steps", "3", "--lr", "0.05", "--block-size", "40", "--batch-size", "4", "--precision",
                         "fp64", "--no-progress", "--save-dir", str(tmp_path / "ck"), "--save-every", "3",
                         "--moe-experts", "4", "--moe-top-k", "2", "--moe-every", "2", "--moe-capacity-factor", "0.25",
                         *model]) == 0
    report = run(tmp_path, "--checkpoint", str(tmp_path / "ck"), "--cache", "paged", "--block-size", "4")
    served = generate.checkpoint_experts(ServedCheckpoint(tmp_path / "ck"))    # dropless: no capacity, one group
    assert served == {"moe_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_aux_loss_coef": 0.01}
    assert generate.checkpoint_experts(ServedCheckpoint(tmp_path / "none")) == {}
    minitrain.set_default_dtype(np.float64)
    gpt = nn.GPT(nn.GPTConfig(vocab_size=load_text().vocab_size, block_size=40, n_layer=2, n_head=4, n_embd=32,
                              **served))
    assert report["param_bytes"] == sum(q.data.nbytes for q in gpt.parameters())
    checkpoint.load(checkpoint.find_latest(tmp_path / "ck"), None, gpt, strict=False)
    for prompt, tokens in zip(report["prompts"], report["tokens"]):
        assert tokens == gpt.generate(np.array([prompt]), 9, temperature=0, cache=None)[0, len(prompt):].tolist()
    gc.collect()
