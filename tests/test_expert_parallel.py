"""Expert parallelism (parallel/expert_parallel.py, expert_parallel_moe.py, expert_data_parallel.py and the
GPT job's --ep): the AllToAll Function against its definition; the sharded MoE layer against one process's
nn.MoE at p = 2, 3, 4 (values, input and expert gradients; uneven token counts, an expert and a whole rank
that receive no row, capacity, top-1 and top-2); the gradients after the expert and dense reductions equal
one process on the global batch (dp 4 with ep 1, 2, 4); the job in float64 at 2 and 4 ranks trains with
one process's losses and reports all-to-all bytes measured equal to the formula; the refusals."""
import json
import sys

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.comm import ThreadWorld
from minitrain.parallel.expert_data_parallel import ExpertDataParallel, expert_parallel_groups
from minitrain.parallel.expert_parallel import AllToAll, all_to_all_bytes
from minitrain.parallel.expert_parallel_moe import ExpertParallelMoE, full_state_dict, shard_experts
from minitrain.testing import run_mpi
from test_resume_guards import refused, run

from minitrain.examples import gpt

TOL = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the Function
@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_to_all_sends_rows_and_its_backward_sends_their_gradients_back(p):
    def sizes(i):                                    # rank i sends sizes(i)[j] rows to rank j, zeros included
        return [(i + 2 * j) % 3 for j in range(p)]

    def fn(comm):
        r = comm.rank
        send, receive = sizes(r), [sizes(i)[r] for i in range(p)]
        x = mt.Tensor(r * 100.0 + np.arange(sum(send) * 2, dtype=np.float64).reshape(-1, 2), requires_grad=True)
        y = AllToAll.apply(x, comm, receive, send)
        weight = np.arange(y.size, dtype=np.float64).reshape(y.shape) + 1 + 10 * r
        (y * mt.Tensor(weight)).sum().backward()
        return x.data, y.data, weight, x.grad, comm.stats["all_to_all_single"]["bytes_sent"]
    out = ThreadWorld(p).run(fn)
    for r in range(p):
        send, receive = sizes(r), [sizes(i)[r] for i in range(p)]
        want, want_grad = [], []
        for i in range(p):                           # rows rank i sent here, in rank order
            at = sum(sizes(i)[:r])
            want.append(out[i][0][at:at + sizes(i)[r]])
        np.testing.assert_array_equal(out[r][1], np.concatenate(want))
        for j in range(p):                           # the gradient of the rows sent to j: j's weights for them
            at = sum(sizes(i)[j] for i in range(r))
            want_grad.append(out[j][2][at:at + sizes(r)[j]])
        np.testing.assert_array_equal(out[r][3], np.concatenate(want_grad))
        # forward sends the rows to other ranks, backward the gradients of the rows received from them
        assert out[r][4] == all_to_all_bytes(send, receive, r, 16, backward=False)


# ---------------------------------------------------------------- the sharded layer against one process
def moe_with_weights(E, C, k, cf, groups, seed=0):
    moe = nn.MoE(C, E, top_k=k, capacity_factor=cf, groups=groups, aux_loss_coef=0.1)
    g = np.random.default_rng(seed)
    for p in moe.parameters():
        p.data[...] = g.standard_normal(p.shape) * 0.5
    return moe


def tokens(r, C, positive=False):
    x = np.random.default_rng(100 + r).standard_normal((5 + 2 * r, C))    # uneven counts: 5, 7, 9, 11 tokens
    return np.abs(x) if positive else x


def starve(moe, experts):
    """With positive inputs, these experts' router rows make them everybody's last choice."""
    moe.router.weight.data[list(experts)] = -10.0


