"""`verispec analyze`: the speedup calculator of Leviathan et al. (2023), section 3.

With per-token acceptance alpha and K drafts per step, a step yields on average
    E[tokens] = (1 - alpha^(K+1)) / (1 - alpha)
and, if a draft token costs c target passes and the target's pass over K + 1 tokens costs as much as
a one-token pass, it costs K c + 1. The speedup over plain decoding is E[tokens] / (K c + 1).
The formulas are `verispec.tuning`'s (there with a measured pass cost v(K); here v = 1).

Measured mode reads a `verispec bench` JSON: alpha is the maximum-likelihood rate of the geometric
accept-until-the-first-rejection count, accepted / (accepted + rejections), over the system's runs;
c is the system's draft seconds per draft token over verispec-plain's target seconds per pass
(over the system's own seconds per target pass when the bench has no verispec-plain runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError
from verispec.tuning import CostProfile, best_k, expected_speedup, expected_tokens


@dataclass(frozen=True)
class AnalyzeConfig:
    """What the calculator tabulates.

    alphas: acceptance rates, each in [0, 1]. Default 0.5 to 0.95.
    k_max: the table's K runs over 1..k_max. Default 8.
    c: one draft token's cost relative to one target pass, >= 0. Default 0.05.
    """

    alphas: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    k_max: int = 8
    c: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "alphas", tuple(float(a) for a in self.alphas))
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise VerispecError(f"each alpha must be in [0, 1], got {list(self.alphas)}")
        if int(self.k_max) != self.k_max or not 1 <= self.k_max <= 64:
            raise VerispecError(f"k_max must be an integer in 1..64, got {self.k_max}")
        if not 0.0 <= self.c < float("inf"):
            raise VerispecError(f"the cost ratio c must be >= 0, got {self.c}")


def flat_profile(c: float, k_max: int) -> CostProfile:
    """A cost profile where a draft token costs c and every target pass costs 1 (v(K) = 1)."""
    return CostProfile({width: 1.0 for width in range(1, k_max + 2)}, draft_token=c)


def speedup_table(config: AnalyzeConfig) -> dict:
    """E[tokens per pass] and speedup for every alpha and K = 1..k_max, and the best K per alpha.

    Returns a JSON-able dict: c, k_max, ks, and rows [{alpha, tokens: [...], speedup: [...], best_k}],
    best_k 0 meaning that no K beats plain decoding.
    """
    profile = flat_profile(config.c, config.k_max)
    ks = list(range(1, config.k_max + 1))
    rows = [{"alpha": a, "tokens": [expected_tokens(a, k) for k in ks],
             "speedup": [expected_speedup(a, k, profile) for k in ks], "best_k": best_k(a, profile)}
            for a in config.alphas]
    return {"c": config.c, "k_max": config.k_max, "ks": ks, "rows": rows}


def measured_from_bench(report: dict, system: str | None = None) -> dict:
    """alpha and c of one drafting system of a `verispec bench` report (see the module docstring).

    Args:
        report: the parsed bench.json.
        system: a system name; None picks verispec-draft if present, else the first that drafted.
    Returns:
        {"system", "alpha", "c", "systems"} (systems: every system that drafted).
    """
    runs = report.get("runs") if isinstance(report, dict) else None
    if not isinstance(runs, list):
        raise VerispecError("not a verispec bench report: it has no 'runs' list")
    totals: dict[str, dict[str, float]] = {}
    keys = ("draft_tokens", "accepted_tokens", "recovered_tokens", "draft_seconds", "target_seconds",
            "target_forward_passes")
    for run in runs:
        stats = run.get("stats") if isinstance(run, dict) else None
        if not stats:
            continue
        t = totals.setdefault(run.get("system", "?"), dict.fromkeys(keys, 0.0))
        for key in keys:
            t[key] += float(stats.get(key, 0.0))
    drafting = [s for s, t in totals.items() if t["draft_tokens"] > 0]
    if system is None:
        if not drafting:
            raise VerispecError("the bench report has no system that drafted tokens")
        system = "verispec-draft" if "verispec-draft" in drafting else drafting[0]
    if system not in drafting:
        raise VerispecError(f"system '{system}' did not draft in this bench; choose from {', '.join(drafting) or 'none'}")
    t = totals[system]
    alpha = t["accepted_tokens"] / (t["accepted_tokens"] + t["recovered_tokens"])
    reference = totals.get("verispec-plain", t)
    if reference["target_forward_passes"] == 0 or reference["target_seconds"] == 0:
        raise VerispecError("the bench report has no target pass times to measure c against")
    pass_seconds = reference["target_seconds"] / reference["target_forward_passes"]
    c = t["draft_seconds"] / t["draft_tokens"] / pass_seconds
    return {"system": system, "alpha": alpha, "c": c, "systems": drafting}


def read_bench(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as err:
        raise VerispecError(f"cannot read bench file {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise VerispecError(f"{path} is not JSON ({err.msg} at line {err.lineno})") from None


def plot_speedup_table(table: dict, path: str | Path) -> Path:
    """PNG: speedup against K, one line per alpha, the best K of each marked with a star."""
    from verispec.bench.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in table["rows"]:
        line, = ax.plot(table["ks"], row["speedup"], marker="o", markersize=3, label=f"alpha = {row['alpha']:g}")
        if row["best_k"] > 0:
            ax.plot([row["best_k"]], [row["speedup"][row["best_k"] - 1]], marker="*", markersize=14,
                    color=line.get_color())
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("expected speedup over plain decoding")
    ax.set_title(f"(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)), c = {table['c']:g}; star: best K")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
