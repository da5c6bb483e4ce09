"""One SGD training step of an MLP, minitrain vs PyTorch (CPU), same threads, same shapes.

    python scripts/bench_autograd.py [--threads 1] [--repeats 50] [--plot bench_autograd.png]

Two models: "large" (batch 256, three hidden layers of 1024, float32), where the matmuls
dominate and the engine's overhead must vanish beside them, and "small" (batch 32, three
hidden layers of 128), where per-operation Python overhead dominates. A step is
zero_grad + forward + cross-entropy + backward + SGD update. Prints the median step time of
each and the ratio minitrain / PyTorch (the anchor, measured in the same run).
Goals (issue 2): <= 1.15x on large, <= 1.5x on small.
"""
import argparse

import numpy as np
from threadpoolctl import threadpool_limits

import minitrain as mt
from minitrain import cli, nn, optim
from minitrain.nn import functional as F
from minitrain.testing import median_time

CONFIGS = {"large": dict(batch=256, width=1024, depth=3), "small": dict(batch=32, width=128, depth=3)}
CLASSES = 10


def sizes(cfg):
    return [cfg["width"]] * (cfg["depth"] + 1) + [CLASSES]


def minitrain_step(cfg, rng):
    model = nn.MLP(sizes(cfg))
    opt = optim.SGD(model.parameters(), lr=0.01)
    x = rng.standard_normal((cfg["batch"], cfg["width"])).astype(np.float32)
    y = rng.integers(0, CLASSES, cfg["batch"])
    xt = mt.Tensor(x)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(xt), y).backward()
        opt.step()
    return step


def torch_step(cfg, rng):
    import torch
    layers = []
    s = sizes(cfg)
    for i, (a, b) in enumerate(zip(s[:-1], s[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(s) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.tensor(rng.standard_normal((cfg["batch"], cfg["width"])).astype(np.float32))
    y = torch.tensor(rng.integers(0, CLASSES, cfg["batch"]))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    p.add_argument("--threads", type=cli.positive_int, default=1, help="BLAS / torch threads for both")
    p.add_argument("--repeats", type=cli.positive_int, default=50, help="timed steps per model and round")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="alternate the two libraries this many times")
    p.add_argument("--plot", metavar="PNG", type=cli.output_image, help="draw the step times (default: no plot)")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("the anchor is PyTorch: pip install -e '.[oracle]'")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = {}
    with threadpool_limits(limits=args.threads):
        for name, cfg in CONFIGS.items():
            ours, theirs = minitrain_step(cfg, rng), torch_step(cfg, rng)
            t_ours, t_theirs = [], []
            for _ in range(args.rounds):      # alternate, so drift on a shared machine hits both
                t_ours.append(median_time(ours, args.repeats, warmup=5))
                t_theirs.append(median_time(theirs, args.repeats, warmup=5))
            results[name] = (min(t_ours), min(t_theirs))

    print(f"one SGD step, float32, {args.threads} thread(s), median of {args.repeats} (best of {args.rounds} rounds)")
    print(f"{'model':<8}{'shape':<34}{'minitrain':>12}{'pytorch':>12}{'ratio':>8}")
    for name, (t_ours, t_theirs) in results.items():
        cfg = CONFIGS[name]
        shape = f"batch {cfg['batch']}, {cfg['depth']} x {cfg['width']} hidden"
        print(f"{name:<8}{shape:<34}{t_ours * 1e3:>10.3f}ms{t_theirs * 1e3:>10.3f}ms{t_ours / t_theirs:>7.2f}x")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(results)
        ax.bar(np.arange(len(names)) - 0.2, [results[n][0] * 1e3 for n in names], 0.4, label="minitrain")
        ax.bar(np.arange(len(names)) + 0.2, [results[n][1] * 1e3 for n in names], 0.4, label="PyTorch CPU")
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
        ax.set_ylabel("ms per SGD step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"saved {args.plot}")
    return results


if __name__ == "__main__":
    main()
