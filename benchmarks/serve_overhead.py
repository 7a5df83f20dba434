"""What the server costs one request: the same prompt decoded by the Python API (what `verispec generate` runs) and
through `verispec serve` (its own process, as users run it: HTTP, the scheduler thread), streamed and answered in
one piece, alternating, in one run.

    .venv/bin/python benchmarks/serve_overhead.py --draft none --tokens 256 --repeats 5 --threads 2
    .venv/bin/python benchmarks/serve_overhead.py --draft qwen2.5-coder-0.5b-instruct --tokens 256 --repeats 5

The prompt is a HumanEval-style completion (a function signature and docstring, no chat template), greedy, with
stop_at_eos off so every run makes exactly --tokens tokens. For each way the script reports decoding speed,
(tokens - 1) / (last token - first token), and end-to-end speed, tokens / (answer - request), as medians over the
repeats, and the server's ratios to the API. `--in-process` runs the server in this process instead (a thread
beside the client: the GIL and the 2 cores are then shared with the client's own work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import httpx

from server_process import free_port, server

from verispec.api import SpeculativeDecoder, set_threads
from verispec.config import SamplingConfig, SpecConfig
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

PROMPT = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
'''


def api_run(decoder: SpeculativeDecoder, tokens: int, k: int) -> dict:
    times = []
    started = time.perf_counter()
    for event, _ in decoder.stream(PROMPT, SamplingConfig(temperature=0), spec(tokens, k), chat=False):
        times.extend([time.perf_counter()] * len(event.committed))
    return timing(started, times)


def server_run(url: str, tokens: int, k: int, drafting: bool, stream: bool = True) -> dict:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": stream, "ignore_eos": True,
            "speculative": {"K": k} if drafting else {"drafter": "none"}}
    times, text = [], []
    started = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        if not stream:
            r = client.post(url + "/v1/completions", json=body)
            out = timing(started, [time.perf_counter()])
            out["text"] = r.json()["choices"][0]["text"]
            return out
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
                    text.append(chunk["choices"][0]["text"])
    out = timing(started, times)
    out["text"] = "".join(text)
    return out


@contextmanager
def serve_process(args):
    """`verispec serve` in a process of its own on a free port; yields its URL once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--draft", args.draft,
               "--port", str(port), "--threads", str(args.threads), "--max-batch-size", "1"]
    with server(command, port, timeout_s=600) as url:
        yield url


@contextmanager
def serve_thread(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, max_batch_size=1)) as background:
        yield background.url


def spec(tokens: int, k: int) -> SpecConfig:
    return SpecConfig(num_draft_tokens=k, max_new_tokens=tokens, stop_at_eos=False)


def timing(started: float, times: list[float]) -> dict:
    return {"first_s": times[0] - started, "end_to_end_s": times[-1] - started,
            "decode_s": times[-1] - times[0], "events": len(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="none", help="draft spec, 'ngram' or 'none' (plain decoding)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--in-process", action="store_true", help="serve from a thread of this process")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, args.draft)
    drafting = not decoder.drafter.traits.plain
    expected = decoder.generate(PROMPT, SamplingConfig(temperature=0), spec(args.tokens, args.k), chat=False).text
    rows: dict[str, list[dict]] = {"api": [], "server streamed": [], "server one piece": []}
    with (serve_thread(decoder) if args.in_process else serve_process(args)) as url:
        server_run(url, 8, args.k, drafting)  # warm up the HTTP path
        for repeat in range(args.repeats):
            rows["api"].append(api_run(decoder, args.tokens, args.k))
            for way, stream in (("server streamed", True), ("server one piece", False)):
                row = server_run(url, args.tokens, args.k, drafting, stream)
                if row.pop("text") != expected:
                    raise SystemExit(f"the {way} answer differs from the API's")
                rows[way].append(row)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{way} {args.tokens / runs[-1]['end_to_end_s']:.2f}"
                                                     for way, runs in rows.items()) + " tok/s end to end", flush=True)
    summary = {way: {"end_to_end_tokens_per_second": statistics.median(args.tokens / r["end_to_end_s"] for r in runs),
                     "first_token_s": statistics.median(r["first_s"] for r in runs)} for way, runs in rows.items()}
    base = summary["api"]["end_to_end_tokens_per_second"]
    ratios = {way: s["end_to_end_tokens_per_second"] / base for way, s in summary.items() if way != "api"}
    print(f"\n{args.target}, draft {args.draft}, {args.tokens} tokens, {args.threads} threads, median of {args.repeats}:")
    for way, s in summary.items():
        print(f"  {way:16s} {s['end_to_end_tokens_per_second']:6.2f} tok/s end to end"
              + (f" ({ratios[way]:.3f} of the API)" if way in ratios else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": rows, "server_over_api": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
