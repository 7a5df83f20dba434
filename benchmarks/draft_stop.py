"""Dynamic draft length, side by side: the same drafter with and without its chains stopping early.

    .venv/bin/python benchmarks/draft_stop.py --backend llama.cpp --drafter distilled --per-category 2
    .venv/bin/python benchmarks/draft_stop.py --backend torch --drafter distilled --per-category 1 --max-new-tokens 96
    .venv/bin/python benchmarks/draft_stop.py --backend llama.cpp --drafter ngram --per-category 2

Systems, interleaved prompt by prompt on held-out Spec-Bench prompts (odd question ids, never trained on):
plain target decoding; the drafter auto-tuned (--auto-k) with every chain K long ("auto-full", the default),
and with chains stopping where measured costs say they no longer pay ("auto-stop": KTuner(stop_drafts=True),
K then only a cap); the drafter at fixed K
("k", every chain K long) and at fixed K with --draft-stop P ("k-stop"). All systems share one
target and one measured cost profile. Prints per category and overall: median decoding tokens/s
(after the first output), its median per-prompt ratio to plain decoding, acceptance (accepted / drafted)
and tokens per target pass; greedy runs check every system's tokens against plain decoding. Writes
the numbers as JSON and a plot of the calibration the auto-stop drafter learned (acceptance by draft
confidence and by copied-match length) under --out-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.core.stopping import CONFIDENCE_BINS
from verispec.datasets import HELDOUT, load_prompts
from verispec.models.loading import load_distilled_draft, load_model
from verispec.models.registry import DEFAULT_TARGET

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def make_decoder(target, drafter: str, draft_weights: str = "int8") -> SpeculativeDecoder:
    if drafter == "distilled":
        return SpeculativeDecoder(target, load_distilled_draft("distilled", target, draft_weights))
    return SpeculativeDecoder(target, drafter)


def run(decoder, prompt, sampling, spec, tuner, seed):
    start, first = time.perf_counter(), None
    for _, seq in decoder.engine.stream([prompt], sampling, spec, seeds=[seed], tuner=tuner):
        if first is None and seq.generated:
            first = (time.perf_counter() - start, len(seq.generated))
    seconds = time.perf_counter() - start
    decode = (len(seq.generated) - first[1]) / (seconds - first[0]) if len(seq.generated) > first[1] else None
    return seq.generated, seq.stats, decode


def plot_calibration(calibration, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, source, label in ((axes[0], "model", "draft's q of its token (bin)"), (axes[1], "copy", "copied after a match of >= n tokens (bins)")):
        keys = sorted(k for k in calibration.counts if k[0] == source)
        for greedy in (True, False):
            ks = [k for k in keys if k[2] == greedy and calibration.counts[k][1] > 0]
            if not ks:
                continue
            xs = [(k[1] + 0.5) / CONFIDENCE_BINS if source == "model" else k[1] for k in ks]
            ys = [calibration.counts[k][0] / calibration.counts[k][1] for k in ks]
            ax.plot(xs, ys, "o-", label=f"{'greedy' if greedy else 'sampled'} (n = {sum(calibration.counts[k][1] for k in ks):.0f})")
        if source == "model":
            ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="calibrated")
        else:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("accepted")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--backend", default="llama.cpp", choices=["torch", "llama.cpp"])
    ap.add_argument("--drafter", default="distilled", choices=["distilled", "ngram"])
    ap.add_argument("--draft-weights", default="int8", choices=["int8", "dense"],
                    help="the distilled draft's weights (int8: as `verispec generate` runs it)")
    ap.add_argument("--categories", nargs="*", default=None, help="Spec-Bench categories, or MT-Bench ones (coding, extraction)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-stop", type=float, default=0.3, help="P of the k-stop system")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", default="artifacts/draft_stop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.categories, args.per_category, split=HELDOUT)
    weights = "packed" if args.backend == "torch" else "dense"
    target = load_model(DEFAULT_TARGET, "float32", weights, args.backend)
    plain = SpeculativeDecoder(target, "none")
    decoders = {name: make_decoder(target, args.drafter, args.draft_weights) for name in ("auto-full", "auto-stop", "k", "k-stop")}
    tuner = decoders["auto-stop"].auto_tuner(max(8, args.num_draft_tokens))
    profile = tuner.profile
    print(f"c = {profile.c:.3f}, v = {[round(v, 2) for v in profile.pass_costs()]}", flush=True)
    tuners = {"auto-full": tuner, "auto-stop": dataclasses.replace(tuner, stop_drafts=True)}
    sampling = SamplingConfig(temperature=args.temperature)
    rows: dict[str, list[dict]] = defaultdict(list)
    mismatches = 0
    for i, prompt in enumerate(prompts):
        ids = plain.encode(prompt.text)
        seed = prompt.question_id
        base_tokens, _, base = run(plain, ids, sampling, SpecConfig(max_new_tokens=args.max_new_tokens), None, seed)
        line = f"[{i + 1}/{len(prompts)}] {prompt.category:14s} q{prompt.question_id} plain {base:.2f} tok/s"
        for name, decoder in decoders.items():
            spec = SpecConfig(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                              draft_stop=args.draft_stop if name == "k-stop" else 0.0)
            tokens, stats, rate = run(decoder, ids, sampling, spec, tuners.get(name), seed)
            same = tokens == base_tokens
            mismatches += int(sampling.greedy and not same)
            rows[name].append({"category": prompt.category, "question_id": prompt.question_id, "rate": rate,
                               "plain_rate": base, "acceptance": stats.acceptance_rate, "drafted": stats.draft_tokens,
                               "accepted": stats.accepted_tokens, "passes": stats.target_forward_passes,
                               "new_tokens": stats.new_tokens, "same_as_plain": same})
            line += f" | {name} {rate:.2f} acc {stats.acceptance_rate:.2f} tok/pass {stats.tokens_per_target_pass:.2f}"
        print(line, flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    categories = sorted({r["category"] for r in rows["k"]}) + ["all"]
    table = {}
    print(f"\n{args.drafter} on {args.backend}, temperature {args.temperature}, K = {args.num_draft_tokens}, "
          f"--draft-stop {args.draft_stop} for k-stop")
    print("| system | category | decoding tok/s (median) | vs plain (median per prompt) | acceptance | tokens / target pass |")
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():
        for cat in categories:
            sel = [r for r in runs if cat == "all" or r["category"] == cat]
            row = {"rate": statistics.median(r["rate"] for r in sel),
                   "speedup": statistics.median(r["rate"] / r["plain_rate"] for r in sel),
                   "acceptance": sum(r["accepted"] for r in sel) / max(1, sum(r["drafted"] for r in sel)),
                   "tokens_per_pass": sum(r["new_tokens"] for r in sel) / sum(r["passes"] for r in sel)}
            table.setdefault(name, {})[cat] = row
            print(f"| {name} | {cat} | {row['rate']:.2f} | {row['speedup']:.2f}x | {row['acceptance']:.3f} | "
                  f"{row['tokens_per_pass']:.2f} |")
    if sampling.greedy:
        print(f"greedy outputs equal to plain decoding: {'all' if not mismatches else f'{mismatches} differ'}")
    # The k-stop drafter proposes the most under a stop rule, so its calibration has seen the most outcomes.
    calibration = decoders["k-stop"].drafter.calibration
    title = f"{args.drafter} draft on {args.backend}: acceptance by source, learned online (k-stop)"
    plot_calibration(calibration, out / f"calibration_{args.drafter}_{args.backend}.png", title)
    (out / f"draft_stop_{args.drafter}_{args.backend}.json").write_text(json.dumps(
        {"args": vars(args), "c": profile.c, "pass_costs": profile.pass_costs(), "table": table, "runs": rows,
         "calibration": {name: {str(k): v for k, v in decoders[name].drafter.calibration.counts.items()}
                         for name in ("auto-stop", "k-stop")}}, indent=1))


if __name__ == "__main__":
    main()
