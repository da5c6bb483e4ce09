"""Context parallelism: zig-zag ring attention and DeepSpeed-Ulysses equal full causal attention
(outputs and Q/K/V gradients, float64, p = 1..4), their bytes are the formulas', the zig-zag ring
computes as many blocks on every rank where the contiguous one is 2p/(p+1) off balance; GPT3D with
cp (alone, with dp, tp, sequence parallelism and pp) trains as one process does; and the GPT job
(--cp, --cp-method) equals one process over 10 steps, its JSON "cp" block read."""
import json
import math
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.comm import ThreadWorld, all_reduce
from minitrain.nn import functional as F
from minitrain.parallel.context_parallel import positions_of, ring_attention, zigzag_indices
from minitrain.parallel.context_parallel.gpt import METHODS, sequence_positions
from minitrain.parallel.context_parallel.ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from minitrain.parallel.dropout_masks import ring_mask_rows


def full_attention(q, k, v, causal=True):
    T = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        att = att.masked_fill(np.triu(np.ones((T, T), dtype=bool), k=1), -math.inf)
    return F.softmax(att, axis=-1) @ v


def reference(rng, B, H, T, D):
    q, k, v, do = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    tq, tk, tv = (mt.Tensor(a, requires_grad=True) for a in (q, k, v))
    out = full_attention(tq, tk, tv)
    out.backward(do)
    return (q, k, v, do), (out.data, tq.grad, tk.grad, tv.grad)


