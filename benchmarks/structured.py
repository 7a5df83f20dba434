"""What structured output costs: the grammar engines' mask per token, and the constraint's share of a decoding step.

    .venv/bin/python benchmarks/structured.py --engines                     # llguidance / xgrammar / outlines-core
    .venv/bin/python benchmarks/structured.py --draft suffix --per-category 2 --out /tmp/structured

--engines: each engine installed (xgrammar and outlines-core are optional: `pip install xgrammar outlines-core`)
compiles the shipped structured prompts' schemas against the target's tokenizer and computes the mask at every
position of a valid answer to each (the answers are made by verispec's own greedy constrained decoding of the prompt,
so every engine walks the same tokens): compile seconds, and per-token mask milliseconds (median and 99th percentile).

Otherwise: the shipped structured prompts (held-out split) decoded greedily under their schemas with --draft, every
constraint call timed (the masks of each verification pass's rows, the draft's masked q, forced tokens, advancing
over committed tokens): the constraint's milliseconds per step and its share of the step, with the answers' validity
(JSON that parses; the schema itself is what the mask enforces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.config import Constraint
from verispec.constraints import ConstraintState
from verispec.datasets import HELDOUT, STRUCTURED_PROMPTS, load_prompts
from verispec.models.registry import DEFAULT_TARGET

TIMED = ("node_masks", "allowed_after", "forced", "advance", "end_token")


class Clock:
    """Wraps ConstraintState's methods with timers (seconds per method, summed)."""

    def __init__(self) -> None:
        self.seconds = {name: 0.0 for name in TIMED}
        self.originals = {name: getattr(ConstraintState, name) for name in TIMED}

    def __enter__(self):
        for name, original in self.originals.items():
            def timed(*args, _original=original, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - start
            setattr(ConstraintState, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(ConstraintState, name, original)


def step_share(args) -> dict:
    decoder = SpeculativeDecoder.load(args.target, args.draft)
    prompts = load_prompts(STRUCTURED_PROMPTS, per_category=args.per_category, split=HELDOUT)
    rows = []
    for p in prompts:
        sampling = SamplingConfig(temperature=0.0, constraint=Constraint("json_schema", p.schema))
        spec = SpecConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k)
        with Clock() as clock:
            start = time.perf_counter()
            result = decoder.generate(p.text, sampling, spec)
            seconds = time.perf_counter() - start
        constraint = sum(clock.seconds.values())
        steps = result.stats.target_forward_passes
        try:
            json.loads(result.text)
            valid = True
        except json.JSONDecodeError:
            valid = False
        rows.append({"question_id": p.question_id, "category": p.category, "tokens": result.stats.new_tokens,
                     "steps": steps, "seconds": seconds, "constraint_seconds": constraint,
                     "constraint_ms_per_step": 1e3 * constraint / steps, "share_of_step": constraint / seconds,
                     "by_call": clock.seconds, "forced_tokens": result.stats.forced_tokens,
                     "finish_reason": result.finish_reason, "valid_json": valid})
        print(f"q{p.question_id} {p.category}: {result.stats.new_tokens} tokens in {steps} steps, constraint "
              f"{rows[-1]['constraint_ms_per_step']:.2f} ms/step = {100 * rows[-1]['share_of_step']:.2f}% of the "
              f"time, {result.stats.forced_tokens} forced, valid {valid}", flush=True)
    return {"draft": args.draft, "rows": rows,
            "median_share_of_step": statistics.median(r["share_of_step"] for r in rows),
            "max_share_of_step": max(r["share_of_step"] for r in rows),
            "valid": f"{sum(r['valid_json'] for r in rows)}/{len(rows)}"}


def engines(args) -> dict:
    decoder = SpeculativeDecoder.load(args.target, "suffix")
    tokenizer, vocab = decoder.target.tokenizer, decoder.runner.vocab_size
    prompts = load_prompts(STRUCTURED_PROMPTS, per_category=args.per_category, split=HELDOUT)
    cases = []
    for p in prompts:  # a valid answer per schema: verispec's greedy constrained decoding of the prompt
        sampling = SamplingConfig(temperature=0.0, constraint=Constraint("json_schema", p.schema))
        result = decoder.generate(p.text, sampling, SpecConfig(max_new_tokens=args.max_new_tokens))
        if result.finish_reason == "eos":
            cases.append((p.schema, result.token_ids[:-1]))
    out = {"answers": len(cases), "tokens": sum(len(ids) for _, ids in cases)}
    for name, run in (("llguidance", _llguidance), ("xgrammar", _xgrammar), ("outlines-core", _outlines)):
        try:
            compile_s, mask_s = run(tokenizer, vocab, cases)
        except ImportError as err:
            out[name] = f"not installed ({err.name})"
            continue
        mask_s.sort()
        out[name] = {"compile_seconds_median": statistics.median(compile_s),
                     "mask_ms_median": 1e3 * statistics.median(mask_s),
                     "mask_ms_p99": 1e3 * mask_s[int(0.99 * (len(mask_s) - 1))], "masks": len(mask_s)}
        print(name, out[name], flush=True)
    return out


def _llguidance(tokenizer, vocab, cases):
    import llguidance
    import llguidance.hf

    from verispec.constraints import grammar_text

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    compile_s, mask_s = [], []
    for schema, ids in cases:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar_text(Constraint("json_schema", schema)))
        compile_s.append(time.perf_counter() - start)
        for token in ids:
            start = time.perf_counter()
            matcher.compute_bitmask()
            mask_s.append(time.perf_counter() - start)
            matcher.consume_token(token)
    return compile_s, mask_s


def _xgrammar(tokenizer, vocab, cases):
    import xgrammar as xgr

    from verispec.constraints import JSON_OPTIONS

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=2)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    compile_s, mask_s = [], []
    for schema, ids in cases:
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, separators=(JSON_OPTIONS["item_separator"],
                                                                    JSON_OPTIONS["key_separator"]))
        compile_s.append(time.perf_counter() - start)
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            mask_s.append(time.perf_counter() - start)
            if not matcher.accept_token(token):
                break  # another engine's JSON rules (whitespace): the rest of this answer is not its to walk
    return compile_s, mask_s


def _outlines(tokenizer, vocab, cases):
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = tokenizer.eos_token_id
    words: dict[str, list[int]] = {}
    for piece, i in tokenizer.get_vocab().items():
        if i != eos:
            words.setdefault(tokenizer.convert_tokens_to_string([piece]), []).append(i)
    vocabulary = Vocabulary(eos, words)
    compile_s, mask_s = [], []
    for schema, ids in cases:
        start = time.perf_counter()
        index = Index(build_regex_from_schema(schema, r"[ ]?"), vocabulary)
        compile_s.append(time.perf_counter() - start)
        state = index.get_initial_state()
        for token in ids:
            start = time.perf_counter()
            index.get_allowed_tokens(state)
            mask_s.append(time.perf_counter() - start)
            state = index.get_next_state(state, token)
            if state is None:
                break
    return compile_s, mask_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default="suffix")
    parser.add_argument("--engines", action="store_true", help="compare the grammar engines' mask costs instead")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON in this directory")
    args = parser.parse_args()
    result = engines(args) if args.engines else step_share(args)
    if not args.engines:
        print(f"constraint share of a step: median {100 * result['median_share_of_step']:.2f}%, "
              f"max {100 * result['max_share_of_step']:.2f}%; valid JSON {result['valid']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ("engines.json" if args.engines else "step_share.json")).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