CASES = {   # top_k, capacity_factor, the experts no token chooses (None: the last rank's)
    "top2_dropless": (2, None, ()),
    "top1_dropless_an_idle_expert": (1, None, (1,)),
    "top1_capacity_a_rank_receives_nothing": (1, 1.0, None),
    "top2_capacity": (2, 0.75, ()),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_sharded_layer_equals_one_process_values_and_gradients(case, p, float64):
    k, cf, idle = CASES[case]
    E, C = 2 * p, 6
    idle = range(E - 2, E) if idle is None else idle
    positive = bool(idle)

    def build():
        moe = moe_with_weights(E, C, k, cf, groups=1)
        starve(moe, idle)
        return moe

    def fn(comm):
        mt.set_default_dtype(np.float64)
        layer = ExpertParallelMoE(build(), comm)
        x = mt.Tensor(tokens(comm.rank, C, positive), requires_grad=True)
        y = layer(x)
        ((y * y).sum() + layer.aux_loss).backward()
        grads = {f"experts.{layer.first_expert + int(n.split('.')[1])}.{n.split('.', 2)[2]}": p.grad
                 for n, p in layer.named_parameters() if n.startswith("experts.")}
        return y.data, x.grad, layer.router.weight.grad, grads, layer.stats["dropped"]
    out = ThreadWorld(p).run(fn)
    one = build()
    expert_grads = {}
    for r in range(p):
        one.zero_grad()
        x = mt.Tensor(tokens(r, C, positive), requires_grad=True)
        y = one(x)
        ((y * y).sum() + one.aux_loss).backward()
        np.testing.assert_allclose(out[r][0], y.data, **TOL)
        np.testing.assert_allclose(out[r][1], x.grad, **TOL)
        np.testing.assert_allclose(out[r][2], one.router.weight.grad, **TOL)
        assert out[r][4] == one.stats["dropped"]
        for n, q in one.named_parameters():          # an expert's gradient: the sum over every rank's tokens
            if n.startswith("experts.") and q.grad is not None:
                expert_grads[n] = expert_grads.get(n, 0) + q.grad
    if cf is not None:
        assert sum(o[4] for o in out) > 0, "the case should drop some choices"
    held = {n: g for o in out for n, g in o[3].items()}
    assert set(held) == {n for n, _ in one.named_parameters() if n.startswith("experts.")}
    assert not any(int(n.split(".")[1]) in idle for n in expert_grads)
    for n, g in held.items():
        if n not in expert_grads:
            assert g is None, n                      # no row reached it, as in one process
        else:
            np.testing.assert_allclose(g, expert_grads[n], **TOL, err_msg=n)


# ---------------------------------------------------------------- the reductions: one process's step
CONFIG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, moe_experts=4, moe_top_k=2, moe_every=1)
ROWS = 2                                             # sequences per rank


def batch(dp):
    g = np.random.default_rng(7)
    return g.integers(0, 11, (dp * ROWS, 8)), g.integers(0, 11, (dp * ROWS, 8))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_after_the_reductions_every_gradient_is_one_process_s_on_the_global_batch(ep, float64):
    dp = 4

    def fn(comm):
        mt.set_default_dtype(np.float64)
        mt.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(**CONFIG, moe_groups=1))
        ep_comm, expert_dp_comm = expert_parallel_groups(comm, ep)
        first = comm.rank // ep * ep                 # blocks of ep consecutive dp ranks; the same position in each
        assert ep_comm.members == list(range(first, first + ep))
        assert expert_dp_comm.members == list(range(comm.rank % ep, dp, ep))
        shard_experts(model, ep_comm)
        trainer = ExpertDataParallel(model, comm, ep_comm, expert_dp_comm)
        x, y = batch(dp)
        rows = slice(comm.rank * ROWS, (comm.rank + 1) * ROWS)
        _, loss = trainer(x[rows], y[rows])
        loss.backward()
        trainer.reduce_expert_gradients()
        grads = {n: p.grad for n, p in model.named_parameters()}
        full = full_state_dict(model, ep_comm)
        norm = trainer.clip_grad_norm_(1e9)
        return grads, [(n, m.first_expert) for n, m in model.named_modules() if isinstance(m, ExpertParallelMoE)], \
            full, norm
    out = ThreadWorld(dp).run(fn)
    mt.manual_seed(0)
    one = nn.GPT(nn.GPTConfig(**CONFIG, moe_groups=dp))
    x, y = batch(dp)
    _, loss = one(x, y)
    loss.backward()
    want = {n: p.grad for n, p in one.named_parameters()}
    total = np.sqrt(sum(float((g * g).sum()) for g in want.values() if g is not None))
    for r, (grads, layers, full, norm) in enumerate(out):
        first = dict(layers)
        for n, g in grads.items():
            prefix, _, rest = n.partition(".experts.")
            if rest:                                 # experts.<local index> -> experts.<global index>
                local, _, leaf = rest.partition(".")
                n = f"{prefix}.experts.{first[prefix] + int(local)}.{leaf}"
            if want[n] is None:
                assert g is None, (r, n)
            else:
                np.testing.assert_allclose(g, want[n], **TOL, err_msg=f"rank {r} {n}")
        assert set(full) == set(want)                # every expert gathered, under one process's names
        for n, value in full.items():
            np.testing.assert_array_equal(value, one.state_dict()[n])
        assert norm == pytest.approx(total, rel=1e-12)


# ---------------------------------------------------------------- the job
MOE = ["--no-progress", "--precision", "fp64", "--n-layer", 2, "--n-embd", 32, "--n-head", 2, "--block-size", 16,
       "--batch-size", 8, "--sample-chars", 4, "--steps", 10, "--moe-experts", 4]