# ---------------------------------------------------------------- who holds what
def test_zigzag_pairs_an_early_chunk_with_its_mirror():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    for cp in (1, 2, 3, 4):        # every position held once, chunk r and chunk 2cp-1-r
        held = np.concatenate([zigzag_indices(8 * cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))
        for r in range(cp):
            assert zigzag_indices(8 * cp, cp, r)[-1] == (2 * cp - r) * 4 - 1
    assert positions_of(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]


def test_a_sequence_that_does_not_split_is_one_clear_error():
    with pytest.raises(ValueError, match=r"\(zigzag\): sequence length 10 does not split into 4 equal chunks"):
        zigzag_indices(10, 2, 0)
    with pytest.raises(ValueError, match=r"\(contiguous\): sequence length 7 does not split into 2 equal"):
        sequence_positions(7, _Comm(2), "ulysses")


class _Comm:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


# ---------------------------------------------------------------- ring attention
def run_ring(p, layout, B=2, H=3, D=5, per_rank=4):
    mt.set_default_dtype(np.float64)
    T = per_rank * p
    (q, k, v, do), want = reference(np.random.default_rng(p), B, H, T, D)

    def fn(comm):
        cols = positions_of(T, p, comm.rank, layout)
        lq, lk, lv = (mt.Tensor(np.ascontiguousarray(a[:, :, cols]), requires_grad=True) for a in (q, k, v))
        counted = []
        y = ring_attention(lq, lk, lv, comm, layout=layout, count=counted.append)
        y.backward(np.ascontiguousarray(do[:, :, cols]))
        return cols, (y.data, lq.grad, lk.grad, lv.grad), comm.stats.bytes_sent, sum(counted)
    return want, ThreadWorld(p).run(fn), B * H * per_rank * D * 8


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_ring_attention_equals_full_causal_attention_values_and_gradients(p, layout):
    want, results, block = run_ring(p, layout)
    for cols, got, sent, _ in results:
        for g, w, what in zip(got, want, ("output", "dQ", "dK", "dV")):
            np.testing.assert_allclose(g, w[:, :, cols], rtol=1e-10, atol=1e-12, err_msg=what)
        assert sent == (6 * p - 4) * block if p > 1 else sent == 0    # K, V fwd; K, V, dK, dV back; dK, dV home


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zigzag_balances_the_causal_blocks_the_contiguous_ring_does_not(p):
    counts = {layout: np.array([c for *_, c in run_ring(p, layout)[1]]) for layout in ("zigzag", "contiguous")}
    zig, flat = counts["zigzag"], counts["contiguous"]
    assert zig.max() / zig.mean() == 1.0                        # 2p + 1 chunk blocks on every rank
    assert flat.max() / flat.mean() == pytest.approx(2 * p / (p + 1), rel=1e-12)
    assert zig.sum() == flat.sum() * (2 * p + 1) * p / (4 * p * (p + 1) / 2)     # blocks of (T/2p)^2 vs (T/p)^2


def test_ring_attention_backward_matches_central_differences():
    """d(sum over ranks of <w_r, y_r>)/d(this rank's q, k, v) by backward vs central differences, the
    ranks perturbing one entry at a time in turn (the others hold still) so the global sum sees one change."""
    mt.set_default_dtype(np.float64)
    rng = np.random.default_rng(0)
    q, k, v, w = (rng.standard_normal((1, 2, 4, 3)) for _ in range(4))

    def fn(comm):
        cols = zigzag_indices(4, 2, comm.rank)
        mine = [np.ascontiguousarray(a[:, :, cols]) for a in (q, k, v)]
        weight = w[:, :, cols]

        def total():
            y = ring_attention(*(mt.Tensor(a) for a in mine), comm, layout="zigzag")
            return float(all_reduce(comm, np.array([(y.data * weight).sum()]))[0])
        leaves = [mt.Tensor(a, requires_grad=True) for a in mine]
        ring_attention(*leaves, comm, layout="zigzag").backward(weight)
        worst = 0.0
        for turn in range(comm.size):
            for a, leaf in zip(mine, leaves):
                for i in np.ndindex(a.shape):
                    old, eps = a[i], 1e-6
                    a[i] = old + eps * (comm.rank == turn)
                    plus = total()
                    a[i] = old - eps * (comm.rank == turn)
                    minus = total()
                    a[i] = old
                    if comm.rank == turn:
                        worst = max(worst, abs((plus - minus) / (2 * eps) - leaf.grad[i]))
        return worst
    assert max(ThreadWorld(2).run(fn)) < 1e-8


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("p", [2, 3])
def test_ring_attention_drops_out_with_one_process_s_mask(p, layout):
    """Attention dropout inside the ring: the output and Q/K/V gradients of heads [1, 3) of 4 are one process's
    dropout(softmax(S)) V with its (B, 4, T, T) mask, and every rank's generator ends where that draw left it."""
    mt.set_default_dtype(np.float64)
    B, H, D, per_rank, drop = 2, 4, 3, 4, 0.3
    T = per_rank * p
    rng = np.random.default_rng(p)
    q, k, v, do = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    mt.manual_seed(7)
    tq, tk, tv = (mt.Tensor(a, requires_grad=True) for a in (q, k, v))
    att = F.softmax((tq @ tk.transpose(-2, -1)) * (1.0 / math.sqrt(D)) + mt.Tensor(
        np.where(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf, 0.0)), axis=-1)
    out = F.dropout(att, drop, True) @ tv
    after = mt.random.rand(3)
    out.backward(do)
    want = [a[:, 1:3] for a in (out.data, tq.grad, tk.grad, tv.grad)]

    def fn(comm):
        mt.manual_seed(7)
        cols = positions_of(T, p, comm.rank, layout)
        lq, lk, lv = (mt.Tensor(np.ascontiguousarray(a[:, 1:3][:, :, cols]), requires_grad=True) for a in (q, k, v))
        y = ring_attention(lq, lk, lv, comm, layout=layout, dropout=ring_mask_rows(drop, H, 1, comm, layout, None, 0))
        next_draw = mt.random.rand(3)
        y.backward(np.ascontiguousarray(do[:, 1:3][:, :, cols]))
        return cols, (y.data, lq.grad, lk.grad, lv.grad), next_draw
    for cols, got, next_draw in ThreadWorld(p).run(fn):
        for g, w, what in zip(got, want, ("output", "dQ", "dK", "dV")):
            np.testing.assert_allclose(g, w[:, :, cols], rtol=1e-10, atol=1e-12, err_msg=what)
        np.testing.assert_array_equal(next_draw, after)


# ---------------------------------------------------------------- Ulysses
def test_seq_to_heads_gives_the_whole_sequence_of_this_rank_s_heads_and_heads_to_seq_undoes_it():
    x = np.random.default_rng(0).standard_normal((2, 6, 9, 4))          # p = 3: 2 heads, 3 positions each

    def fn(comm):
        mine = np.ascontiguousarray(x[:, :, 3 * comm.rank:3 * comm.rank + 3])
        heads = seq_to_heads(comm, mine)
        return heads, heads_to_seq(comm, heads), mine
    for r, (heads, back, mine) in enumerate(ThreadWorld(3).run(fn)):
        np.testing.assert_array_equal(heads, x[:, 2 * r:2 * r + 2])
        np.testing.assert_array_equal(back, mine)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_ulysses_equals_full_causal_attention_values_and_gradients(p):
    mt.set_default_dtype(np.float64)
    B, H, D, per_rank = 2, 6, 5, 4
    T = per_rank * p
    (q, k, v, do), want = reference(np.random.default_rng(p), B, H, T, D)

    def fn(comm):
        cols = positions_of(T, p, comm.rank, "contiguous")
        lq, lk, lv = (mt.Tensor(np.ascontiguousarray(a[:, :, cols]), requires_grad=True) for a in (q, k, v))
        y = ulysses_attention(lq, lk, lv, comm, full_attention)
        y.backward(np.ascontiguousarray(do[:, :, cols]))
        return cols, (y.data, lq.grad, lk.grad, lv.grad), comm.stats.bytes_sent
    for cols, got, sent in ThreadWorld(p).run(fn):
        for g, w, what in zip(got, want, ("output", "dQ", "dK", "dV")):
            np.testing.assert_allclose(g, w[:, :, cols], rtol=1e-10, atol=1e-12, err_msg=what)
        assert sent == 8 * (p - 1) * B * H * per_rank * D * 8 // p    # 4 all-to-alls each way, (p-1)/p of a block


def test_ulysses_refuses_heads_that_do_not_divide():
    def fn(comm):
        x = np.zeros((1, 4, 2, 3))
        with pytest.raises(ValueError, match=r"Ulysses: 4 attention heads on this rank do not divide by cp = 3"):
            seq_to_heads(comm, x)
    ThreadWorld(3).run(fn)


# ---------------------------------------------------------------- GPT3D with cp
CP_CASES = {   # mesh, GPT3D's other arguments
    "cp2 ring": (dict(cp=2), dict(cp_method="ring")),
    "cp2 ulysses": (dict(cp=2), dict(cp_method="ulysses")),
    "cp4 ring": (dict(cp=4), dict(cp_method="ring")),
    "cp2xdp2 ring": (dict(cp=2, dp=2), dict()),
    "cp2xtp2 ulysses": (dict(cp=2, tp=2), dict(cp_method="ulysses")),
    "cp2xtp2+sp ring": (dict(cp=2, tp=2), dict(sequence_parallel=True)),
    "cp2xpp2 ring": (dict(cp=2, pp=2), dict(schedule="1f1b", num_microbatches=2)),
    "dp2xcp2xtp2 ulysses 3 rows": (dict(dp=2, cp=2, tp=2), dict(cp_method="ulysses", num_microbatches=2, B=3)),
}


@pytest.mark.parametrize("case", list(CP_CASES))
def test_gpt_3d_with_context_parallelism_equals_the_gpt_on_the_global_batch(case):
    from test_gpt_3d import CONFIG, reference_run, run_3d
    mesh, kwargs = CP_CASES[case]
    mt.set_default_dtype(np.float64)
    mt.manual_seed(0)
    config = nn.GPTConfig(**CONFIG)
    init = {k: v.copy() for k, v in nn.GPT(config).state_dict().items()}
    expected, expected_losses = reference_run(config, init, kwargs.get("B", 8))
    for state, losses in ThreadWorld(int(np.prod(list(mesh.values())))).run(run_3d, config, init, mesh, **kwargs):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-10)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


