"""The serving job: train the small GPT briefly, then generate for a set of prompts with a KV cache.

    python -m minitrain.examples.generate [--cache none|contiguous|paged] [--block-size 16] [--max-batch 8]
        [--num-prompts 8] [--max-new-tokens N] [--device-memory BYTES] [--preempt swap|recompute]
        [--precision fp64|fp32|fp16|bf16] [--temperature 0] [--top-k K] [--seed 0] [--json PATH]
    mpirun -n 2 python -m minitrain.examples.generate --tp 2 ...

Prompts of mixed lengths (--min/--max-prompt-len, after --shared-prefix common tokens) are cut
from the corpus's validation text; each gets --max-new-tokens tokens (temperature 0: greedy;
sequence i samples from its own generator seeded (seed, i), so every scheme gives the same tokens).
Lengths not given fit the model's context (a checkpoint's may be short): 32 new tokens and prompts of
4-24 tokens where they fit after the shared prefix, else half of the room each.
--device-memory is the teaching device's capacity per rank: parameters plus KV blocks (memory.py's
kv_cache). Memory figures are per rank (the tensor-parallel ranks hold equal shares, tp x in all):
kv_bytes_per_token = 2 · n_layer · (n_embd / tp) · itemsize; kv_bytes_reserved = the largest KV
reservation after any step (contiguous: running sequences x context x kv_bytes_per_token; paged: blocks
held x block_size x kv_bytes_per_token); kv_bytes_used = bytes holding tokens' K/V after the last step
with that reservation (a shared block once; a sequence of n tokens holds n - 1 tokens' K/V when its
last token is sampled, as that token is never fed back); num_sequences = sequences holding KV memory then;
blocks_swapped = blocks copied to host memory by preemption (each comes back once); preemptions =
sequences preempted (swap or recompute); param_bytes = the parameters on one rank.
"""
import gc
import sys
import time

import numpy as np

import minitrain
from minitrain import cli, memory, nn
from minitrain.data import load_text
from minitrain.examples.common import (PRECISIONS, checks_line, init_comm, job_parser, launch_info, mpi_line,
                                       parse_job_args)
from minitrain.examples.gpt_common import adamw, backward_and_clip
from minitrain.examples.options import refuse_unsupported
from minitrain.examples.report import fmt_bytes, write_json
from minitrain.examples.serving_checkpoint import checkpoint_experts, fill_model_options, load_checkpoint
from minitrain.inference import CACHES, LLMEngine


