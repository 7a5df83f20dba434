"""How far bfloat16 verification drifts from token-by-token decoding, and what it does to greedy output.

    .venv/bin/python benchmarks/bf16_near_ties.py --prompts 4 --max-new-tokens 48

For each dtype: (1) the largest logit difference between one target pass over a block of tokens and
token-by-token passes over the same tokens; (2) whether greedy speculative output (draft model, K=4)
equals plain greedy decoding in the same dtype, and at a divergence, the gap between the target's
top two logits there (a near-tie when it is below the measured drift).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.datasets import load_prompts
from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET, ModelRunner, load_model

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def block_vs_stepwise(runner: ModelRunner, ids: list[int], block: int = 16) -> float:
    prefix, tail = ids[:-block], ids[-block:]
    state = runner.new_state(1)
    runner.forward(state, [prefix], [1])
    together = runner.forward(state, [tail], [block])[0]  # (block, V)
    state = runner.new_state(1)
    runner.forward(state, [prefix], [1])
    stepwise = torch.cat([runner.forward(state, [[t]], [1])[0] for t in tail])
    return float((together - stepwise).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(PROMPTS, per_category=1)][: args.prompts]
    greedy = SamplingConfig(temperature=0)
    for dtype in ("float32", "bfloat16"):
        target, draft = load_model(DEFAULT_TARGET, dtype), load_model(DEFAULT_DRAFT, dtype)
        plain, spec = SpeculativeDecoder(target, "none"), SpeculativeDecoder(target, draft)
        runner = ModelRunner(target.model)
        for text in prompts:
            ref = plain.generate(text, greedy, SpecConfig(max_new_tokens=args.max_new_tokens))
            out = spec.generate(text, greedy, SpecConfig(num_draft_tokens=4, max_new_tokens=args.max_new_tokens))
            drift = block_vs_stepwise(runner, ref.prompt_token_ids + ref.token_ids)
            same = out.token_ids == ref.token_ids
            detail = ""
            if not same:
                i = next(j for j, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b)
                state = runner.new_state(1)
                logits = runner.forward(state, [ref.prompt_token_ids + ref.token_ids[:i]], [1])[0, 0]
                top2 = torch.topk(logits, 2).values
                detail = f" first divergence at token {i}: top-2 logit gap {float(top2[0] - top2[1]):.4f}"
            print(f"{dtype:9s} drift {drift:.5f} greedy-equal {same}{detail}", flush=True)


if __name__ == "__main__":
    main()