DROPOUT_CASES = {   # mesh, GPT3D's other arguments (recompute: the config's)
    "cp2 ring recompute full": (dict(cp=2), dict(recompute="full")),
    "cp2xtp2+sp ring recompute selective": (dict(cp=2, tp=2), dict(sequence_parallel=True, recompute="selective")),
    "cp2xtp2+sp ulysses": (dict(cp=2, tp=2), dict(cp_method="ulysses", sequence_parallel=True)),
    "cp2xdp2 ring": (dict(cp=2, dp=2), dict()),
    "cp2xpp2 ulysses zb_h1": (dict(cp=2, pp=2), dict(cp_method="ulysses", schedule="zb_h1", num_microbatches=2)),
}


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_gpt_3d_with_context_parallelism_draws_one_process_s_dropout_masks(case):
    """Every dropout site's mask is a function of the global place it applies to: cp (ring and Ulysses, with tp
    and SP, dp, pp, recomputed) trains as one process does with dropout (float64)."""
    from test_gpt_3d import dropout_run
    dropout_run(*DROPOUT_CASES[case])


@pytest.mark.parametrize("method, ratio", [("ring", 1.0), ("ring_contiguous", 2 * 4 / (4 + 1)), ("ulysses", 1.0)])
def test_gpt_3d_counts_the_attention_work_each_cp_rank_does(method, ratio):
    """What the job's compute_max_over_mean reads: the cores' own counts over a training step, cp = 4
    (the contiguous ring, GPT3D's private comparison method, at 2p/(p+1))."""
    from minitrain.parallel.gpt_3d import GPT3D
    from test_gpt_3d import CONFIG, data

    def fn(comm):
        mt.set_default_dtype(np.float64)
        model = GPT3D(nn.GPT(nn.GPTConfig(**CONFIG)), comm, cp=4, cp_method=method)
        x, y = data(steps=1)[0]
        model.train_step(x, y)
        return sum(core.computed for core in model.cp_cores)
    work = np.array(ThreadWorld(4).run(fn))
    assert work.max() / work.mean() == pytest.approx(ratio, rel=1e-12)


