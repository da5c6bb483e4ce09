"""KV caches measured: memory waste and throughput against the no-cache baseline.

    python scripts/bench_inference.py [--n-layer 4 --n-embd 128 --context 256 --num-prompts 16]
        [--batches 1 2 4 8 16] [--block-sizes 1 4 16 64] [--json PATH]

1. Waste, every prompt running at once: reserved vs used KV bytes when the reservation peaked, beside
   the formulas: contiguous wastes sum(context - length) tokens, paged at most (block_size - 1) per
   sequence (exactly the empty slots of each last block).
2. Throughput (generated tokens/s, median of --repeats) vs the max batch (--batches) for no cache, contiguous and
   paged, with the ratio to no cache at the same batch: the KV cache's speed-up.
3. The paged read: one layer's write + gather through the block table vs the contiguous cache's read,
   for a batch of sequences of the prompts' lengths (the price of the simple gather kernel).
4. Preemption under a device that holds a third of the sequences' blocks: swap vs recompute.
Random weights (speed and memory do not depend on them); the tokens of every scheme are compared.
"""
import argparse
import json
import time

import numpy as np

import minitrain
from minitrain import cli, memory, nn
from minitrain.inference import BlockPool, ContiguousKVCache, LLMEngine, PagedKVCache


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--n-layer", type=cli.positive_int, default=4, help="transformer blocks")
    p.add_argument("--n-head", type=cli.positive_int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=cli.positive_int, default=128, help="embedding width")
    p.add_argument("--context", type=cli.positive_int, default=256, help="the model's context, in tokens")
    p.add_argument("--vocab", type=cli.positive_int, default=96, help="vocabulary size")
    p.add_argument("--num-prompts", type=cli.positive_int, default=16, help="requests served")
    p.add_argument("--min-prompt-len", type=cli.positive_int, default=8, help="shortest prompt, in tokens")
    p.add_argument("--max-prompt-len", type=cli.positive_int, default=64, help="longest prompt, in tokens")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=32, help="tokens generated per request")
    p.add_argument("--batches", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[1, 2, 4, 8, 16],
                   help="the engine's max batch (sequences decoded together) in each throughput run")
    p.add_argument("--block-sizes", type=cli.positive_int, nargs="+", action=cli.Distinct, default=[1, 4, 16, 64],
                   help="paged block sizes of the waste runs")
    p.add_argument("--block-size", type=cli.positive_int, default=16, help="paged block size in the throughput runs")
    p.add_argument("--precision", choices=["fp32", "fp64"], default="fp32", help="the model's dtype")
    p.add_argument("--repeats", type=cli.positive_int, default=2, help="throughput runs per point (the median is kept)")
    p.add_argument("--seed", type=cli.nonneg_int, default=0, help="seeds the weights and the prompts")
    p.add_argument("--threads", type=cli.positive_int, default=None, help="BLAS threads (default: cores / ranks)")
    p.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    args = p.parse_args()
    if args.max_prompt_len < args.min_prompt_len:
        p.error(f"argument --max-prompt-len: {args.max_prompt_len} is below --min-prompt-len {args.min_prompt_len}")
    if args.n_embd % args.n_head:
        p.error(f"argument --n-embd: {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.max_prompt_len + args.max_new_tokens > args.context:
        p.error(f"the longest prompt (--max-prompt-len {args.max_prompt_len}) + --max-new-tokens "
                f"{args.max_new_tokens} exceed --context {args.context}")
    return args


def timed(engine, prompts, args, repeats):
    """The result of the last run and the median tokens/s over ``repeats`` runs."""
    speeds = []
    for _ in range(repeats):
        result = engine.generate(prompts, args.max_new_tokens)
        speeds.append(result.tokens_per_second)
    return result, float(np.median(speeds))


def waste_table(model, prompts, args, out):
    n = len(prompts)
    lengths = [len(p) for p in prompts]
    print(f"\n1. KV memory when the reservation peaked, {n} sequences at once, prompts {min(lengths)}-{max(lengths)} "
          f"tokens + {args.max_new_tokens} new, context {args.context}")
    print(f"{'scheme':<14}{'reserved':>12}{'used':>12}{'waste':>8}   formula for the waste")
    rows = [("contiguous", dict(cache="contiguous"))] + [(f"paged bs={b}", dict(cache="paged", block_size=b))
                                                         for b in args.block_sizes]
    for name, kwargs in rows:
        r = LLMEngine(model, max_batch=n, **kwargs).generate(prompts, args.max_new_tokens)
        waste = r.kv_bytes_reserved - r.kv_bytes_used
        per = r.kv_bytes_per_token
        if kwargs["cache"] == "contiguous":      # at the last step: prompt + new - 1 tokens each
            formula = sum(args.context - (m + args.max_new_tokens - 1) for m in lengths) * per
            note = f"sum(context - length) = {formula / per:,.0f} tokens"
        else:
            b = kwargs["block_size"]
            formula = sum(-(-(m + args.max_new_tokens - 1) // b) * b - (m + args.max_new_tokens - 1)
                          for m in lengths) * per
            note = f"last blocks' empty slots = {formula / per:,.0f} tokens <= n(bs-1) = {n * (b - 1)}"
        assert waste == formula, (name, waste, formula)
        print(f"{name:<14}{r.kv_bytes_reserved / 2**20:>10.2f}Mi{r.kv_bytes_used / 2**20:>10.2f}Mi"
              f"{waste / r.kv_bytes_reserved:>8.1%}   {note}")
        out["waste"][name] = {"reserved": r.kv_bytes_reserved, "used": r.kv_bytes_used, "formula": formula}
    contiguous, paged = out["waste"]["contiguous"], out["waste"].get(f"paged bs={args.block_size}")
    if paged:
        print(f"paged bs={args.block_size} reserves {paged['reserved'] / contiguous['reserved']:.2f}x the contiguous "
              f"cache's bytes, so {contiguous['reserved'] / paged['reserved']:.1f}x as many sequences fit")


def throughput_table(model, prompts, args, out):
    print(f"\n2. Throughput, generated tokens/s (median of {args.repeats}); ratio: to no cache at the same batch")
    print(f"{'max batch':>9}" + "".join(f"{s:>22}" for s in ("none", "contiguous", f"paged bs={args.block_size}")))
    for batch in args.batches:
        row, tokens = {}, {}
        for scheme in ("none", "contiguous", "paged"):
            engine = LLMEngine(model, cache=scheme, block_size=args.block_size, max_batch=batch)
            result, row[scheme] = timed(engine, prompts, args, args.repeats)
            tokens[scheme] = result.tokens
        cells = [f"{row[s]:>12,.0f} ({row[s] / row['none']:5.1f}x)" for s in row]
        print(f"{batch:>9}" + "".join(f"{c:>22}" for c in cells)
              + ("" if tokens["none"] == tokens["contiguous"] == tokens["paged"] else "   (tokens differ: near-ties)"))
        out["throughput"][batch] = row
    best = {s: max(out["throughput"][b][s] for b in args.batches) for s in ("none", "contiguous", "paged")}
    print(f"best over batch sizes: contiguous {best['contiguous'] / best['none']:.1f}x, paged "
          f"{best['paged'] / best['none']:.1f}x no cache; paged / contiguous {best['paged'] / best['contiguous']:.2f}x")


def read_cost(model, prompts, args, out):
    """One layer's append (write + read) for the batch: contiguous read vs paged gather."""
    attn, dtype = model.h[0].attn, model.wpe.weight.dtype
    H, D, n = attn.n_head, attn.head_dim, len(prompts)
    rng = np.random.default_rng(0)
    caches = {"contiguous": ContiguousKVCache(1, H, D, n, args.context, dtype),
              "paged": PagedKVCache(BlockPool(n * -(-args.context // args.block_size), args.block_size, 1, H, D, dtype),
                                    args.context, 1, H, D)}
    times = {}
    for name, cache in caches.items():
        for s, p in enumerate(prompts):
            cache.add_sequence(s)
            cache.select([s])
            cache.positions(len(p))
            cache.append(0, *(rng.standard_normal((2, 1, H, len(p), D)).astype(dtype)))
            cache.advance(len(p))
        new = rng.standard_normal((2, n, H, 1, D)).astype(dtype)
        cache.select(list(range(n)))
        samples = []
        for _ in range(max(5, args.repeats * 5)):
            cache.positions(1)
            start = time.perf_counter()
            cache.append(0, new[0], new[1])
            samples.append(time.perf_counter() - start)         # no advance: the same step again
        times[name] = float(np.median(samples))
        cache.release()
    print(f"\n3. One layer's KV write + read for {n} sequences of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens: contiguous {times['contiguous'] * 1e6:.0f} us, paged gather (bs={args.block_size}) "
          f"{times['paged'] * 1e6:.0f} us = {times['paged'] / times['contiguous']:.2f}x")
    out["read_seconds"] = times


def preemption_table(model, prompts, args, out):
    n = len(prompts)
    per_token = LLMEngine(model).kv_bytes_per_token
    need = sum(-(-(len(p) + args.max_new_tokens) // args.block_size) for p in prompts)
    longest = -(-(max(map(len, prompts)) + args.max_new_tokens) // args.block_size)
    blocks = max(longest, need // 3)
    tracker = memory.tracker()
    print(f"\n4. Preemption: a device holding {blocks} blocks of {args.block_size} (all sequences need {need})")
    unconstrained, free = timed(LLMEngine(model, cache="paged", block_size=args.block_size, max_batch=n), prompts,
                                args, args.repeats)
    base = unconstrained.tokens
    for preempt in ("swap", "recompute"):
        memory.set_device_capacity(tracker.live_total + blocks * args.block_size * per_token)
        try:
            engine = LLMEngine(model, cache="paged", block_size=args.block_size, max_batch=n, preempt=preempt)
            r, speed = timed(engine, prompts, args, args.repeats)
        finally:
            memory.set_device_capacity(None)
        same = "same tokens" if r.tokens == base else "tokens differ (near-ties)"
        print(f"  {preempt:<10}{speed:>10,.0f} tokens/s ({speed / free:.2f}x unconstrained)  preemptions "
              f"{r.preemptions}, blocks swapped {r.blocks_swapped}, recomputed tokens {r.recomputed_tokens}; {same}")
        out["preemption"][preempt] = {"tokens_per_second": speed, "unconstrained": free, "preemptions": r.preemptions,
                                      "blocks_swapped": r.blocks_swapped, "recomputed_tokens": r.recomputed_tokens}


def main():
    args = parse_args()
    minitrain.backend.limit_blas_threads(args.threads)
    minitrain.set_default_dtype(np.float64 if args.precision == "fp64" else np.float32)
    minitrain.manual_seed(args.seed)
    config = nn.GPTConfig(vocab_size=args.vocab, block_size=args.context, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd)
    model = nn.GPT(config)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, size=args.num_prompts)
    prompts = [list(rng.integers(0, args.vocab, m)) for m in lengths]
    print(f"GPT {args.n_layer} layers, n_embd {args.n_embd}, context {args.context}, {args.precision}: "
          f"{model.num_parameters():,} parameters; {args.num_prompts} prompts, {args.max_new_tokens} new tokens each")
    out = {"waste": {}, "throughput": {}, "preemption": {}}
    waste_table(model, prompts, args, out)
    throughput_table(model, prompts, args, out)
    read_cost(model, prompts, args, out)
    preemption_table(model, prompts, args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
