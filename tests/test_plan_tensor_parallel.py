"""The planner's tensor-parallel communication against what GPT3D sends, exactly (bytes and calls, never
time): per micro-batch the f / g collectives of each layer (plan/layer_costs.tp_collectives; with sequence
parallelism AllGatherLinear's backward gathers its input again), and sequence parallelism's step-end sum of
the replicated parameters' gradients over tp (plan/time.sp_step_end_collectives)."""
from collections import Counter

import numpy as np
import pytest

import minitrain as mt
from minitrain import nn
from minitrain.comm import ThreadWorld
from minitrain.parallel.gpt_3d import GPT3D
from minitrain.plan import GPT, Layout
from minitrain.plan.layer_costs import tp_collectives
from minitrain.plan.time import sp_step_end_collectives

SENT = {"ring_all_reduce": lambda t: 2 * (t - 1) / t, "ring_all_gather": lambda t: (t - 1) / t,
        "ring_reduce_scatter": lambda t: (t - 1) / t}          # a ring's bytes sent per rank, of the array's


def _planned(config):
    return GPT(**{k: v for k, v in config.items() if k not in ("moe_groups", "recompute")})


@pytest.mark.parametrize("sp, recompute, experts", [(False, None, 0), (True, None, 0), (True, "full", 0),
                                                    (False, "full", 0), (False, None, 4)])
def test_a_tensor_parallel_step_sends_the_collectives_the_planner_prices(sp, recompute, experts):
    """One step of GPT3D over tp = 2 (fp64, 2 layers, the second an MoE layer where ``experts``): every
    collective on the tp communicator, by name, its calls and bytes sent, is what the planner lists for the
    embedding, each block (an MoE block: the attention's half) and the head, plus SP's step-end all-reduce
    (with experts under SP, the routing's collectives and the used-flags: the test below)."""
    config = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, moe_experts=experts, moe_every=2,
                  recompute=recompute)
    x = np.arange(32).reshape(4, 8) % 16

    def step(comm):
        mt.set_default_dtype(np.float64)
        model = GPT3D(nn.GPT(nn.GPTConfig(**config)), comm, tp=2, sequence_parallel=sp)
        tp = model.mesh.comm("tp")
        tp.stats.reset()
        model.train_step(x, x)
        return {name: (e["calls"], e["bytes_sent"]) for name, e in tp.stats.by_name.items() if e["calls"]}
    model = _planned(config)
    layout = Layout(world=2, tp=2, sequence_parallel=sp, recompute=recompute or "none", batch_size=4,
                    precision="fp64")
    emb, block, head = tp_collectives(model, layout, 4)
    moe = tuple(calls[:len(calls) // 2] for calls in block)    # (c_attn, c_proj) of (c_attn, c_proj, c_fc, c_proj)
    layers = [emb, block, moe if experts else block, head]
    calls = [c for layer in layers for half in layer for c in half]
    calls += sp_step_end_collectives(model, layout)[0] if sp else []
    planned = Counter()
    for name, nbytes, t in calls:
        planned[name, "calls"] += 1
        planned[name, "bytes"] += SENT[name](t) * nbytes
    for sent in ThreadWorld(2).run(step):
        assert {name: (planned[name, "calls"], planned[name, "bytes"]) for name, _ in planned} == sent


@pytest.mark.parametrize("pp, ep, experts", [(1, 1, 0), (2, 1, 0), (1, 1, 4), (2, 1, 4), (1, 2, 4)])
def test_sequence_parallel_step_end_all_reduce_sends_the_bytes_the_planner_prices(pp, ep, experts):
    """Under sequence parallelism each tp rank's replicated parameters (wpe, LayerNorms, row-parallel biases,
    an MoE layer's router and experts) get partial gradients, summed over tp once a step: per pipeline stage,
    the bytes GPT3D's all_reduce_replicated_grads sends (with experts after a float64 used-flag per replicated
    tensor of the model) are the ones the planner's step-end collectives price (a ring: 2(t-1)/t of them)."""
    dp, world = ep, 2 * pp * ep
    config = dict(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=8, moe_experts=experts, moe_groups=dp)
    x = np.arange(32).reshape(4, 8) % 16

    def step(comm):
        mt.set_default_dtype(np.float64)
        model = GPT3D(nn.GPT(nn.GPTConfig(**config)), comm, dp=dp, pp=pp, tp=2, sequence_parallel=True, ep=ep)
        model.train_step(x, x)
        tp = model.mesh.comm("tp")
        tp.stats.reset()
        model.model.all_reduce_replicated_grads()         # what train_step ran at its end, its bytes alone
        sent = {name: e["bytes_sent"] for name, e in tp.stats.by_name.items() if e["calls"]}
        return model.mesh.coordinate("pp"), sent
    layout = Layout(world=world, dp=dp, pp=pp, tp=2, ep=ep, sequence_parallel=True, batch_size=4, precision="fp64")
    planned = sp_step_end_collectives(_planned(config), layout)
    for stage, sent in ThreadWorld(world).run(step):
        *flags, (_, grads, t) = planned[stage]
        assert sent.pop("ring_all_reduce") == 2 * (t - 1) / t * grads
        assert sent == ({"recursive_doubling_all_reduce": flags[0][1]} if experts else {})   # 2 ranks: one exchange