def test_gpt_3d_refuses_what_context_parallelism_cannot_split():
    from minitrain.parallel.gpt_3d import GPT3D
    from test_gpt_3d import CONFIG
    mt.set_default_dtype(np.float64)
    with pytest.raises(ValueError, match=r"Ulysses: 2 attention heads on this rank do not divide by cp = 4"):
        ThreadWorld(8).run(lambda comm: GPT3D(nn.GPT(nn.GPTConfig(**CONFIG)), comm, tp=2, cp=4, cp_method="ulysses"))
    with pytest.raises(ValueError, match="unknown context-parallel method 'striped'"):
        ThreadWorld(2).run(lambda comm: GPT3D(nn.GPT(nn.GPTConfig(**CONFIG)), comm, cp=2, cp_method="striped"))


# ---------------------------------------------------------------- the GPT job with --cp
JOB = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 4, "--block-size", 16,
       "--batch-size", 4, "--sample-chars", 4, "--steps", 10]
LAUNCHES = {   # ranks -> {name: extra options}
    2: {"ring": ["--cp", 2], "ulysses": ["--cp", 2, "--cp-method", "ulysses"],
        # recomputation replays the ring's or the all-to-alls' forward in backward
        "ring recompute full": ["--cp", 2, "--recompute", "full"],
        "ulysses recompute selective": ["--cp", 2, "--cp-method", "ulysses", "--recompute", "selective"],
        "ring dropout": ["--cp", 2, "--dropout", 0.1]},
    4: {"ring cp4": ["--cp", 4], "ulysses cp4": ["--cp", 4, "--cp-method", "ulysses"],
        "ring dp2": ["--cp", 2, "--dp", 2], "ring tp2": ["--cp", 2, "--tp", 2],
        "ring pp2": ["--cp", 2, "--pp", 2, "--microbatches", 2],
        "ulysses tp2 sp": ["--cp", 2, "--tp", 2, "--sequence-parallel", "--cp-method", "ulysses"]},
}


@pytest.fixture(scope="module")
def job_runs(tmp_path_factory):
    """Every layout of LAUNCHES, one mpiexec launch per world size; and one process's runs, without and with
    dropout."""
    from minitrain.examples import gpt
    from minitrain.testing import run_mpi
    from test_resume_guards import run
    d = tmp_path_factory.mktemp("cp")
    reports = {}
    saving = {name: ["--save-dir", str(d / name.replace(" ", "_")), "--save-every", "5"]   # resumed in one process
              for name in ("ring", "ring dropout")}
    # the dropout run resumed from step 5 on its own layout, in a copy of its checkpoints (rank 0 copies)
    again = [str(x) for x in LAUNCHES[2]["ring dropout"]] + ["--save-dir", str(d / "resumed"), "--save-every", "5",
                                                             "--resume", "--json", str(d / "resumed.json")]
    resume = (f"; from mpi4py import MPI; import shutil; MPI.COMM_WORLD.rank or shutil.copytree("
              f"{str(d / 'ring_dropout')!r}, {str(d / 'resumed')!r}, ignore=shutil.ignore_patterns('step-00000010')); "
              f"MPI.COMM_WORLD.Barrier(); assert gpt.main(a + {again!r}) == 0")
    for n, layouts in LAUNCHES.items():
        calls = "; ".join(f"assert gpt.main(a + {[str(x) for x in extra] + saving.get(name, [])!r} + "
                          f"['--json', {str(d / f'{name}.json')!r}]) == 0" for name, extra in layouts.items())
        calls += resume if n == 2 else ""
        run_mpi([sys.executable, "-c", f"from minitrain.examples import gpt; a = {[str(x) for x in JOB]!r}; {calls}"],
                n=n, timeout=300)
        reports.update({name: json.loads((d / f"{name}.json").read_text()) for name in layouts})
    dtype = mt.get_default_dtype()                   # the job sets float64; a module fixture's is not restored
    one = {}
    try:
        for dropout in (False, True):
            status, _, err = run(gpt, JOB + ["--dropout", 0.1] * dropout + ["--json", d / "one.json"])
            assert status == 0, err
            one[dropout] = json.loads((d / "one.json").read_text())
    finally:
        mt.set_default_dtype(dtype)
    return reports, one, d


