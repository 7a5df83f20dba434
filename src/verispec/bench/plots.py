"""PNG plots of a bench summary: speedup by category, acceptance by draft position."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: dict, categories: list[str], path: Path, baseline: str = "hf-generate",
                 rate: str = "speedup") -> Path:
    """rate: "speedup" (end to end) or "decode_speedup" (after the first output)."""
    plt = _pyplot()
    systems = [s for s, cats in summary.items() if any(baseline in e[rate] for e in cats.values())]
    cols = categories + ["all"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cols)), 4))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        values = [summary[system].get(c, {}).get(rate, {}).get(baseline, 0.0) for c in cols]
        ax.bar([x + i * width for x in range(len(cols))], values, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(cols))], cols, rotation=20)
    what = "decoding speedup" if rate == "decode_speedup" else "speedup"
    ax.set_ylabel(f"{what} vs {baseline} (median per prompt)")
    if systems:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance_by_position(summary: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, cats in summary.items():
        rates = cats["all"].get("accepted_per_position")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=system)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts at this position accepted")
    ax.set_ylim(0, 1)
    if ax.get_lines():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
