"""What verifying sampled rows costs when p is made as the walk reads it (the root and each accepted draft's row:
k + 1 rows when the k-th draft is rejected) against making the whole chain's p first (the step before), on the default
target and drafter, at one row and at eight.

Both ways run in this process, alternating, on the same prompts and seeds: the answers must be the same tokens (the
rows are the same bits made alone or together, `sampling.row_sums`), and the script stops if they are not. Reported:
milliseconds of verification per sampled row and step (`StepRules.verify_one`), and decoding tokens/s after the first
token, medians over the repeats.

    .venv/bin/python benchmarks/sampled_verify.py --rows 1 8 --tokens 96 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def whole_pass(rules, seq, draft, logits):
    """The step before: a sampled chain's p made for every row at once, then `rejection.verify` on it."""
    from verispec.rejection import verify
    chain = seq.processors
    if chain.greedy or not draft.is_chain or seq.constraint is not None or rules.tracer or rules.observers:
        return ORIGINAL(rules, seq, draft, logits)
    seen = chain.seen_rows(seq.tokens, draft.tokens, None, logits.shape[-1])
    return verify(chain.target(logits, seen), draft, seq.rng)


def main() -> None:
    global ORIGINAL
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec import SamplingConfig, SpeculativeDecoder
    from verispec.config import SpecConfig
    from verispec.step import StepRules

    ORIGINAL = StepRules.verify_one
    questions = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    seen_categories, prompts = set(), []
    for q in questions:  # one prompt per category, then more in order
        if q["category"] not in seen_categories:
            seen_categories.add(q["category"])
            prompts.append(q["turns"][0])
    prompts += [q["turns"][0] for q in questions if q["turns"][0] not in prompts][: max(0, max(args.rows) - len(prompts))]
    decoder = SpeculativeDecoder.load()
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    spec = SpecConfig(max_new_tokens=args.tokens, stop_at_eos=False)
    ids = [decoder.encode(p) for p in prompts]
    spent: list[float] = []

    def timed(way):
        def verify_one(rules, seq, draft, logits):
            t0 = time.perf_counter()
            out = way(rules, seq, draft, logits)
            spent.append(time.perf_counter() - t0)
            return out
        return verify_one

    print(f"lscpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, T={args.temperature} "
          f"top_p={args.top_p}, {args.tokens} tokens, medians of {args.repeats}")
    print(f"{'rows':>4} {'way':>12} {'verify ms/row-step':>19} {'tokens/s':>9}")
    for rows in args.rows:
        results: dict[str, list[tuple[float, float]]] = {"whole pass": [], "as read": []}
        answers: dict[str, list] = {}
        for _ in range(args.repeats):
            for name, way in (("whole pass", whole_pass), ("as read", ORIGINAL)):
                StepRules.verify_one = timed(way)
                spent.clear()
                began, done = None, {}
                for _, seq in decoder.engine.stream(ids[:rows], sampling, spec, seeds=list(range(rows))):
                    if began is None:  # after the first step (the prompts' passes)
                        began, spent_before = time.perf_counter(), len(spent)
                    if seq.finish_reason is not None:
                        done[seq.index] = list(seq.generated)
                seconds = time.perf_counter() - began
                StepRules.verify_one = ORIGINAL
                made = sum(len(t) for t in done.values()) - rows  # less each row's first token
                results[name].append((1e3 * statistics.fmean(spent[spent_before:]), made / seconds))
                answer = [done[i] for i in sorted(done)]
                if answers.setdefault(name, answer) != answer or answers.get("whole pass", answer) != answer:
                    raise SystemExit(f"{rows} rows: the two ways gave different tokens")
        for name, got in results.items():
            ms = statistics.median(g[0] for g in got)
            rate = statistics.median(g[1] for g in got)
            print(f"{rows:>4} {name:>12} {ms:>19.2f} {rate:>9.2f}")


if __name__ == "__main__":
    main()
