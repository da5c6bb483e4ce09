"""The ZeRO paper's Figure 1 example, from minitrain's formula code: a 7.5B-parameter model on
64 GPUs with mixed-precision Adam (K = 12). The paper: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.

    python scripts/zero_memory_table.py [--params 7.5e9] [--ranks 64]
"""
import argparse

from minitrain import cli
from minitrain.parallel.zero_memory import MIXED_PRECISION_ADAM, model_state_bytes

PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=cli.HelpFormatter)
    ap.add_argument("--params", type=cli.positive_float, default=7.5e9, help="the model's parameters")
    ap.add_argument("--ranks", type=cli.positive_int, default=64, help="data-parallel GPUs")
    args = ap.parse_args()
    print(f"model states per rank, Ψ = {args.params:.3g}, N = {args.ranks}, mixed-precision Adam (2 + 2 + 12 bytes)")
    print(f"{'stage':<22}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}{'paper':>9}")
    labels = {0: "0 (DDP)", 1: "1 (P_os)", 2: "2 (P_os+g)", 3: "3 (P_os+g+p)"}
    rows = {}
    for stage in range(4):
        b = model_state_bytes(args.params, args.ranks, stage, **MIXED_PRECISION_ADAM)
        rows[stage] = b["total"] / 1e9
        paper = f"{PAPER_GB[stage]:.1f} GB" if (args.params, args.ranks) == (7.5e9, 64) else ""
        print(f"{labels[stage]:<22}{b['params'] / 1e9:>8.2f}GB{b['grads'] / 1e9:>8.2f}GB"
              f"{b['optimizer_state'] / 1e9:>9.2f}GB{b['total'] / 1e9:>8.1f}GB{paper:>9}")
    return rows


if __name__ == "__main__":
    main()