def parse_args(argv=None):
    p = job_parser(__doc__.splitlines()[0])
    p.add_argument("--cache", choices=CACHES, default="paged", help="KV cache scheme")
    p.add_argument("--block-size", type=cli.positive_int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--max-batch", type=cli.positive_int, default=8, help="sequences decoded together at most")
    p.add_argument("--num-prompts", type=cli.positive_int, default=8, help="requests to serve")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=None,
                   help="tokens generated per request (default: 32, or half the context after --shared-prefix "
                   "where 24 + 32 do not fit)")
    p.add_argument("--device-memory", type=cli.positive_int, default=None, metavar="BYTES",
                   help="the teaching device's capacity per rank: parameters plus KV blocks (default: no limit)")
    p.add_argument("--preempt", choices=["swap", "recompute"], default="swap",
                   help="under memory pressure: swap sequences' blocks to host, or drop and recompute them")
    p.add_argument("--precision", choices=["fp32", "fp64", "fp16", "bf16"], default=None,
                   help="fp64 (default; with --checkpoint, the checkpoint's; another: its weights cast to this one): "
                   "every scheme gives the same logits to 1e-10 (fp16 / bf16: 16-bit weights, activations and KV "
                   "cache; LayerNorm's statistics and softmax in fp32, as the gpt job trains them)")
    p.add_argument("--temperature", type=cli.nonneg_float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=cli.positive_int, default=None, help="sample among the K likeliest tokens (default: all of them)")
    p.add_argument("--seed", type=cli.nonneg_int, default=0, help="seeds the model, the prompts and sampling")
    p.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel ranks (run under mpirun -n TP)")
    p.add_argument("--min-prompt-len", type=cli.positive_int, default=None,
                   help="shortest prompt, in tokens (default: 4, or --max-prompt-len where that is less)")
    p.add_argument("--max-prompt-len", type=cli.positive_int, default=None,
                   help="longest prompt, in tokens (default: 24, or what the context leaves beside the new tokens "
                   "where that is less)")
    p.add_argument("--shared-prefix", type=cli.nonneg_int, default=0,
                   help="every prompt starts with the same N tokens; the paged cache shares their blocks")
    p.add_argument("--context", type=cli.positive_int, default=None,
                   help="the model's context (its block_size) (default: 64; with --checkpoint, the checkpoint's)")
    p.add_argument("--n-layer", type=cli.positive_int, default=None,
                   help="transformer blocks (default: 2; with --checkpoint, the checkpoint's)")
    p.add_argument("--n-head", type=cli.positive_int, default=None,
                   help="attention heads (default: 4; with --checkpoint, the checkpoint's)")
    p.add_argument("--n-embd", type=cli.positive_int, default=None,
                   help="embedding width (default: 64; with --checkpoint, the checkpoint's)")
    p.add_argument("--train-steps", type=cli.nonneg_int, default=100, help="brief training before serving (0: none)")
    p.add_argument("--batch-size", type=cli.positive_int, default=8, help="training batch")
    p.add_argument("--lr", type=cli.nonneg_float, default=3e-3, help="learning rate of the brief training")
    p.add_argument("--checkpoint", metavar="DIR", help="load the GPT from the gpt job's checkpoint in DIR instead of training (default: train)")
    p.add_argument("--json", type=cli.output_file, metavar="PATH",
                   help="write the run's figures as JSON (default: none written)")
    args = parse_job_args(p, argv)
    fill_model_options(args)
    refuse_unsupported(p, args, argv, "generate")
    default_lengths(args)
    if args.max_prompt_len < args.min_prompt_len:
        p.error(f"--max-prompt-len {args.max_prompt_len} is below --min-prompt-len {args.min_prompt_len}")
    longest = args.shared_prefix + args.max_prompt_len
    if args.context < 2:
        p.error(f"a context of {args.context} token holds no prompt token beside a new one: it takes at least 2")
    if args.shared_prefix + 1 >= args.context:
        p.error(f"--shared-prefix {args.shared_prefix} leaves no room in the context of {args.context} tokens for "
                f"a prompt's own token and a new one")
    if longest > args.context:
        room = args.context - args.shared_prefix - args.max_new_tokens
        p.error(f"a prompt of {longest} tokens (--shared-prefix {args.shared_prefix} + --max-prompt-len "
                f"{args.max_prompt_len}) is longer than the context of {args.context} tokens"
                + (f": --max-prompt-len {room} fits with --max-new-tokens {args.max_new_tokens}" if room > 0 else
                   f", which --max-new-tokens {args.max_new_tokens} alone fills: give fewer new tokens or a longer "
                   f"--context"))
    text = len(load_text().val)
    if longest >= text:               # make_prompts cuts every prompt's own tokens after the prefix
        p.error(f"prompts are cut from the corpus's validation text of {text:,} tokens: --shared-prefix "
                f"{args.shared_prefix} + --max-prompt-len {args.max_prompt_len} = {longest:,} tokens take at most "
                f"{text - 1:,}")
    if longest + args.max_new_tokens > args.context:
        p.error(f"the longest prompt ({longest} tokens) + --max-new-tokens {args.max_new_tokens} exceed the context "
                f"of {args.context} tokens: at most {args.context - longest} new tokens fit after it")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head}")
    if args.n_head % args.tp:
        p.error(f"--n-head {args.n_head} is not divisible by --tp {args.tp}: each rank takes whole heads")
    return args


def default_lengths(args):
    """Lengths not given, fitted to the context (a checkpoint's may be short): 32 new tokens and prompts up to 24
    where both fit after --shared-prefix, else half of the room each, or beside a length given what it leaves;
    the shortest prompt 4 or the longest. Lengths given are kept (parse_args refuses those that cannot fit)."""
    room = args.context - args.shared_prefix
    if args.max_new_tokens is None:
        if args.max_prompt_len is not None:
            args.max_new_tokens = max(1, min(32, room - args.max_prompt_len))
        else:
            args.max_new_tokens = 32 if 24 + 32 <= room else max(1, room // 2)
    if args.max_prompt_len is None:
        args.max_prompt_len = max(1, min(24, room - args.max_new_tokens))
    if args.min_prompt_len is None:
        args.min_prompt_len = min(4, args.max_prompt_len)


def make_prompts(corpus, args):
    """--num-prompts windows of the validation text, lengths drawn from [min, max], after the shared prefix."""
    rng = np.random.default_rng(args.seed)
    prefix = list(corpus.val[:args.shared_prefix])
    lengths = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, size=args.num_prompts)
    starts = rng.integers(args.shared_prefix, len(corpus.val) - args.max_prompt_len, size=args.num_prompts)
    return [[int(t) for t in prefix + list(corpus.val[s:s + n])] for s, n in zip(starts, lengths)]


