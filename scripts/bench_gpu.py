"""One training step on the GPU: minitrain on CuPy vs PyTorch CUDA, same model, same batch, fp32, AdamW.

    python scripts/bench_gpu.py [--sizes big mid small] [--mlp] [--steps 20] [--json out.json]
    PYTHONPATH=tests/standin python scripts/bench_gpu.py --tiny      # CI: the CuPy stand-in, no GPU

GPT sizes (issue 16): big = 16 x 256 tokens, 8 layers, width 768; mid = 64 x 256, 6 layers, width
384; small = 32 x 64, 4 layers, width 128 (heads of 64, 64 and 32; vocabulary 96). MLP: 4 layers
of 1024 at batch 4096, and the digits MLP 64-128-128-10 at batch 64. A step is zero_grad, forward,
cross-entropy, backward, AdamW (lr 1e-3, weight decay 0.01); the batch is on the GPU already.
Timing: blocks of --steps steps between two synchronisations (the GPU runs ahead of Python, as
in training), median block / steps; the same for PyTorch. Both in fp32 without TF32. PyTorch's
attention is the same computation as minitrain's (matmul, mask, softmax, matmul); its fused
flash attention (scaled_dot_product_attention) is printed beside it for information.
Goals (issue 16): big <= 1.3x PyTorch, mid <= 1.6x. Also printed per step: kernel launches (the
stand-in counts them; a real GPU does not say), minitrain's synchronisations and host <-> device
copies, each with fusion on and off (MINITRAIN_FUSE=0 in the same run).
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import minitrain as mt
from minitrain import backend, cli, nn, optim
from minitrain.nn import functional as F

GPT_SIZES = {"big": (16, 256, 8, 768), "mid": (64, 256, 6, 384), "small": (32, 64, 4, 128),
             "tiny": (2, 16, 2, 32)}
GOALS = {"big": 1.3, "mid": 1.6}
MLP_SIZES = {"mlp big": (4096, [1024, 1024, 1024, 1024, 10]), "mlp digits": (64, [64, 128, 128, 10]),
             "mlp tiny": (8, [16, 32, 10])}
VOCAB = 96


def gpt_config(size):
    B, T, L, C = GPT_SIZES[size]
    return B, T, nn.GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=L, n_head=max(1, C // 64), n_embd=C)


def minitrain_gpt(size, seed=0):
    B, T, config = gpt_config(size)
    mt.manual_seed(seed)
    model = nn.GPT(config)
    opt = optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    idx, targets = (backend.to_device(rng.integers(0, VOCAB, (B, T))) for _ in range(2))

    def step():
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
    return step, model


def minitrain_mlp(name, seed=0):
    batch, sizes = MLP_SIZES[name]
    mt.manual_seed(seed)
    model = nn.MLP(sizes)
    opt = optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    x = mt.Tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    y = backend.to_device(rng.integers(0, sizes[-1], batch))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step, model


def timed(step, sync, steps, blocks, warmup=3):
    """Median seconds per step over ``blocks`` blocks of ``steps`` steps, each block ended by a sync."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def counted(step):
    """Per step: kernel launches (stand-in only, else None), minitrain's syncs and copies."""
    cupy = sys.modules.get("cupy")
    standin = cupy is not None and getattr(cupy, "__standin__", False)
    before = backend.transfer_counts()
    if standin:
        with cupy._standin.counting() as c:
            step()
    else:
        step()
    after = backend.transfer_counts()
    out = {k: after[k] - before[k] for k in ("sync", "h2d", "d2h")}
    out["kernels"] = c.delta["kernels"] if standin else None
    out["fused_kernels"] = c.delta["fused"] if standin else None
    out["device_syncs"] = c.delta["sync"] if standin else None
    return out


# ---------------------------------------------------------------- the PyTorch anchor
def torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch, None


def torch_gpt(torch, size, model, sdpa):
    """The same GPT in PyTorch (nanoGPT's module names), minitrain's weights copied in."""
    TF = torch.nn.functional
    B, T, config = gpt_config(size)
    C, H = config.n_embd, config.n_head

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
            self.attn, self.mlp = torch.nn.Module(), torch.nn.Module()
            self.attn.c_attn, self.attn.c_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
            self.mlp.c_fc, self.mlp.c_proj = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)
            self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1))

        def forward(self, x):
            q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))
            if sdpa:
                y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
                y = TF.softmax(att.masked_fill(self.mask, float("-inf")), dim=-1) @ v
            x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.mlp.c_proj(TF.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(VOCAB, C), torch.nn.Embedding(T, C)
            self.h = torch.nn.ModuleList([Block() for _ in range(config.n_layer)])
            self.ln_f = torch.nn.LayerNorm(C)
            self.lm_head = torch.nn.Linear(C, VOCAB, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    theirs = GPT().cuda()
    ours = {k: backend.to_host(v) for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.from_numpy(ours[name]))
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    idx, targets = (torch.from_numpy(rng.integers(0, VOCAB, (B, T))).cuda() for _ in range(2))

    def step():
        opt.zero_grad(set_to_none=True)
        TF.cross_entropy(theirs(idx).view(-1, VOCAB), targets.view(-1)).backward()
        opt.step()
    return step


def torch_mlp(torch, name):
    batch, sizes = MLP_SIZES[name]
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(sizes) - 2 else [])
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((batch, sizes[0])).astype(np.float32)).cuda()
    y = torch.from_numpy(rng.integers(0, sizes[-1], batch)).cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


