"""The time model's counts against the engine, in one process (plan/work.py); the jobs' step timer; the BLAS
threads a job takes; the ops' costs when a machine has no measured table."""
import numpy as np
import pytest

import minitrain
from minitrain import backend, nn, optim
from minitrain.autograd.function import nodes_recorded
from minitrain.examples.report import StepTimer
from minitrain.parallel import checkpoint_sequential
from minitrain.plan import GPT, MLP, Layout, load_machine
from minitrain.plan.ops import PASSES, op_fit, op_seconds
from minitrain.plan.counts import predict_nodes


def _recorded(step):
    before = nodes_recorded()
    step()
    return nodes_recorded() - before - 1


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_the_gpts_graph_nodes_are_the_planners_count(recompute):
    """nn.GPT's forward and backward record exactly the nodes plan/work.py counts (recomputation records
    the recomputed part again in backward)."""
    minitrain.manual_seed(0)
    gpt = nn.GPT(nn.GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16, recompute=recompute))
    idx = np.random.default_rng(0).integers(0, 11, (2, 8))

    def step():
        loss = gpt(idx, idx)[1]
        gpt.zero_grad()
        loss.backward()
    layout = Layout(batch_size=2, recompute=recompute or "none")
    assert _recorded(step) == predict_nodes(GPT(11, 8, 3, 2, 16), layout)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_an_moe_gpts_graph_nodes_are_the_planners_count(recompute):
    """An MoE layer's nodes (plan/experts.py): the router, the rows split by expert and joined, each expert's
    three, combine's six, the aux loss's five and the loss adding it (every expert given rows, as the planner's
    balanced routing has it; full recomputation: the aux loss's scaler too). 4 experts, top-2, every other layer."""
    minitrain.manual_seed(0)
    config = dict(vocab_size=11, block_size=8, n_layer=4, n_head=2, n_embd=16, moe_experts=4, moe_every=2)
    gpt = nn.GPT(nn.GPTConfig(**config, recompute=recompute))
    idx = np.random.default_rng(0).integers(0, 11, (4, 8))

    def step():
        loss = gpt(idx, idx)[1]
        gpt.zero_grad()
        loss.backward()
    loads = []
    for block in gpt.h:
        if hasattr(block.mlp, "num_experts"):
            block.mlp.register_forward_hook(lambda m, a, o: loads.append(min(m.stats["load"].tolist())))
    layout = Layout(batch_size=4, recompute=recompute or "none")
    assert _recorded(step) == predict_nodes(GPT(11, 8, 4, 2, 16, moe_experts=4, moe_every=2), layout)
    assert min(loads) > 0                         # (the case the count is for: no expert without rows)


@pytest.mark.parametrize("sizes, recompute, precision", [
    ((64, 32, 32, 10), "none", "fp32"), ((64, 32, 32, 32, 32, 10), "full", "fp32"), ((64, 32, 10), "none", "fp16")])
def test_the_mlps_graph_nodes_are_the_planners_count(sizes, recompute, precision):
    """The mlp job's step on nn.MLP: its Linear / ReLU nodes, the loss, the casts of mixed precision and
    fp16's loss scaling, checkpoint_sequential's segments."""
    dtype = {"fp32": np.float32, "fp16": np.float16}[precision]
    model = nn.MLP(list(sizes)).to(dtype)
    x, y = minitrain.Tensor(np.ones((4, sizes[0]), np.float32)), np.zeros(4, np.int64)

    def step():
        inp = x.to(dtype)
        out = checkpoint_sequential(model, None, inp) if recompute == "full" else model(inp)
        loss = nn.functional.cross_entropy(out.float() if precision == "fp16" else out, y)
        model.zero_grad()
        (loss * 1024.0 if precision == "fp16" else loss).backward()
    layout = Layout(batch_size=4, recompute=recompute, precision=precision)
    assert _recorded(step) == predict_nodes(MLP(sizes), layout)


