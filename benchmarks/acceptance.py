"""Acceptance rate and tokens per target pass of each drafter on Spec-Bench prompts (greedy).

    .venv/bin/python benchmarks/acceptance.py --per-category 2 --max-new-tokens 64

Prompts are the first turns from ../shared/datasets/spec_bench/question.jsonl, chat-templated.
Prints a markdown table per category and writes the numbers as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.datasets import load_prompts
from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from verispec.stats import GenerationStats

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="artifacts/acceptance.json")
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, per_category=args.per_category)
    target = load_model(DEFAULT_TARGET)
    drafters = {"draft-model": SpeculativeDecoder(target, load_model(DEFAULT_DRAFT)), "ngram": SpeculativeDecoder(target, "ngram")}
    sampling = SamplingConfig(temperature=args.temperature)
    spec = SpecConfig(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens)
    results: dict[str, dict[str, list[GenerationStats]]] = defaultdict(lambda: defaultdict(list))
    for i, prompt in enumerate(prompts):  # interleaved: machine drift hits both drafters alike
        for name, decoder in drafters.items():
            out = decoder.generate(prompt.text, sampling, spec, seed=prompt.question_id)
            results[name][prompt.category].append(out.stats)
            print(f"[{i + 1}/{len(prompts)}] {prompt.category:14s} q{prompt.question_id} {name:11s} "
                  f"acc {out.stats.acceptance_rate:.2f} tok/pass {out.stats.tokens_per_target_pass:.2f} "
                  f"{out.stats.tokens_per_second:.2f} tok/s", flush=True)
    table = {}
    print(f"\n| drafter | category | prompts | acceptance rate | tokens / target pass | median tok/s |")
    print("|---|---|---|---|---|---|")
    for name, by_cat in results.items():
        for cat, stats in list(by_cat.items()) + [("all", [s for v in by_cat.values() for s in v])]:
            merged = GenerationStats.merge(stats)
            row = {"prompts": len(stats), "acceptance_rate": merged.acceptance_rate,
                   "tokens_per_target_pass": merged.tokens_per_target_pass,
                   "median_tokens_per_second": statistics.median(s.tokens_per_second for s in stats)}
            table.setdefault(name, {})[cat] = row
            print(f"| {name} | {cat} | {row['prompts']} | {row['acceptance_rate']:.3f} | "
                  f"{row['tokens_per_target_pass']:.2f} | {row['median_tokens_per_second']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": table}, indent=2))


if __name__ == "__main__":
    main()
