"""The GPT job under tensor parallelism: ``mpirun -n N python -m minitrain.examples.gpt --tp N
[--sequence-parallel] [--dropout P] [--recompute full|selective] [--offload-activations]``.

Every rank builds the same GPT, ``tensor_parallelize`` keeps its shard of every matrix, and all
ranks train on the same batches (tensor parallelism splits the model, not the data). Rank 0
prints the loss, the bytes each rank sent per step and per transformer layer (measured with hooks
around each block's forward) beside Megatron's count (2 all-reduces of B·T·C forward: 2 x
2(t-1)/t·B·T·C·bytes), memory per rank, and a sample (the gathered model, on rank 0).
"""
import sys
import time

import numpy as np
from tqdm import tqdm

import minitrain
from minitrain import comm as mtcomm
from minitrain import memory, nn, optim
from minitrain.data import load_text
from minitrain.examples.common import fmt_bytes, persistent_memory, write_json
from minitrain.parallel import offload_activations
from minitrain.parallel.tensor_parallel import tensor_parallelize


def main_tensor_parallel(args, launched):
    comm = mtcomm.init()
    t, rank = comm.size, comm.rank
    if t != args.tp:
        if rank == 0:
            sys.stderr.write(f"error: --tp {args.tp} needs exactly {args.tp} ranks (mpirun -n {args.tp}); "
                             f"this job has {t}\n")
        return 2
    minitrain.manual_seed(args.seed)
    corpus = load_text()
    config = nn.GPTConfig(vocab_size=corpus.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                          recompute=None if args.recompute == "none" else args.recompute)
    gpt = nn.GPT(config)
    psi = gpt.num_parameters()
    try:
        model = tensor_parallelize(gpt, comm, sequence_parallel=args.sequence_parallel)
    except ValueError as e:
        if rank == 0:
            sys.stderr.write(f"error: {e}\n")
        return 2
    del gpt
    opt = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)                   # the same batches on every rank

    layer_bytes = []
    for block in model.h:                                    # bytes sent inside each block's forward
        block.register_forward_pre_hook(lambda m, a: layer_bytes.append(-comm.stats.bytes_sent))
        block.register_forward_hook(lambda m, a, o: layer_bytes.__setitem__(-1, layer_bytes[-1] + comm.stats.bytes_sent))

    def val_loss(batches=4):
        model.eval()                                         # no dropout
        with minitrain.no_grad():
            loss = float(np.mean([model(*corpus.get_batch("val", args.batch_size, args.block_size, rng))[1].item()
                                  for _ in range(batches)]))
        model.train()
        return loss
    initial_val = val_loss()
    memory.reset_peak()
    losses = []
    bar = tqdm(range(args.steps), disable=args.no_progress or rank != 0, file=sys.stdout,
               desc=f"tp {t}" + (" + sp" if args.sequence_parallel else ""), unit="step")
    comm.barrier()
    sent_before = comm.stats.bytes_sent
    start = time.perf_counter()
    offload = offload_activations() if args.offload_activations else None
    for step in bar:
        x, y = corpus.get_batch("train", args.batch_size, args.block_size, rng)
        layer_bytes.clear()
        if offload is not None:
            with offload:
                _, loss = model(x, y)
        else:
            _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        persistent = persistent_memory()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    sent_per_step = (comm.stats.bytes_sent - sent_before) / args.steps
    final_val = val_loss()
    peak = memory.peak()
    row = np.array([sent_per_step, float(np.mean(layer_bytes)), *(persistent[c] for c in ("params", "grads",
                    "optimizer_state")), peak["activations"], peak["total"]], np.float64)
    table = mtcomm.ring_all_gather(comm, row, total=row.size * t).reshape(t, -1)
    state = model.full_state_dict()
    if rank != 0:
        return 0
    B, T, C = args.batch_size, args.block_size, args.n_embd
    itemsize = np.dtype(minitrain.get_default_dtype()).itemsize
    formula = 2 * 2 * (t - 1) / t * B * T * C * itemsize      # 2 all-reduces (or RS + AG pairs) forward
    head, tail = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"GPT {psi:,} parameters, tensor-parallel over {t} ranks"
          + (" with sequence parallelism" if args.sequence_parallel else ""))
    print(f"dropout {args.dropout}, recompute: {args.recompute}"
          + (", activations offloaded" if args.offload_activations else ""))
    print(f"train loss {head:.3f} (first 10 steps) -> {tail:.3f} (last 10); val loss {initial_val:.3f} -> "
          f"{final_val:.3f}; {args.steps / elapsed:.1f} steps/s")
    print(f"\n{'rank':>4} {'sent/step':>10} {'fwd/layer':>10} {'formula':>10} {'params':>10} {'grads':>10} "
          f"{'optimizer':>10} {'peak act.':>10} {'peak':>10}")
    for r, v in enumerate(table):
        print(f"{r:>4} {fmt_bytes(v[0]):>10} {fmt_bytes(v[1]):>10} {fmt_bytes(formula):>10} "
              + " ".join(f"{fmt_bytes(x):>10}" for x in v[2:]))
    print("(fwd/layer: bytes sent inside one transformer block's forward; formula: Megatron's 2 all-reduces of\n"
          " B·T·C, i.e. 2 x 2(t-1)/t·B·T·C·bytes; backward sends the same again)")
    full = nn.GPT(config)
    full.load_state_dict(state)
    sample = full.generate(corpus.encode("def ")[None, :], args.sample_chars, temperature=0.8, top_k=20,
                           rng=np.random.default_rng(args.seed))
    print("sample:\n" + corpus.decode(sample[0]))
    if args.json:
        write_json(args.json, {
            "world_size": t, "strategy": "tp+sp" if args.sequence_parallel else "tp", "tp": t,
            "dropout": args.dropout, "recompute": args.recompute,
            "num_params": psi, "initial_val_loss": initial_val, "final_val_loss": final_val, "final_loss": float(tail),
            "steps_per_second": args.steps / elapsed, "tokens_per_second": args.steps * B * T / elapsed,
            "bytes_per_step": float(table[0, 0]), "bytes_per_layer_forward": float(table[0, 1]),
            "bytes_per_layer_forward_formula": formula,
            "ranks": [{"rank": r, "bytes_sent": float(v[0]) * args.steps,
                       "memory": {"persistent": dict(zip(("params", "grads", "optimizer_state"), map(int, v[2:5]))),
                                  "peak": {"activations": int(v[5]), "total": int(v[6])}}}
                      for r, v in enumerate(table)]})
    return 0