@pytest.mark.parametrize("name", [name for layouts in LAUNCHES.values() for name in layouts])
def test_the_gpt_job_with_cp_trains_with_one_process_s_losses(job_runs, name):
    reports, one, _ = job_runs
    report, dropout = reports[name], "dropout" in name.split()
    assert report["cp"]["size"] == (4 if "cp4" in name else 2) and report["cp_method"] == name.split()[0]
    assert report["recompute"] == next((w for w in ("full", "selective") if w in name.split()), "none")
    assert report["dropout"] == (0.1 if dropout else 0.0)
    assert len(report["losses"]) == len(one[dropout]["losses"]) == 10
    np.testing.assert_allclose(report["losses"], one[dropout]["losses"], rtol=1e-10, atol=0)
    # validation in eval mode: before training one process's loss without dropout, after it the same model's
    assert report["initial_val_loss"] == pytest.approx(one[False]["initial_val_loss"], rel=1e-12)
    assert report["final_val_loss"] == pytest.approx(one[dropout]["final_val_loss"], rel=1e-12)


@pytest.mark.parametrize("name", [name for layouts in LAUNCHES.values() for name in layouts])
def test_the_json_cp_block_measured_bytes_equal_the_formula_and_the_work_is_balanced(job_runs, name):
    cp = job_runs[0][name]["cp"]
    assert set(cp) == {"size", "method", "layout", "bytes_from", "bytes_per_step", "bytes_formula",
                       "compute_max_over_mean"}
    assert cp["bytes_per_step"] == cp["bytes_formula"] > 0
    assert cp["compute_max_over_mean"] <= 1.05
    # by hand, rank 0: 2 blocks (1 with pp 2) x its replica's rows x T/cp x (C/tp) x 8 bytes x the method's factor
    blocks, rows, width = (1 if "pp2" in name else 2), (2 if "dp2" in name else 4), (16 if "tp2" in name else 32)
    p, again = cp["size"], "recompute" in name                 # recomputed: the forward's sent again
    factor = (12 if again else 8) * (p - 1) / p if cp["method"] == "ulysses" else 6 * p - 4 + 2 * (p - 1) * again
    assert cp["bytes_per_step"] == blocks * rows * 16 // p * width * 8 * factor


@pytest.mark.parametrize("extra, needle", [
    (["--cp", 2, "--block-size", 18], "--block-size 18 does not split into 4 equal chunks (--cp 2 --cp-method ring)"),
    (["--cp", 4, "--cp-method", "ulysses", "--block-size", 18], "--block-size 18 does not split into 4 equal chunks"),
    (["--cp", 3, "--cp-method", "ulysses", "--block-size", 18],
     "--n-head 4 is not divisible by --cp 3 x --tp 1: Ulysses gives each rank whole heads"),
    (["--cp", 2, "--tp", 4, "--sequence-parallel", "--block-size", 20],
     "--block-size 20 / --cp 2 is not divisible by --tp 4 (sequence parallelism"),
    (["--cp-method", "ulysses"], "--cp-method is not supported with --cp 1"),
    (["--cp", 2, "--moe-experts", 2, "--ep", 2], "--ep 2 does not divide the 1 data-parallel ranks"),
    (["--cp", 0], "argument --cp: must be >= 1"),
    (["--cp", 2, "--cp-method", "striped"], "argument --cp-method: invalid choice: 'striped'"),
    (["--cp", 2], "--pp 1 x --cp 2 x --tp 1 = 2 ranks per replica do not divide this job's 1 ranks"),
])
def test_the_job_refuses_in_one_line(extra, needle):
    from minitrain.examples import gpt
    from test_resume_guards import refused
    refused(gpt, JOB + extra, needle)