def test_step_timer_counts_the_nodes_and_leaves_short_batches_out():
    minitrain.manual_seed(0)
    model = nn.MLP([4, 8, 2])
    opt = optim.SGD(model.parameters(), lr=0.1)
    timer = StepTimer()
    for rows in (4, 4, 3):
        with timer(counted=rows == 4):
            loss = nn.functional.cross_entropy(model(minitrain.Tensor(np.ones((rows, 4), np.float32))), np.zeros(rows, np.int64))
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = timer.summary()
    assert len(timer.steps) == 2 and summary["step_autograd_nodes"] == 4      # Linear, ReLU, Linear, loss
    assert summary["step_busy_cpu_time_min_s"] <= summary["step_cpu_time_min_s"]
    assert summary["step_waiting_cpu_time_s"] == 0.0                          # no peer: nothing to wait for
    assert summary["anchor_cpu_time_s"] > 0 and summary["step_busy_per_anchor"] > 0


def test_step_timer_gives_the_wall_clock_in_anchors_of_the_anchored_steps():
    """step_wall_per_anchor: the median over the anchored steady steps (the first WARMUP_STEPS left out) of
    wall / anchor, paired: a step that sleeps 20 ms (off the CPU: no busy time) reads 20 ms over its own
    anchor's CPU time."""
    import time
    from minitrain.examples.step_timer import WARMUP_STEPS
    timer = StepTimer()
    for _ in range(WARMUP_STEPS + 3):
        with timer:
            time.sleep(0.02)
    summary = timer.summary()
    pairs = [timer.steps[i][0] / t for i, t in timer.anchors if i >= WARMUP_STEPS]
    assert len(pairs) == 3 and summary["step_wall_per_anchor"] == pytest.approx(float(np.median(pairs)))
    assert summary["step_wall_per_anchor"] > 10 * summary["step_busy_per_anchor"]     # the sleep is wall, not busy
    assert 0.02 / max(t for _, t in timer.anchors) <= summary["step_wall_per_anchor"]


def _wait_for_a_late_peer(comm):
    """Rank 1 sends 30 ms late; rank 0's step is one receive: its CPU is polling, not work."""
    import time
    timer, buf = StepTimer(), np.zeros(4)
    timer.anchoring = False
    for _ in range(2):
        with timer:
            if comm.rank == 0:
                comm.recv(buf, 1)
            else:
                time.sleep(0.03)
                comm.send(np.ones(4), 0)
    return timer.summary()


def test_step_timer_leaves_polling_for_a_peer_out_of_the_steps_busy_cpu():
    from minitrain.comm import ThreadWorld
    waiter = ThreadWorld(2).run(_wait_for_a_late_peer)[0]
    assert waiter["step_time_min_s"] >= 0.025
    # the ~10 ms it polled (yielding the core) before it slept is waiting, not busy: how much CPU that
    # polling gets depends on the machine's other work (0.6 ms beside a test worker and two spinners)
    assert waiter["step_waiting_cpu_time_s"] > 0
    assert waiter["step_busy_cpu_time_min_s"] < 0.25 * waiter["step_cpu_time_min_s"]


