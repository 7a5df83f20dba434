"""What verification saves by starting the draft's tokens at its first skipped layer (LayerSkip's reuse).

For each skip set, greedy self-speculation decodes the same held-out prompts twice per round, with the
reuse on and off (the same tokens either way: the reuse is exact), alternating the order each round.
Reported: the median verification pass (prompt passes apart), decoding tokens/s after each prompt's first
output, and tokens whose first layers came from the draft. Run: .venv/bin/python benchmarks/self_reuse.py [--sets 14- m1-5,m7,m9,m13] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from verispec.api import SpeculativeDecoder
from verispec.config import SamplingConfig, SpecConfig
from verispec.datasets import DEFAULT_PROMPTS, load_prompts
from verispec.drafters.self_draft import SelfDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.skip import SkipSet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["14-", "20-", "m1-5,m7,m9,m13,h65536"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    decoder = SpeculativeDecoder.load(draft="none")
    runner = decoder.runner
    prompts = [decoder.encode(p.text) for p in load_prompts(DEFAULT_PROMPTS, ["coding", "summarization"], 2, "heldout")]
    spec = SpecConfig(num_draft_tokens=args.k, max_new_tokens=args.tokens)
    greedy = SamplingConfig(temperature=0)
    report = {}
    for text in args.sets:
        skip = SkipSet.parse(text, len(runner.gguf.layers))
        engine = SpeculativeEngine(runner, SelfDrafter(runner, skip), set())
        engine.generate(prompts[:1], greedy, spec)  # warm-up
        verify_times: list[float] = []
        forward = runner.forward

        def timed_forward(state, tokens, num_logits, **kwargs):  # the target's verification passes, prompts apart
            start = time.perf_counter()
            out = forward(state, tokens, num_logits, **kwargs)
            if "skip" not in kwargs and sum(map(len, tokens)) <= args.k + 1:
                verify_times.append(time.perf_counter() - start)
            return out

        runner.forward = timed_forward  # on this instance only; the drafter's passes (skip=...) are not counted
        results = {True: [], False: []}
        for r in range(args.rounds):
            for reuse in ((True, False) if r % 2 == 0 else (False, True)):
                runner.keep_draft_prefix = reuse
                before = runner.resumed_tokens
                verify_times.clear()
                seconds, tokens, outputs = 0.0, 0, []
                for prompt in prompts:  # decoding speed: from each prompt's first output on
                    first = None
                    for _, seq in engine.stream([prompt], greedy, spec):
                        if first is None:
                            first, after = time.perf_counter(), len(seq.generated)
                    seconds += time.perf_counter() - first
                    tokens += len(seq.generated) - after
                    outputs.append(seq.generated)
                results[reuse].append({
                    "verify_ms_per_step": 1000 * statistics.median(verify_times),
                    "tokens_per_second": tokens / seconds,
                    "resumed_tokens": runner.resumed_tokens - before,
                    "tokens": outputs})
        runner.keep_draft_prefix = True
        del runner.forward
        assert all(r["tokens"] == results[True][0]["tokens"] for v in results.values() for r in v), "reuse changed output"
        report[skip.text] = {("reuse" if reuse else "no_reuse"): {
            key: round(statistics.median(r[key] for r in runs), 2) for key in ("verify_ms_per_step", "tokens_per_second",
                                                                            "resumed_tokens")}
            for reuse, runs in results.items()} | {"first_skipped_layer": skip.first}
        print(json.dumps({skip.text: report[skip.text]}), flush=True)


if __name__ == "__main__":
    main()