def test_a_cp_dropout_run_resumed_on_its_layout_draws_the_uninterrupted_run_s_masks(job_runs):
    """Each cp rank gets its own generator back: from step 5 on, the losses and the validation bit for bit."""
    reports, _, d = job_runs
    resumed = json.loads((d / "resumed.json").read_text())
    assert resumed["first_step"] == 5
    assert resumed["losses"] == reports["ring dropout"]["losses"][5:]
    assert resumed["final_val_loss"] == reports["ring dropout"]["final_val_loss"]


@pytest.mark.parametrize("name", ["ring", "ring dropout"])
def test_a_cp_run_s_checkpoint_resumes_in_one_process_with_the_same_losses(job_runs, tmp_path, name):
    """With dropout too: the cp ranks' generators are one process's, so the one process that resumes (rank 0's
    generator back) draws the masks the uninterrupted cp run drew."""
    import shutil
    from minitrain.examples import gpt
    from test_resume_guards import run
    reports, _, saved = job_runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / name.replace(" ", "_"), ckpt)
    shutil.rmtree(ckpt / "step-00000010")                  # resume from step 5
    status, _, err = run(gpt, JOB + ["--dropout", 0.1] * ("dropout" in name) +
                         ["--save-dir", ckpt, "--resume", "--json", tmp_path / "resumed.json"])
    assert status == 0, err
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["first_step"] == 5
    np.testing.assert_allclose(resumed["losses"], reports[name]["losses"][5:], rtol=1e-10, atol=0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_planners_ring_attention_work_is_the_chunk_pairs_each_rank_computes(p):
    """plan/context.ring_attention_work counts, per rank, the zig-zag chunk pairs the ring computes: its score
    products times their entries are the entries the ring reports (count=), and its sends one sendrecv an array
    passed on (2 forward, 4 + 2 backward a hop) are the ring's bytes."""
    from minitrain.plan.context import ring_attention_work
    B, H, D, per_rank = 2, 3, 5, 4
    _, results, block = run_ring(p, "zigzag", B, H, D, per_rank)
    c = per_rank // 2
    fwd, _ = ring_attention_work(B * H, per_rank, D, p)
    pairs = sum(1 for mm in fwd.mm if mm == (c, D, c, B * H))
    for _, _, sent, counted in results:
        assert counted == pairs * B * H * c * c
        assert sent == ((p - 1) * 2 + (p - 1) * 4 + 2) * block
    if p in (2, 4):                      # the planner prices those sendrecvs one by one (1 s each here)
        from minitrain.plan.layer_costs import axes_comm
        from minitrain.plan.validate import planned
        model, layout = planned("gpt", p, f"--cp {p} --n-head 4")
        link = {"alpha_s": 1.0, "bytes_per_s": 1e30}
        (fwd_s, bwd_s), _ = axes_comm(model, layout, 2, {"links": {"intra_node": link, "inter_node": link}}, False)
        assert (fwd_s, bwd_s) == ((p - 1) * 2, (p - 1) * 4 + 2)


def test_a_ring_attention_steps_chunk_pairs_are_charged_their_calibrated_python():
    """plan calibrate's ring_pair_s (the Python and small-array calls of one chunk pair, beyond the arithmetic)
    is charged once per pair each way: a --cp 2 step of 2 layers computes 5 pairs a layer each way (zig-zag)."""
    import copy
    from minitrain import plan
    from minitrain.plan.validate import planned
    model, layout = planned("gpt", 2, "--cp 2")
    machine = copy.deepcopy(plan.load_machine("cpu-2core"))
    from minitrain.plan.time import typical
    base = plan.predict(model, layout, {**machine, "ring_pair_s": 0.0})["step_busy_s"]
    more = plan.predict(model, layout, {**machine, "ring_pair_s": 1e-3})["step_busy_s"]
    assert more - base == pytest.approx(model.n_layer * 2 * 5 * 1e-3 * typical(machine, 2), rel=1e-9)
    assert plan.predict(model, layout, machine)["step_busy_s"] > base       # the committed constant is charged



@pytest.mark.parametrize("extra, groups", [(["--batch-size", 1], None), (["--moe-groups", 1], 1)])
def test_experts_under_cp_count_the_data_parallel_replicas_without_the_cp_ranks(monkeypatch, extra, groups):
    """2 ranks at --cp 2 are one replica: its default --moe-groups is 1 (a batch of one row routes), and 1 group is
    a multiple of its replicas (both were refused, the cp ranks counted as replicas)."""
    from minitrain.examples import gpt
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    args = gpt.parse_args([str(a) for a in JOB + ["--cp", 2, "--moe-experts", 4] + extra])
    assert args.cp == 2 and args.moe_groups == groups
