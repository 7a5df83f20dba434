"""Prompt processing (prefill) speed: tokens per second reading prompts of 128 / 512 / 2,048 tokens, verispec's
native runner on each kernel path this CPU has, beside llama.cpp's (when llama-cpp-python is installed), same GGUF,
same threads, in one run:

    .venv/bin/python benchmarks/prefill.py --threads 2 --lengths 128,512,2048 --repeats 3 --json out.json

A prefill is one pass over the prompt that keeps the last position's logits (what time to first token waits
for). Each figure is the median of --repeats passes on a fresh cache after one warm-up pass; prompts are random
token ids (the speed of a pass does not depend on which tokens it reads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def timed_prefill(runner, ids: list[int], repeats: int) -> float:
    """Median seconds of one pass over `ids` on a fresh state (after a warm-up pass)."""
    runner.forward(runner.new_state(1), [ids], [1])
    times = []
    for _ in range(repeats):
        state = runner.new_state(1)
        started = time.perf_counter()
        runner.forward(state, [ids], [1])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from verispec.api import set_threads
    from verispec.errors import VerispecError
    from verispec.models import load_model
    from verispec.models.gguf import native

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="", help="kernel paths to measure (default: every SIMD path this CPU has)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    try:
        model = load_model(args.model, backend="native")
    except VerispecError as e:  # an unknown name or file: its one line, as the CLI says it
        ap.error(str(e))
    runner = model.make_runner()
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, min(runner.vocab_size, 100_000), n).tolist() for n in lengths}
    best = native.path()
    paths = args.paths.split(",") if args.paths else [p for p in ("avx512-vnni", "amx") if native.set_path(p) == p]
    rows: dict[str, dict[int, float]] = {}
    for path in paths:
        if native.set_path(path) != path:
            ap.error(f"this CPU cannot run the {path} kernel path")
        rows[f"verispec native ({path})"] = {n: n / timed_prefill(runner, prompts[n], args.repeats) for n in lengths}
        print(f"{path:12s}", "  ".join(f"{n}: {v:7.1f} tok/s" for n, v in rows[f'verispec native ({path})'].items()),
              flush=True)
    native.set_path(best)
    from verispec.models.runners.llamacpp import LlamaCppRunner, llamacpp_available

    if llamacpp_available():
        llama = LlamaCppRunner(model.source, context_window=max(lengths) + 16, threads=args.threads)
        rows["llama.cpp"] = {n: n / timed_prefill(llama, prompts[n], args.repeats) for n in lengths}
        print(f"{'llama.cpp':12s}", "  ".join(f"{n}: {v:7.1f} tok/s" for n, v in rows["llama.cpp"].items()))
    print("\n| runner | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, speeds in rows.items():
        cells = [f"{v:.1f} tok/s" + (f" ({v / rows['llama.cpp'][n]:.2f}x)" if "llama.cpp" in rows and name != "llama.cpp"
                                      else "") for n, v in speeds.items()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "tokens_per_second": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