def train(model, corpus, args):
    """A brief AdamW run (fp16 / bf16: mixed precision, as the gpt job's); the optimizer's state and the
    gradients are freed before serving."""
    opt = adamw(model.parameters(), args)
    rng = np.random.default_rng(args.seed)
    losses = []
    for _ in range(args.train_steps):
        x, y = corpus.get_batch("train", args.batch_size, args.context, rng)
        _, loss = model(x, y)
        opt.zero_grad()
        backward_and_clip(opt, loss, model.parameters())
        opt.step()
        losses.append(loss.item())
    model.zero_grad(set_to_none=True)
    del opt
    gc.collect()
    return losses


def error(rank, message):
    if rank == 0:
        sys.stderr.write(f"error: {message}\n")
    return 2


def main(argv=None):
    """Run the job on a memory ledger of its own: --device-memory is what this job may place (parameters
    plus KV blocks), whatever else the process (a notebook, a test session) still holds."""
    with memory.use_tracker(memory.MemoryTracker()):
        return _main(parse_args(argv))


def _main(args):
    _, launched = launch_info()
    comm = None
    if launched > 1 or args.tp > 1:
        comm = init_comm(args)
        if comm.size != args.tp:
            return error(comm.rank, f"--tp {args.tp} needs exactly {args.tp} ranks (mpirun -n {args.tp}); this job "
                                    f"has {comm.size}")
    else:
        minitrain.backend.limit_blas_threads()
    rank = comm.rank if comm is not None else 0
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)
    corpus = load_text()
    config = nn.GPTConfig(vocab_size=corpus.vocab_size, block_size=args.context, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd,
                          **checkpoint_experts(args.served))
    gpt = nn.GPT(config).to(PRECISIONS[args.precision])      # 16-bit: the default dtype stays fp32, as in training
    num_params = gpt.num_parameters()
    losses, source = [], "untrained"
    train_start = time.perf_counter()
    # every rank trains the same replica (same seed, same batches): no rank waits past the stall
    # threshold for another's training; tensor_parallelize then broadcasts rank 0's weights
    try:
        if args.checkpoint:
            source = f"checkpoint {load_checkpoint(gpt, args.served)}"
        elif args.train_steps:
            losses = train(gpt, corpus, args)
            source = f"trained {args.train_steps} steps, loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}"
    except ValueError as e:           # the same on every rank: rank 0 says it, every rank exits 2
        return error(rank, e)
    train_seconds = time.perf_counter() - train_start
    model = gpt
    if comm is not None:
        from minitrain.parallel.tensor_parallel import tensor_parallelize
        model = tensor_parallelize(gpt, comm)
        del gpt
        gc.collect()
    param_bytes = memory.snapshot()["params"]
    if args.device_memory is not None and param_bytes > args.device_memory:
        return error(rank, f"the parameters alone take {param_bytes:,} bytes per rank, more than --device-memory "
                           f"{args.device_memory:,}: give at least {param_bytes:,} plus the KV blocks")
    prompts = make_prompts(corpus, args)
    engine = LLMEngine(model, cache=args.cache, block_size=args.block_size, max_batch=args.max_batch,
                       preempt=args.preempt, share_prefix=args.shared_prefix > 0)
    capacity = memory.tracker().capacity
    memory.set_device_capacity(args.device_memory)
    memory.reset_peak()
    try:
        result = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 seed=args.seed)
    except ValueError as e:           # the same on every rank: the decisions depend on sizes only
        return error(rank, e)
    finally:
        memory.set_device_capacity(capacity)
    if comm is not None:
        check_ranks_agree(comm, result.tokens)
    peak = memory.peak()
    if rank != 0:
        return 0
    report(args, config, num_params, source, train_seconds, prompts, result, param_bytes, peak, corpus)
    if comm is not None:
        print(f"MPI: {mpi_line()}; {checks_line(args)}")
    if args.json:
        write_json(args.json, {
            "tokens": result.tokens, "tokens_per_second": result.tokens_per_second,
            "kv_bytes_per_token": result.kv_bytes_per_token, "kv_bytes_reserved": result.kv_bytes_reserved,
            "kv_bytes_used": result.kv_bytes_used, "param_bytes": param_bytes,
            "num_sequences": result.num_sequences, "blocks_swapped": result.blocks_swapped,
            "preemptions": result.preemptions, "n_layer": args.n_layer, "n_embd": args.n_embd,
            # beyond the keys: what the figures above are measured against
            "cache": args.cache, "block_size": args.block_size, "max_batch": args.max_batch, "tp": args.tp,
            "precision": args.precision, "itemsize": np.dtype(PRECISIONS[args.precision]).itemsize,
            "context": args.context, "n_head": args.n_head, "num_params": num_params,
            "num_prompts": args.num_prompts, "prompts": prompts, "prompt_lengths": [len(p) for p in prompts],
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "seed": args.seed, "preempt": args.preempt, "device_memory": args.device_memory,
            "kv_bytes_waste": result.kv_bytes_reserved - result.kv_bytes_used,
            "kv_ledger_bytes": result.kv_ledger_bytes, "kv_ledger_peak": peak["kv_cache"],
            "blocks_swapped_in": result.blocks_swapped_in, "recomputed_tokens": result.recomputed_tokens,
            "shared_tokens": result.shared_tokens, "cow_copies": result.cow_copies, "num_blocks": result.num_blocks,
            "steps": result.steps, "seconds": result.elapsed, "train_losses": losses, "weights": source,
            "mpi_library": mpi_line() if comm is not None else None, "comm_timeout": args.comm_timeout})
    return 0


