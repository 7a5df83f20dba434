"""Predicted outputs on code edits: the old code sent as the `prediction`, against llama.cpp's plain decoding.

    .venv/bin/python benchmarks/predicted_outputs.py --prompts 5 --max-new-tokens 512 --threads 2

The bench's held-out code_editing prompts (`bench/data/editing.jsonl`: one edit of a standard-library function, the
whole function asked back), greedy, with the chat template. Each prompt's prediction is its fenced code block as the
prompt holds it, the text a code-editing client would send. Systems, taking turns on each prompt:
  llamacpp-generate        llama.cpp (llama-cpp-python) decoding the same GGUF alone
  verispec-plain           verispec's native runner, no drafts
  verispec-default         the default drafter (suffix decoding), K tuned from measured costs (what `serve` runs)
  verispec-plain+pred      no drafter, the prediction drafting
  verispec-default+pred    the default drafter and the prediction, per step (`core.prediction`)
For each: median end to end seconds, the median of the per-prompt ratios to llama.cpp's end to end time (prompt
processing included), target passes and, with a prediction, predicted tokens accepted / rejected. Every verispec
system's tokens are compared with verispec-plain's (they must be equal: the prediction changes only the passes).
`--json FILE` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import time
from importlib.resources import files

from verispec.api import SpeculativeDecoder, set_threads
from verispec.config import SamplingConfig, SpecConfig
from verispec.datasets import HELDOUT, load_prompts
from verispec.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

FENCED = re.compile(r"```[a-z]*\n.*?```", re.S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", type=int, default=5, help="held-out code_editing prompts")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prediction-depth", type=int, default=SpecConfig().prediction_depth)
    parser.add_argument("--no-llamacpp", action="store_true", help="verispec's systems only")
    parser.add_argument("--json", help="write the per-prompt rows here")
    args = parser.parse_args()
    set_threads(args.threads)
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Vulnerab")[0].strip())
    print(f"python {platform.python_version()}, {args.threads} threads")

    path = files("verispec.bench") / "data" / "editing.jsonl"
    prompts = load_prompts(str(path), ["code_editing"], per_category=args.prompts, split=HELDOUT)
    plain = SpeculativeDecoder.load(args.target, "none")
    default = SpeculativeDecoder.load(args.target, DEFAULT_DRAFTER)
    tuner = default.auto_tuner(cache=True)
    greedy = SamplingConfig(temperature=0)
    spec = SpecConfig(max_new_tokens=args.max_new_tokens, prediction_depth=args.prediction_depth)
    llama = None
    if not args.no_llamacpp:
        from verispec.bench.systems import LlamaCppGenerate

        llama = LlamaCppGenerate("llamacpp-generate", plain.target.source, plain.target.eos_token_ids(), 8192)

    def verispec(decoder, tuner, prediction):
        def run(text):
            start = time.perf_counter()
            result = decoder.generate(text, greedy, spec, seed=0, tuner=tuner, prediction=prediction)
            return time.perf_counter() - start, result.token_ids, result.stats
        return run

    rows = []
    for prompt in prompts:
        code = FENCED.search(prompt.text).group(0)
        systems = {"verispec-plain": verispec(plain, None, None), "verispec-default": verispec(default, tuner, None),
                   "verispec-plain+pred": verispec(plain, None, code),
                   "verispec-default+pred": verispec(default, tuner, code)}
        if llama is not None:
            ids = plain.encode(prompt.text)

            def llamacpp(text, ids=ids):
                run = llama.run(ids, greedy, args.max_new_tokens, 0)
                return run.seconds, run.token_ids, None
            systems = {"llamacpp-generate": llamacpp, **systems}
        row = {"question_id": prompt.question_id, "systems": {}}
        for name, run in systems.items():
            seconds, tokens, stats = run(prompt.text)
            row["systems"][name] = {"seconds": seconds, "tokens": len(tokens), "token_ids": tokens,
                                    **({} if stats is None else {
                                        "passes": stats.target_forward_passes,
                                        "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                                        "rejected_prediction_tokens": stats.rejected_prediction_tokens})}
        reference = row["systems"]["verispec-plain"]["token_ids"]
        for name, got in row["systems"].items():
            got["equal_to_plain"] = got["token_ids"] == reference
        rows.append(row)
        print(f"prompt {prompt.question_id}: " + ", ".join(
            f"{name} {got['seconds']:.2f} s ({got['tokens']} tokens{', ' + str(got['passes']) + ' passes' if 'passes' in got else ''})"
            for name, got in row["systems"].items()), flush=True)

    base = "llamacpp-generate" if llama is not None else "verispec-plain"
    print(f"\n{len(rows)} prompts, greedy, up to {args.max_new_tokens} new tokens; ratios: {base}'s end to end time over "
          "the system's, median over prompts")
    for name in rows[0]["systems"]:
        got = [r["systems"][name] for r in rows]
        ratio = statistics.median(r["systems"][base]["seconds"] / r["systems"][name]["seconds"] for r in rows)
        extra = ""
        if "passes" in got[0]:
            extra = (f", {statistics.median(g['tokens'] / g['passes'] for g in got):.2f} tokens a pass, "
                     f"equal to plain {sum(g['equal_to_plain'] for g in got)}/{len(got)}")
            if any(g["accepted_prediction_tokens"] + g["rejected_prediction_tokens"] for g in got):
                extra += (f", prediction tokens accepted / rejected {sum(g['accepted_prediction_tokens'] for g in got)}"
                          f" / {sum(g['rejected_prediction_tokens'] for g in got)}")
        print(f"  {name:24s} {statistics.median(g['seconds'] for g in got):6.2f} s median, {ratio:5.2f}x {base}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