# ---------------------------------------------------------------- the run
def bench(name, build, torch_builds, torch, args):
    step, model = build()
    ours = timed(step, backend.synchronize, args.steps, args.blocks)
    fused = counted(step)
    backend.FUSE = False
    unfused = counted(step)
    ours_unfused = timed(step, backend.synchronize, args.steps, args.blocks) if args.unfused_timing else None
    backend.FUSE = True
    row = {"minitrain_s": ours, "minitrain_unfused_s": ours_unfused, "per_step": fused, "per_step_unfused": unfused}
    for label, tb in torch_builds:
        if torch is None:
            row[label] = None
            continue
        tstep = tb(model)
        row[label] = timed(tstep, torch.cuda.synchronize, args.steps, args.blocks)
    anchor = row.get("torch_s")
    row["ratio"] = ours / anchor if anchor else None
    return row


def fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:8.2f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--sizes", nargs="*", action=cli.Distinct, default=["big", "mid", "small"],
                   choices=list(GPT_SIZES), help="GPT sizes")
    p.add_argument("--mlp", nargs="*", action=cli.Distinct, default=["mlp big", "mlp digits"], choices=list(MLP_SIZES),
                   help="MLP sizes (names with spaces)")
    p.add_argument("--tiny", action="store_true", help="CI: the tiny GPT and MLP, 2 steps")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="steps per timed block")
    p.add_argument("--blocks", type=cli.positive_int, default=5, help="timed blocks (the median is kept)")
    p.add_argument("--unfused-timing", action="store_true", help="also time minitrain with MINITRAIN_FUSE=0")
    p.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results as JSON (default: none written)")
    args = p.parse_args(argv)
    if args.tiny:
        for option in sorted(cli.given_options(p, argv) & {"--sizes", "--mlp", "--steps", "--blocks"}):
            cli.refuse(p, option, "--tiny", "--tiny sets the sizes, 2 steps and 2 blocks")
        args.sizes, args.mlp, args.steps, args.blocks = ["tiny"], ["mlp tiny"], 2, 2
    try:
        backend.set_device("cuda")
    except RuntimeError as e:
        sys.exit(f"bench_gpu: {e} (without a GPU: PYTHONPATH=tests/standin for the CuPy stand-in)")
    torch, why = torch_cuda()
    device = backend.describe_device()
    print(f"minitrain on {device} vs PyTorch CUDA, fp32 (no TF32), AdamW; steps in blocks of {args.steps}")
    if torch is None:
        print(f"PyTorch CUDA anchor SKIPPED: {why} (ratios not measured)")
    results = {"device": device, "torch": None if torch is None else torch.__version__,
               "cupy": sys.modules["cupy"].__version__, "gpt": {}, "mlp": {}}
    header = (f"{'model':<12} {'minitrain ms':>12} {'torch ms':>9} {'ratio':>6} {'goal':>5} {'sdpa ms':>8} "
              f"{'kernels':>8} {'unfused':>8} {'syncs':>6} {'h2d':>4} {'d2h':>4}")
    print(header)
    for size in args.sizes:
        row = bench(size, lambda s=size: minitrain_gpt(s),
                    [("torch_s", lambda m, s=size: torch_gpt(torch, s, m, sdpa=False)),
                     ("torch_sdpa_s", lambda m, s=size: torch_gpt(torch, s, m, sdpa=True))], torch, args)
        row["goal"] = GOALS.get(size)
        results["gpt"][size] = row
        print_row(f"gpt {size}", row)
    for name in args.mlp:
        row = bench(name, lambda n=name: minitrain_mlp(n), [("torch_s", lambda m, n=name: torch_mlp(torch, n))],
                    torch, args)
        results["mlp"][name] = row
        print_row(name, row)
    print("(kernels: launches per step counted by the CuPy stand-in, with fusion / without (MINITRAIN_FUSE=0);"
          " '-' on a real GPU.\n syncs, h2d, d2h: minitrain's own per step, the batch being on the GPU already)")
    fallbacks = {f.name: sorted(map(str, f.unfusable)) for f in backend.FUSED if f.unfusable}
    results["fusion_fallbacks"] = fallbacks
    print("kernels cupy.fuse could not compile (run unfused): " + (str(fallbacks) if fallbacks else "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_row(name, row):
    n = row["per_step"]
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
    goal = "-" if not row.get("goal") else f"{row['goal']}x"
    kernels = "-" if n["kernels"] is None else str(n["kernels"])
    unfused = "-" if row["per_step_unfused"]["kernels"] is None else str(row["per_step_unfused"]["kernels"])
    print(f"{name:<12} {fmt_ms(row['minitrain_s']):>12} {fmt_ms(row.get('torch_s')):>9} {ratio:>6} {goal:>5} "
          f"{fmt_ms(row.get('torch_sdpa_s')):>8} {kernels:>8} {unfused:>8} {n['sync']:>6} {n['h2d']:>4} {n['d2h']:>4}")


if __name__ == "__main__":
    sys.exit(main())
