"""Load test of `verispec serve` on loopback: N concurrent clients, mixed prompt lengths and settings.

Runs every configuration in {batching on, off} x {speculation on, off} against an in-process
server on 127.0.0.1 (a free port), and reports per configuration: requests/s, generated tokens/s,
latency and time-to-first-token percentiles, and two checks:
  - mismatches: requests whose tokens differ from the same request in the batching-off run of the
    same speculation setting (every request is seeded or greedy, so batching must not change them; with
    --auto-k no request names K, the server chooses it by load, and a seeded sampled request's draws follow K,
    so only greedy ones count);
  - leaked_cache_rows: KV cache rows still held after the run (must be 0).
Bounded: a fixed number of requests, a per-request timeout and a time limit per configuration.

`--prompts bench` replaces the six built-in prompts (which repeat, so a drafter that learns from earlier requests'
outputs copies whole answers) with held-out bench prompts, each request a different one, sent as chat messages; and
`--clients 1,2,4,8,16` sweeps concurrency (`--batching on` skips the one-at-a-time runs, and then the mismatch check).

    python benchmarks/serve_load.py --target <model> --draft <model> --clients 8 --requests 32 --out load.json
    python benchmarks/serve_load.py --target <model> --draft suffix --auto-k --prompts bench --batching on \
        --clients 1,2,4,8,16 --requests 24 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx

from verispec.api import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

PROMPTS = [
    "def fib(n):",
    "Write a short note about caches.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "List three prime numbers and explain why each one is prime, step by step, in plain words.",
    "Translate to French: the weather is nice today, and we are going to the beach after lunch.",
    "import numpy as np\n\ndef mean(xs):\n    return",
]


def bench_prompts(seed: int) -> list[str]:
    """The bench's held-out prompts (Spec-Bench beside the repository, the shipped editing and structured ones), in a
    seeded order: each request of a workload gets the next one, so none repeats until all are used."""
    from verispec.datasets import DEFAULT_PROMPTS, EDITING_PROMPTS, HELDOUT, load_prompts

    paths = [p for p in (DEFAULT_PROMPTS, EDITING_PROMPTS) if p.is_file()]
    prompts = [p.text for p in load_prompts(paths, split=HELDOUT)]
    random.Random(seed).shuffle(prompts)
    return prompts


def workload(num_requests: int, max_new_tokens: list[int], seed: int, name_k: bool = True,
             prompts: list[str] | None = None) -> list[dict]:
    """Mixed requests: prompts, lengths, greedy or seeded sampling, K (unless name_k is False: the server's tuner
    chooses), streaming or not. With `prompts`, request i asks prompts[i] (cycling) as a chat message."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.choice(max_new_tokens), "seed": seed + i,
                "temperature": rng.choice([0.0, 0.0, 0.8]), "speculative": {"K": rng.choice([2, 4, 6])}}
        if not name_k:
            body["speculative"] = {}
        if body["temperature"]:
            body["top_p"] = 0.95
        if prompts:
            del body["prompt"]
            body["messages"] = [{"role": "user", "content": prompts[i % len(prompts)]}]
        requests.append({"body": body, "stream": rng.random() < 0.5})
    return requests


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, request: dict, speculate: bool) -> dict:
    body = dict(request["body"])
    if not speculate:
        body["speculative"] = {"drafter": "none"}
    start = time.perf_counter()
    first = None
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not request["stream"]:
        response = await client.post(path, json=body)
        response.raise_for_status()
        out = response.json()
        choice = out["choices"][0]
        return {"text": choice["message"]["content"] if chat else choice["text"],
                "tokens": out["usage"]["completion_tokens"], "latency": time.perf_counter() - start, "ttft": None}
    text, tokens = [], 0
    body.update(stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"]:
                if first is None:
                    first = time.perf_counter() - start
                choice = chunk["choices"][0]
                text.append((choice["delta"].get("content") or "") if chat else choice["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"text": "".join(text), "tokens": tokens, "latency": time.perf_counter() - start, "ttft": first}


async def drive(url: str, requests: list[dict], clients: int, speculate: bool, timeout_s: float,
                time_limit_s: float) -> tuple[list[dict | None], float]:
    """Run `requests` with `clients` concurrent clients; returns results (None: failed) and wall time."""
    results: list[dict | None] = [None] * len(requests)
    pending = iter(range(len(requests)))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in pending:
            try:
                results[i] = await one_request(client, requests[i], speculate)
            except (httpx.HTTPError, RuntimeError) as err:
                print(f"request {i} failed: {err}", file=sys.stderr)

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(clients))), time_limit_s)
    return results, time.perf_counter() - start


def run_config(decoder: SpeculativeDecoder, requests: list[dict], clients: int, batching: bool, speculate: bool,
               timeout_s: float, time_limit_s: float, auto_k: bool = False) -> tuple[dict, list[dict | None]]:
    config = ServeConfig(port=0, max_batch_size=clients if batching else 1, max_queue=max(64, len(requests)),
                         request_timeout=timeout_s, auto_k=auto_k)
    with BackgroundServer(decoder, config) as server:
        results, wall = asyncio.run(drive(server.url, requests, clients, speculate, timeout_s, time_limit_s))
        leaked = server.app.state.scheduler.cache_rows()
    done = [r for r in results if r is not None]
    latencies = [r["latency"] for r in done]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in done)
    summary = {
        "batching": batching, "speculation": speculate, "auto_k": auto_k and speculate, "clients": clients, "requests": len(requests),
        "completed": len(done), "wall_seconds": round(wall, 3),
        "requests_per_second": round(len(done) / wall, 3), "tokens_per_second": round(tokens / wall, 2),
        **{f"latency_p{q}": round(percentile(latencies, q), 3) for q in (50, 90, 99)},
        "latency_mean": round(statistics.fmean(latencies), 3) if latencies else float("nan"),
        **{f"ttft_p{q}": round(percentile(ttfts, q), 3) for q in (50, 90)},
        "leaked_cache_rows": leaked,
    }
    return summary, results


