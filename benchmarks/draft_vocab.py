"""A draft model's LM head cut to its first N token ids (`--draft-vocab N`): what a draft token costs (c, relative to
a one-token target pass) and what is still accepted, side by side on the same prompts.

    .venv/bin/python benchmarks/draft_vocab.py --sizes full,65536,32768,16384,8192 --per-category 1 --out /tmp/dv

Held-out Spec-Bench prompts (odd question ids), greedy, K fixed (--k) so acceptance is compared at one draft length,
interleaved prompt by prompt: plain decoding, then the draft with each head size. c is measured on the running
models (`tuning.measure_costs`, median of --repeats) for each size. Prints and writes (JSON, markdown, a plot) per
size: c, acceptance (accepted / drafted), tokens per target pass, median decoding tokens/s after the first output
and its median per-prompt ratio to plain decoding, and how many outputs equal plain decoding's (all must).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.datasets import HELDOUT, load_prompts
from verispec.drafters.registry import DrafterOptions
from verispec.models.loading import DEFAULT_DRAFT_WEIGHTS, DEFAULT_DTYPE, DEFAULT_TARGET_WEIGHTS, load_model
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.tuning import measure_costs

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def decode(decoder: SpeculativeDecoder, prompt: list[int], spec: SpecConfig):
    """(tokens, stats, decoding tokens/s after the first output)."""
    start, first = time.perf_counter(), None
    for _, seq in decoder.engine.stream([prompt], SamplingConfig(temperature=0), spec, seeds=[0]):
        if first is None and seq.generated:
            first = (time.perf_counter() - start, len(seq.generated))
    seconds = time.perf_counter() - start
    rate = (len(seq.generated) - first[1]) / (seconds - first[0]) if len(seq.generated) > first[1] else None
    return seq.generated, seq.stats, rate


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["size"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title in ((axes[0], "c", "c: a draft token / a target pass"),
                           (axes[1], "tokens_per_pass", "tokens per target pass"),
                           (axes[2], "speedup", "decoding speed / plain (median)")):
        ax.bar(labels, [r[key] for r in rows], color="tab:blue")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft LM head rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--sizes", default="full,65536,32768,16384,8192")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="artifacts/draft_vocab")
    args = ap.parse_args()
    from verispec.api import set_threads

    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.target, DEFAULT_DTYPE, DEFAULT_TARGET_WEIGHTS)
    draft = load_model(args.draft, DEFAULT_DTYPE, DEFAULT_DRAFT_WEIGHTS)
    plain = SpeculativeDecoder(target, "none")
    sizes = [None if s == "full" else int(s) for s in args.sizes.split(",")]
    decoders = {s: SpeculativeDecoder(target, draft, options=DrafterOptions(draft_vocab=s)) for s in sizes}
    costs = {}
    for size, decoder in decoders.items():
        profile = measure_costs(plain.runner, decoder.drafter.runner, k_max=args.k, repeats=args.repeats)
        costs[size] = profile.c
        print(f"draft head {size or 'full'}: c = {profile.c:.3f}", flush=True)
    prompts = load_prompts(args.prompts, per_category=args.per_category, split=HELDOUT)
    spec = SpecConfig(num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    runs = {s: [] for s in [*sizes, "plain"]}
    for p in prompts:
        ids = plain.encode(p.text)
        want, _, base = decode(plain, ids, spec)
        runs["plain"].append(base)
        line = [f"{p.category} q{p.question_id}: plain {base:.2f}"]
        for size, decoder in decoders.items():
            got, stats, rate = decode(decoder, ids, spec)
            runs[size].append({"rate": rate, "ratio": rate / base, "drafted": stats.draft_tokens,
                               "accepted": stats.accepted_tokens, "passes": stats.target_forward_passes,
                               "tokens": len(got), "equal": got == want})
            line.append(f"{size or 'full'} {rate:.2f}")
        print(", ".join(line), flush=True)
    rows = []
    for size in sizes:
        r = runs[size]
        rows.append({"size": str(size or "full"), "c": round(costs[size], 4),
                     "acceptance": round(sum(x["accepted"] for x in r) / max(1, sum(x["drafted"] for x in r)), 3),
                     "tokens_per_pass": round(sum(x["tokens"] for x in r) / max(1, sum(x["passes"] for x in r)), 3),
                     "tokens_per_second": round(statistics.median(x["rate"] for x in r), 2),
                     "speedup": round(statistics.median(x["ratio"] for x in r), 3),
                     "greedy_equal": f"{sum(x['equal'] for x in r)}/{len(r)}"})
    table = ["| draft head rows | c | acceptance | tokens/pass | tok/s | vs plain | greedy = plain |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['size']} | {r['c']} | {r['acceptance']} | {r['tokens_per_pass']} | {r['tokens_per_second']} | "
              f"{r['speedup']}x | {r['greedy_equal']} |" for r in rows]
    text = "\n".join(table) + f"\n\nplain decoding: {statistics.median(runs['plain']):.2f} tok/s (median)\n"
    print(text)
    (out / "draft_vocab.md").write_text(text)
    (out / "draft_vocab.json").write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=1))
    plot(rows, out / "draft_vocab.png")


if __name__ == "__main__":
    main()
