"""The p / q picture of the docs' "How verification works" page, drawn from verispec's own verification.

    .venv/bin/python benchmarks/pq_figure.py --out docs/pq.png

Left: a target distribution p and a draft distribution q over eight tokens; the part of q under p (min(p, q)) is
accepted, and a rejection is replaced from the residual normalize(max(0, p - q)). Right: 20,000 speculative samples
drawn with `rejection.verify` (through `viz.lossless.speculative_samples`, the visualizer's demo) against p: the
histogram is p's, with the chi-square p-value the audit would report.
"""

from __future__ import annotations

import argparse

import torch

from verispec.chisquare import chi_square_test
from verispec.rejection import residual_distribution
from verispec.viz.lossless import as_distribution, speculative_samples

P = [0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02]
Q = [0.12, 0.35, 0.05, 0.20, 0.02, 0.16, 0.06, 0.04]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/pq.png")
    ap.add_argument("--samples", type=int, default=20000)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, q = as_distribution(P, "p"), as_distribution(Q, "q")
    counts, accepted = speculative_samples(p, q, args.samples, torch.Generator().manual_seed(0))
    fit = chi_square_test(counts.double(), p)
    residual = residual_distribution(p, q)
    x = torch.arange(len(P)).numpy()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax.bar(x - 0.2, p.numpy(), 0.4, label="target p", color="tab:blue")
    ax.bar(x + 0.2, q.numpy(), 0.4, label="draft q", color="tab:orange", alpha=0.8)
    ax.step(x, torch.minimum(p, q).numpy(), where="mid", color="black", label="min(p, q): accepted mass")
    ax.plot(x, residual.numpy() * float((p - q).clamp(min=0).sum()), "v", color="tab:red",
            label="max(0, p - q): where rejections go")
    ax.set_xlabel("token")
    ax.set_title(f"accept x ~ q with probability min(1, p/q): rate sum min(p, q) = {float(torch.minimum(p, q).sum()):.2f}",
                 fontsize=9)
    ax.legend(fontsize=8)
    bx.bar(x - 0.2, p.numpy(), 0.4, label="target p", color="tab:blue")
    bx.bar(x + 0.2, (counts.double() / counts.sum()).numpy(), 0.4, label=f"{args.samples} speculative samples",
           color="tab:green")
    bx.set_xlabel("token")
    bx.set_title(f"output histogram vs p: chi-square p-value {fit.p_value:.2f}, accepted {accepted / args.samples:.2f}",
                 fontsize=9)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"written: {args.out} (p-value {fit.p_value:.3f}, acceptance {accepted / args.samples:.3f})")


if __name__ == "__main__":
    main()