RUNS = {   # name: (options, ranks)
    "ep2_top2_dropless_2ranks": (["--moe-top-k", 2, "--ep", 2], 2),
    "ep2_top1_capacity_2ranks": (["--moe-top-k", 1, "--moe-capacity-factor", 1.0, "--ep", 2], 2),
    "ep2_top2_dropless_4ranks": (["--moe-top-k", 2, "--ep", 2], 4),
    "ep2_top1_capacity_4ranks": (["--moe-top-k", 1, "--moe-capacity-factor", 1.0, "--ep", 2], 4),
    "ep4_top2_capacity_4ranks": (["--moe-top-k", 2, "--moe-capacity-factor", 1.0, "--ep", 4], 4),
    "ep4_top1_dropless_4ranks": (["--moe-top-k", 1, "--ep", 4], 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of RUNS, one mpiexec launch per world size."""
    d = tmp_path_factory.mktemp("ep")
    for n in (2, 4):
        lines = [f"assert gpt.main({[str(a) for a in MOE + options] + ['--json', str(d / (name + '.json'))]!r}) == 0"
                 for name, (options, ranks) in RUNS.items() if ranks == n]
        run_mpi([sys.executable, "-c", "from minitrain.examples import gpt\n" + "\n".join(lines)], n=n, timeout=300)
    return {name: json.loads((d / f"{name}.json").read_text()) for name in RUNS}


def one_process(tmp_path, options, dp):
    out = tmp_path / "one.json"
    options = [o for o in options]
    at = options.index("--ep")
    del options[at:at + 2]
    status, _, err = run(gpt, MOE + options + ["--moe-groups", dp, "--json", out])
    assert status == 0, err
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", RUNS)
def test_the_job_trains_with_one_process_s_losses_and_drops(runs, name, tmp_path):
    options, ranks = RUNS[name]
    report, reference = runs[name], one_process(tmp_path, options, ranks)
    assert report["ep"] == options[-1] and report["dp"] == ranks and len(report["losses"]) == 10
    np.testing.assert_allclose(report["losses"], reference["losses"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(report["moe"]["aux_loss"], reference["moe"]["aux_loss"], rtol=1e-10, atol=0)
    assert report["moe"]["tokens_dropped"] == reference["moe"]["tokens_dropped"]
    assert (report["moe"]["tokens_dropped"] > 0) == ("--moe-capacity-factor" in options)
    assert report["final_val_loss"] == pytest.approx(reference["final_val_loss"], rel=1e-10)
    assert reference["all_to_all_bytes_per_step"] == reference["all_to_all_bytes_formula"] == 0


@pytest.mark.parametrize("name", RUNS)
def test_the_all_to_all_bytes_measured_equal_the_formula_on_every_rank_and_step(runs, name):
    report = runs[name]
    for r in report["ranks"]:
        assert len(r["all_to_all_bytes"]) == 10 and min(r["all_to_all_bytes"]) > 0
        assert r["all_to_all_bytes"] == r["all_to_all_bytes_formula"], r["rank"]
    assert report["all_to_all_bytes_per_step"] == report["all_to_all_bytes_formula"] == max(
        np.mean(r["all_to_all_bytes"]) for r in report["ranks"])


def test_ep1_reports_zero_all_to_all_bytes(tmp_path):
    out = tmp_path / "dp.json"
    argv = [str(a) for a in MOE] + ["--json", str(out)]
    script = f"from minitrain.examples import gpt; assert gpt.main({argv!r}) == 0"
    run_mpi([sys.executable, "-c", script], n=2, timeout=120)
    report = json.loads(out.read_text())
    assert report["ep"] == 1 and report["all_to_all_bytes_per_step"] == report["all_to_all_bytes_formula"] == 0


@pytest.mark.parametrize("extra, needle", [
    (["--ep", 3], "--ep 3 does not divide --moe-experts 4"),
    (["--ep", 2], "--ep 2 does not divide the 1 data-parallel ranks"),
    (["--ep", 4, "--dp", 2], "--ep 4 does not divide the 2 data-parallel ranks"),
    (["--ep", 4, "--dp", 2, "--cp", 2], "--ep 4 does not divide the 2 data-parallel ranks"),
    (["--ep", 2, "--moe-experts", 0], "--ep is not supported with --moe-experts 0"),
    (["--ep", 0], "argument --ep: must be >= 1"),
])
def test_refused_in_one_line(extra, needle):
    refused(gpt, MOE + extra, needle)
