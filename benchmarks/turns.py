"""A conversation's later turns with and without prefix reuse, from Python, for any drafter: the time to the first
token of each turn when the target (and a drafter that keeps its own rows: a draft model, an EAGLE head) starts from
the cache of the turn before, against reading the whole conversation again.

Each session: a coding task, then the follow-ups of `conversation.py` ("add type hints", ...), the conversation resent
every turn through the target's chat template, greedy, one decoder loaded once; "reuse" keeps the stores across turns
(`SpeculativeDecoder.reuse_prefixes`, the decoder's default), "none" turns them off. Reported: the median time to the
first token of turns 2-4 and each way's total seconds; the answers must be the same tokens both ways.

    .venv/bin/python benchmarks/turns.py --draft eagle --sessions 2 --max-tokens 160 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conversation import FOLLOW_UPS, TASKS


def session(decoder, task: str, max_tokens: int) -> list[dict]:
    """One session's turns: {first_s, seconds, tokens, cached} each."""
    from verispec import SamplingConfig
    from verispec.chat import chat_ids
    from verispec.config import SpecConfig

    messages, turns = [{"role": "user", "content": task}], []
    spec = SpecConfig(max_new_tokens=max_tokens)
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up is not None:
            messages += [{"role": "assistant", "content": decoder.decode(turns[-1]["tokens"])},
                         {"role": "user", "content": follow_up}]
        ids = chat_ids(decoder.target.tokenizer, messages)
        start, first = time.perf_counter(), None
        for _, seq in decoder.stream([ids], SamplingConfig(temperature=0), spec):
            if first is None and seq.num_generated:
                first = time.perf_counter() - start
        turns.append({"first_s": first, "seconds": time.perf_counter() - start, "tokens": list(seq.generated),
                      "cached": seq.stats.cached_tokens, "prompt": len(ids)})
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None, help="a --draft spec (default: the decoder's default drafter)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from verispec import SpeculativeDecoder
    from verispec.api import PREFIX_CACHE_BYTES

    kwargs = {"draft": args.draft} if args.draft is not None else {}
    decoder = SpeculativeDecoder.load(*([args.target] if args.target else []), **kwargs)
    print(f"target {decoder.target.name}, drafter {decoder.draft_name}, {args.threads} threads, greedy, up to "
          f"{args.max_tokens} tokens a turn, {args.sessions} sessions")
    answers = {}
    for name, budget in (("none", 0), ("reuse", PREFIX_CACHE_BYTES)):
        decoder.reuse_prefixes(budget)
        turns = [session(decoder, task, args.max_tokens) for task in TASKS[: args.sessions]]
        answers[name] = [[t["tokens"] for t in s] for s in turns]
        later = [t for s in turns for t in s[1:]]
        print(f"{name:6s} first token of turns 2-4 {statistics.median(t['first_s'] for t in later):.2f} s (median), "
              f"turn 1 {statistics.median(s[0]['first_s'] for s in turns):.2f} s; prompt tokens not read again "
              f"{sum(t['cached'] for t in later)} of {sum(t['prompt'] for t in later)}; total "
              f"{sum(t['seconds'] for s in turns for t in s):.1f} s", flush=True)
    same = answers["none"] == answers["reuse"]
    print(f"answers equal both ways: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
