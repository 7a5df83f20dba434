"""The static-cache runner on the CPU: plain decoding and pass costs, dynamic runner vs static runner (eager and
compiled), same model, side by side.

    .venv/bin/python benchmarks/static_cpu.py --model qwen2.5-coder-0.5b-instruct --tokens 64 --threads 2

The torch route (float32, the GGUF dequantized once). Each runner decodes the same prompt greedily (one-token
passes) after a warm-up that compiles the widths in use; then a pass over 1, 2, 4 and 8 tokens after the prompt
(median of 7). Tokens must be the same for all three.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode(runner, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    state = runner.new_state(1)
    logits = runner.forward(state, [prompt], [1])[0, 0]
    out, start = [], time.perf_counter()
    for _ in range(tokens):
        out.append(int(logits.argmax()))
        logits = runner.forward(state, [[out[-1]]], [1])[0, 0]
    return out, time.perf_counter() - start


def pass_cost(runner, prompt: list[int], k: int) -> float:
    times = []
    for _ in range(8):
        state = runner.new_state(1)
        runner.forward(state, [prompt], [1])
        start = time.perf_counter()
        runner.forward(state, [list(range(100, 100 + k))], [k])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from verispec.models.loading import load_model
    from verispec.models.runners.hf import ModelRunner
    from verispec.models.runners.static import StaticRunner

    model = load_model(args.model, "float32", "dense", "torch").model
    prompt = list(range(1000, 1040))
    runners = {"dynamic (ModelRunner)": ModelRunner(model), "static, eager": StaticRunner(model, 1024, compile=False),
               "static, compiled": StaticRunner(model, 1024, compile=True)}
    results = {}
    for name, runner in runners.items():
        start = time.perf_counter()
        decode(runner, prompt, 4)
        [pass_cost(runner, prompt, k) for k in (1, 2, 4, 8)]  # warm-up: compiles every width used below
        warm = time.perf_counter() - start
        tokens, seconds = decode(runner, prompt, args.tokens)
        costs = {k: pass_cost(runner, prompt, k) for k in (1, 2, 4, 8)}
        results[name] = tokens
        print(f"{name:24} {args.tokens / seconds:6.2f} tok/s  passes over 1/2/4/8 tokens "
              + " / ".join(f"{1000 * c:.1f}" for c in costs.values()) + f" ms  (warm-up {warm:.0f} s)", flush=True)
    first = next(iter(results.values()))
    print("same tokens:", all(t == first for t in results.values()))


if __name__ == "__main__":
    main()