def run_load(decoder: SpeculativeDecoder, clients: int = 8, num_requests: int = 32,
             max_new_tokens: tuple[int, ...] = (16, 64), seed: int = 0, timeout_s: float = 600.0,
             time_limit_s: float = 1800.0, speculation: tuple[bool, ...] = (True, False), auto_k: bool = False,
             prompts: list[str] | None = None, batchings: tuple[bool, ...] = (False, True)) -> list[dict]:
    """Every configuration's summary; `mismatches` compares each batched run with its batching-off run (None where
    that run was not asked for)."""
    requests = workload(num_requests, list(max_new_tokens), seed, name_k=not auto_k, prompts=prompts)
    summaries = []
    for speculate in speculation:
        reference = None
        for batching in batchings:
            summary, results = run_config(decoder, requests, clients, batching, speculate, timeout_s, time_limit_s,
                                          auto_k)
            if reference is None and not batching:
                reference = results
            if reference is None:
                summary["mismatches"], summary["mismatched_requests"] = None, []
                summaries.append(summary)
                print(f"clients {clients}, batching on, speculation {'on' if speculate else 'off'}: "
                      f"{summary['completed']}/{summary['requests']} done, {summary['tokens_per_second']} tok/s, "
                      f"latency p50 {summary['latency_p50']} s", file=sys.stderr, flush=True)
                continue
            differing = [i for i, (a, b) in enumerate(zip(results, reference)) if a is None or b is None or a["text"] != b["text"]]
            if auto_k and speculate:  # K then follows load, and a seeded sampled request's draws follow K: its
                # tokens are the target's distribution either way, the same tokens only when greedy
                sampled = [i for i in differing if requests[i]["body"]["temperature"] and results[i] and reference[i]]
                summary["sampled_differing"] = len(sampled)
                differing = [i for i in differing if i not in sampled]
            summary["mismatches"] = len(differing)
            summary["mismatched_requests"] = [{"request": requests[i], "alone": reference[i] and reference[i]["text"],
                                               "here": results[i] and results[i]["text"]} for i in differing]
            summaries.append(summary)
            print(f"batching {'on' if batching else 'off'}, speculation {'on' if speculate else 'off'}: "
                  f"{summary['completed']}/{summary['requests']} done, {summary['tokens_per_second']} tok/s, "
                  f"latency p50 {summary['latency_p50']} s, {summary['mismatches']} mismatches", file=sys.stderr, flush=True)
    return summaries


def markdown(summaries: list[dict]) -> str:
    cols = ["clients", "batching", "speculation", "auto_k", "completed", "requests_per_second", "tokens_per_second", "latency_p50",
            "latency_p90", "latency_p99", "ttft_p50", "mismatches", "leaked_cache_rows"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(s[c]) for c in cols) + " |" for s in summaries]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="target model spec (as for verispec generate)")
    parser.add_argument("--draft", required=True, help="draft model spec, 'ngram' or 'none'")
    parser.add_argument("--clients", default="8", help="concurrent clients, or several comma-separated to sweep "
                        "(default: %(default)s)")
    parser.add_argument("--prompts", choices=["builtin", "bench"], default="builtin",
                        help="six built-in prompts that repeat, or held-out bench prompts, none repeated (default: "
                        "%(default)s)")
    parser.add_argument("--batching", choices=["both", "on"], default="both",
                        help="run with batching off too (the mismatch check's reference) or only on (default: "
                        "%(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="requests per configuration (default: %(default)s)")
    parser.add_argument("--max-new-tokens", default="16,64", help="comma-separated lengths mixed (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="per-configuration limit, s (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--speculation", choices=["both", "on", "off"], default="both",
                        help="run the configurations with speculation on, off or both (default: %(default)s)")
    parser.add_argument("--auto-k", action="store_true", help="the server chooses K per step from measured costs "
                        "(ServeConfig.auto_k) in the speculation-on configurations")
    parser.add_argument("--out", help="write the summaries as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    decoder = SpeculativeDecoder.load(args.target, args.draft)
    lengths = tuple(int(x) for x in args.max_new_tokens.split(","))
    speculation = {"both": (True, False), "on": (True,), "off": (False,)}[args.speculation]
    prompts = bench_prompts(args.seed) if args.prompts == "bench" else None
    batchings = (True,) if args.batching == "on" else (False, True)
    summaries = []
    for clients in (int(x) for x in args.clients.split(",")):
        summaries += run_load(decoder, clients, args.requests, lengths, args.seed, args.timeout, args.time_limit,
                              speculation, args.auto_k, prompts, batchings)
    print(markdown(summaries))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summaries, f, indent=2)
    bad = any(s["mismatches"] or s["leaked_cache_rows"] or s["completed"] != s["requests"] for s in summaries)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