def test_the_blas_threads_reported_are_numpys_not_a_library_loaded_later():
    """The digits loader imports scikit-learn after a job caps its threads, loading SciPy's own BLAS at its
    default; the job reports (and the planner predicts for) the BLAS NumPy's products run on."""
    import os
    import subprocess
    import sys
    code = ("from minitrain import backend; backend.limit_blas_threads(1); import sklearn.datasets; "
            "print(backend.blas_threads())")
    env = {k: v for k, v in os.environ.items() if k not in backend.BLAS_THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "1", out.stdout + out.stderr


def test_a_job_keeps_to_the_blas_threads_the_environment_asks_for():
    assert backend.default_blas_threads(ranks=1, cores=2, environ={}) == 2
    assert backend.default_blas_threads(ranks=2, cores=2, environ={}) == 1
    assert backend.default_blas_threads(ranks=1, cores=2, environ={"OMP_NUM_THREADS": "1"}) == 1
    assert backend.default_blas_threads(ranks=1, cores=8, environ={"OPENBLAS_NUM_THREADS": "3"}) == 3
    assert backend.default_blas_threads(ranks=1, cores=2, environ={"OMP_NUM_THREADS": ""}) == 2


def test_a_rank_bound_to_one_core_takes_one_blas_thread(monkeypatch):
    from minitrain._backend import host
    monkeypatch.setattr(host.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {3}, raising=False)   # mpirun's binding
    assert backend.default_blas_threads(ranks=2, environ={}) == 1
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert backend.default_blas_threads(ranks=2, environ={}) == 8


def test_an_op_without_a_measured_cost_is_its_passes_over_memory():
    """The datasheet machine (no ops table): each pass at the elementwise rate, one launch per pass."""
    a100 = load_machine("a100-80gb")
    per = a100["elementwise_s_per_element"]["float32"]
    call, element = op_fit(a100, "layer_norm", "float32")
    assert element == pytest.approx(5 * per["simple"] + 2 * per["reduce"])
    assert call == pytest.approx(7 * a100["numpy_call_s"])
    assert op_seconds(a100, "layer_norm", 1000, 2, "float32") == pytest.approx(2 * call + 1000 * element)
    measured = {**a100, "ops": {"float32": {"layer_norm": [1e-5, 2e-9]}}}
    assert op_seconds(measured, "layer_norm", 1000, 2, "float32") == pytest.approx(2e-5 + 2e-6)
    assert set(PASSES) >= {"layer_norm", "gelu.backward", "softmax", "adam", "cross_entropy"}


def test_a_recomputed_forward_pays_its_python_without_recording_it():
    """Under recomputation a segment's first forward runs its modules and ops under no_grad: no node recorded
    (one checkpoint node instead) but their Python run all the same, priced as a node's (plan/costs.Costs)."""
    from minitrain.plan import load_machine
    from minitrain.plan.models import GPT, MLP
    from minitrain.plan.costs import Costs
    from minitrain.plan.work import gpt_block_work, mlp_layer_work, mlp_recompute
    machine = load_machine("cpu-2core")
    costs = Costs(machine, "fp32", 1, 1.0, fresh=False)
    model = GPT(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=16)
    plain, _ = gpt_block_work(model, Layout(batch_size=2), 2)
    for recompute, unrecorded in (("full", plain.nodes), ("selective", 4)):      # the attention core: 4 nodes
        fwd, _ = gpt_block_work(model, Layout(batch_size=2, recompute=recompute), 2)
        assert (fwd.unrecorded, fwd.nodes + fwd.unrecorded) == (unrecorded, plain.nodes + 1)
        assert costs.seconds(fwd) - costs.seconds(plain) == pytest.approx(machine["autograd_node_s"], rel=1e-9)
    layers = mlp_layer_work(MLP((8, 8, 8, 8, 8, 4)), Layout(batch_size=4), 4)
    redone = mlp_recompute(layers, Layout(batch_size=4, recompute="full"))
    assert len(layers) == 9                           # 3 segments of 3 modules (checkpoint_sequential's); the
    assert [f.nodes + f.unrecorded for f, _ in redone] == [f.nodes + (j in (0, 3)) for j, (f, _) in
                                                           enumerate(layers)]   # last one not recomputed
    assert [f.unrecorded for f, _ in redone] == [f.nodes if j < 6 else 0 for j, (f, _) in enumerate(layers)]


@pytest.mark.parametrize("options, moe", [("--n-layer 3 --n-embd 32 --block-size 16", 0),
                                          ("--n-layer 2 --n-embd 32 --block-size 16 --moe-experts 4", 4)])
def test_the_planner_counts_the_gpts_parameter_tensors_one_by_one(options, moe):
    """The optimizer, the clip and the accumulation of the gradients pay per tensor: the planner's tensors per
    layer are the model's, in its order (ln weight and bias apart: 15 tensors on gpt --pp 2's last stage, not 8)."""
    from minitrain import nn
    from minitrain.plan.counts import _layer_sizes
    from minitrain.plan.validate import planned
    model, layout = planned("gpt", 1, options)
    gpt = nn.GPT(nn.GPTConfig(vocab_size=model.vocab_size, block_size=model.block_size, n_layer=model.n_layer,
                              n_head=4, n_embd=model.n_embd, moe_experts=moe))
    assert [x for layer in _layer_sizes(model, layout) for x in layer] == [q.size for q in gpt.parameters()]


def _deferred_work(loss, params):
    """What a zero-bubble W computes for ``loss``'s backward, from the engine's own queue of deferred nodes:
    the weight gradients' matmul FLOPs (a Linear's 2·rows·out·in), the elements its sums reduce (a bias's,
    a LayerNorm's weight and bias), the rows the embeddings scatter, and the parameters given a gradient."""
    from collections import Counter
    from minitrain.autograd.deferred import defer_weight_grads
    with defer_weight_grads(params) as w:
        loss.backward()
    done = Counter()
    for node, grad, positions in w._queue:
        kind, weights = type(node).__name__, [node.parents[i] for i in positions]
        done["leaves"] += len(weights)
        if kind == "Linear":
            done["flops"] += 2 * grad.size * weights[0].shape[1]
            done["sum_leading"] += grad.size * (len(weights) - 1)    # its bias
        elif kind == "LayerNorm":
            done["sum_leading"] += grad.size * len(weights)
        else:
            assert kind == "Embedding", kind
            done["embedding.backward"] += grad.size
    return done


def _planned_weight_work(works):
    """The same from the planner's backward Work, its W part (Work.w)."""
    from collections import Counter
    planned = Counter()
    for w in (b.w for _, b in works if b.w is not None):
        planned["leaves"] += w.leaves
        planned["flops"] += sum(2 * m * k * n * batch for m, k, n, batch in w.mm)
        for (name, _), (elements, _) in w.ops.items():
            planned[name] += elements
    return planned


def test_a_zero_bubble_w_is_the_work_the_planner_counts_as_the_weights_gradients():
    """Zero-bubble schedules run a backward's weight gradients apart (W, autograd/deferred.py): the planner's W
    part of each layer's backward (the weights' products, the biases' and LayerNorms' sums, the embeddings'
    scatters, the parameters given a gradient) is exactly what the engine defers, the GPT's and the MLP's
    (whose first Linear makes no input gradient, so W is all its backward)."""
    from minitrain.plan.work import gpt_block_work, gpt_ends_work, mlp_layer_work
    gpt = nn.GPT(nn.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8))
    x = np.arange(32).reshape(4, 8) % 16
    model, one = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8), Layout(batch_size=4)
    emb, head = gpt_ends_work(model, one, 4)
    block = gpt_block_work(model, one, 4)
    assert _deferred_work(gpt(x, x)[1], list(gpt.parameters())) == _planned_weight_work([emb, block, block, head])
    mlp = nn.MLP([6, 5, 4, 3])
    rows = minitrain.Tensor(np.ones((4, 6), np.float32))
    loss = nn.functional.cross_entropy(mlp(rows), np.zeros(4, np.int64))
    works = mlp_layer_work(MLP((6, 5, 4, 3)), one, 4)
    assert _deferred_work(loss, list(mlp.parameters())) == _planned_weight_work(works)
    backward = sum(2 * m * k * n * batch for _, b in works for m, k, n, batch in b.mm)   # B: the rest, once
    assert backward - _planned_weight_work(works)["flops"] == 2 * 4 * (5 * 4 + 4 * 3)   # (the input gradients)