def check_ranks_agree(comm, tokens):
    """Tensor-parallel ranks sample from the same gathered logits: their tokens must be identical."""
    from minitrain.comm import ring_all_gather
    mine = np.array([t for seq in tokens for t in seq], dtype=np.int64)
    every = ring_all_gather(comm, mine, total=mine.size * comm.size).reshape(comm.size, -1)
    if not (every == every[0]).all():
        raise RuntimeError(f"[rank {comm.rank}] tensor-parallel ranks generated different tokens")


def report(args, config, num_params, source, train_seconds, prompts, r, param_bytes, peak, corpus):
    lengths = [len(p) for p in prompts]
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}" + (
        f", top-k {args.top_k}" if args.top_k else "")
    print(f"GPT {args.n_layer} layers, {args.n_head} heads, n_embd {args.n_embd}, context {args.context}: "
          f"{num_params:,} parameters, {args.precision}; {source} ({train_seconds:.1f} s)")
    print(f"served {args.num_prompts} prompts of {min(lengths)}-{max(lengths)} tokens"
          + (f" (first {args.shared_prefix} shared)" if args.shared_prefix else "")
          + f", {args.max_new_tokens} new tokens each, {mode}; cache {args.cache}"
          + (f" (blocks of {args.block_size})" if args.cache == "paged" else "")
          + f", max batch {args.max_batch}, tp {args.tp}")
    total = sum(len(t) for t in r.tokens)
    print(f"throughput: {r.tokens_per_second:,.1f} tokens/s ({total} tokens in {r.elapsed:.3f} s, {r.steps} steps)")
    if args.cache != "none":
        waste = r.kv_bytes_reserved - r.kv_bytes_used
        print(f"KV memory per rank, {r.kv_bytes_per_token:,} bytes per token (2 x {args.n_layer} layers x "
              f"{args.n_embd // args.tp} x {np.dtype(PRECISIONS[args.precision]).itemsize} bytes), when the "
              f"reservation peaked ({r.num_sequences} sequences):")
        print(f"  reserved {fmt_bytes(r.kv_bytes_reserved)} ({r.kv_bytes_reserved:,} B), used "
              f"{fmt_bytes(r.kv_bytes_used)} ({r.kv_bytes_used:,} B), waste {fmt_bytes(waste)} "
              f"({waste / max(r.kv_bytes_reserved, 1):.1%})")
        if args.cache == "contiguous":
            print(f"  contiguous: each sequence reserves the context ({args.context} tokens), so it wastes "
                  f"(context - length) tokens")
        else:
            bound = r.num_sequences * (args.block_size - 1) * r.kv_bytes_per_token
            print(f"  paged: under one block per sequence, waste <= {r.num_sequences} x ({args.block_size} - 1) "
                  f"tokens = {bound:,} B")
        print(f"  memory ledger (kv_cache) at that step: {r.kv_ledger_bytes:,} B; its peak over the run: "
              f"{peak['kv_cache']:,} B")
    print(f"preemptions {r.preemptions} ({args.preempt}); blocks swapped to host {r.blocks_swapped}, back "
          f"{r.blocks_swapped_in}; recomputed tokens {r.recomputed_tokens}; shared prefix tokens "
          f"{r.shared_tokens}, copy-on-write copies {r.cow_copies}")
    device = f"of {fmt_bytes(args.device_memory)}" if args.device_memory else "(no capacity set)"
    print(f"device memory per rank {device}: params {fmt_bytes(param_bytes)} + KV peak "
          f"{fmt_bytes(peak['kv_cache'])} = peak {fmt_bytes(peak['total'])}")
    print(f"sample: {corpus.decode(prompts[0])!r} -> {corpus.decode(r.tokens[0])!r}")


if __name__ == "__main__":
    sys.exit(main())
