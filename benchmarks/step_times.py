"""Median milliseconds per engine step and decoding tokens/s, the model loaded once: finer than `verispec bench` for
comparing two trees side by side (run it with each tree's src first on PYTHONPATH, alternating).

    PYTHONPATH=<tree>/src python benchmarks/step_times.py --draft ngram --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries, with error handling."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="none", help="a --draft spec (default: none, plain decoding)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    from verispec import SamplingConfig, SpeculativeDecoder
    from verispec.config import SpecConfig

    decoder = SpeculativeDecoder.load(*([args.target] if args.target else []), draft=args.draft)
    ids = decoder.encode(args.prompt)
    spec = SpecConfig(num_draft_tokens=args.k, max_new_tokens=args.tokens, stop_at_eos=False)
    step_ms, rates = [], []
    for _ in range(args.repeats):
        began, steps, first = None, 0, 0
        for _, seq in decoder.engine.stream([ids], SamplingConfig(temperature=0), spec, seeds=0):
            if began is None:  # timing starts after the prompt's pass
                began, first = time.perf_counter(), seq.num_generated
                continue
            steps += 1
        seconds = time.perf_counter() - began
        step_ms.append(1000 * seconds / max(steps, 1))
        rates.append((seq.num_generated - first) / seconds)
    print(f"{args.draft}: {statistics.median(step_ms):.2f} ms a step, {statistics.median(rates):.2f} tokens/s "
          f"(median of {args.repeats})")


if __name__ == "__main__":
    main()
