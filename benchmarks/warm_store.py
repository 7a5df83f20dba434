"""How much a suffix store of the target's earlier answers lifts suffix decoding where little is copied.

A one-shot `verispec generate` starts suffix decoding empty: on prose it finds nothing to copy. A server's store
fills with its own answers as it runs, and `--draft suffix:FILE` keeps one across processes. This measures what
such a store is worth on held-out prompts: it fills a store with the target's greedy answers to Spec-Bench's TRAIN
prompts (even question ids, first turns; the bench's held-out split never sees them), then runs `verispec bench
--split heldout` with verispec-plain and verispec-suffix-auto, without the store and with it (`--draft
suffix:FILE`: each run reads it and never writes it), in turns for `--rounds` rounds, and prints tokens per target
pass and the decoding speedup over plain decoding per category, each run against its own plain decoding:

    .venv/bin/python benchmarks/warm_store.py --out artifacts/warm_store --answers 240 --per-category 3 --rounds 2

The store (`store.suffix`) and each bench's folder are written under --out; an existing store is used as it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from verispec.datasets import DEFAULT_PROMPTS

CATEGORIES = "mt_bench,translation,summarization,qa,math_reasoning,rag"  # Spec-Bench's own six
SYSTEMS = "verispec-plain,verispec-suffix-auto"


def build_store(path: Path, answers: int, target: str, threads: int, batch: int) -> None:
    """The target's greedy answers (128 tokens at most) to the first `answers` TRAIN prompts, joined to the store."""
    from verispec.api import SpeculativeDecoder, set_threads
    from verispec.config import SamplingConfig, SpecConfig

    set_threads(threads)
    rows = [json.loads(line) for line in Path(DEFAULT_PROMPTS).read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows if r["question_id"] % 2 == 0][:answers]
    decoder = SpeculativeDecoder.load(target=target, draft=f"suffix:{path}")
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        out = decoder.generate_batch(prompts[i : i + batch], SamplingConfig(temperature=0), SpecConfig(max_new_tokens=128))
        tokens += sum(len(o.token_ids) for o in out)
        print(f"store: {i + len(out)}/{len(prompts)} answers, {tokens} tokens, "
              f"{tokens / (time.perf_counter() - start):.1f} tokens/s", flush=True)
    decoder.drafter.retire_all()
    if not decoder.drafter.flush_store(60.0):
        sys.exit(f"the store {path} could not be written")


def bench(out: Path, store: Path | None, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "verispec", "bench", "--split", "heldout", "--per-category",
               str(args.per_category), "--max-new-tokens", "128", "--threads", str(args.threads), "--categories",
               CATEGORIES, "--systems", SYSTEMS, "--target", args.target, "--out", str(out)]
    if store is not None:
        command += ["--draft", f"suffix:{store}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())["summary"]["verispec-suffix-auto"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("artifacts/warm_store"))
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--answers", type=int, default=240, help="TRAIN prompts answered into the store")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="answers decoded together while filling the store")
    args = p.parse_args()
    if min(args.answers, args.per_category, args.rounds, args.threads, args.batch) < 1:
        sys.exit("--answers, --per-category, --rounds, --threads and --batch must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "store.suffix"
    if not store.exists():
        build_store(store, args.answers, args.target, args.threads, args.batch)
    rows = []
    for r in range(1, args.rounds + 1):
        for name, path in (("empty", None), ("warm", store)):
            summary = bench(args.out / f"{name}-{r}", path, args)
            rows.append((f"{name}, round {r}", summary))
    categories = CATEGORIES.split(",") + ["all"]
    print("\ntokens per target pass / decoding speedup over plain decoding (verispec-suffix-auto)")
    print("| store | " + " | ".join(categories) + " |")
    print("|---|" + "---|" * len(categories))
    for name, summary in rows:
        cells = [f"{summary[c]['tokens_per_target_pass']:.2f} / {summary[c]['decode_speedup']['verispec-plain']:.2f}x"
                 for c in categories]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
