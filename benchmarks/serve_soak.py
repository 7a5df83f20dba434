"""Soak test of `verispec serve` on loopback: what hostile and careless clients do to a shared server, all at once.

Against an in-process server (127.0.0.1, a free port) it runs, side by side with steady normal traffic:
  - a flood past the queue (answered 429),
  - slow readers (a stream read one chunk a second) and readers that never read,
  - disconnects at every stage (before the request line, inside the headers, inside the body, after sending, in
    the middle of a stream), --disconnects of them in all,
  - clients that send their headers byte by byte (closed by the header timeout),
  - one long prompt among the short ones (its prompt read in chunks: the others' first tokens do not wait for it),
and reports requests served, answers by kind, latency and time-to-first-token percentiles of the normal traffic,
and the server afterwards: running rows, cache rows and reserved cache (all must be 0), the faults it absorbed,
and its resident memory after each round (flat after the first: nothing left behind).

    .venv/bin/python benchmarks/serve_soak.py                       # tiny random models, a minute
    .venv/bin/python benchmarks/serve_soak.py --target qwen2.5-coder-1.5b-instruct --draft none --disconnects 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from verispec.api import SpeculativeDecoder, set_threads
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

SHORT = ["def fib(n):", "Write a short note about caches.", "import os\n\ndef walk(path):", "The quick brown fox"]


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def normal(url: str, body: dict, results: list, kinds: Counter, long: bool = False) -> None:
    """A well-behaved streaming client: records latency and time to first token."""
    start = time.monotonic()
    first = None
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            kinds[f"normal {r.status_code}"] += 1
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {") and '"text": ""' not in line:
                    first = time.monotonic() - start
        if r.status_code == 200:
            results.append({"latency": time.monotonic() - start, "first_token": first if first is not None else 0.0,
                            "long": long})
    except httpx.HTTPError as err:
        kinds[f"normal {type(err).__name__}"] += 1


async def flood(url: str, n: int, kinds: Counter) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8}) for _ in range(n)),
                                  return_exceptions=True)
    for r in rs:
        kinds[f"flood {r.status_code}" if isinstance(r, httpx.Response) else f"flood {type(r).__name__}"] += 1


async def slow_reader(url: str, kinds: Counter, never: bool) -> None:
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 40, "stream": True}) as r:
            kinds[f"{'non-reader' if never else 'slow reader'} {r.status_code}"] += 1
            if never:
                await asyncio.sleep(2)
                return
            async for _ in r.aiter_lines():
                await asyncio.sleep(0.2)
    except httpx.HTTPError as err:
        kinds[f"slow reader {type(err).__name__}"] += 1


async def disconnect(host: str, port: int, stage: int, kinds: Counter) -> None:
    """Open a raw connection and leave at `stage`: 0 before anything, 1 inside the headers, 2 inside the body,
    3 after the request, 4 inside a streamed answer."""
    body = b'{"prompt": "abc", "max_tokens": 30, "stream": true}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    try:
        reader, writer = await asyncio.open_connection(host, port)
        if stage >= 1:
            writer.write(head[: len(head) // 2] if stage == 1 else head)
        if stage >= 2:
            writer.write(body[: len(body) // 2] if stage == 2 else body)
        await writer.drain()
        if stage == 4:
            await asyncio.wait_for(reader.read(200), 10)
        writer.transport.abort()  # a reset, not a polite close
        kinds[f"disconnect stage {stage}"] += 1
    except (OSError, asyncio.TimeoutError) as err:
        kinds[f"disconnect stage {stage} {type(err).__name__}"] += 1


async def trickler(host: str, port: int, kinds: Counter, seconds: float) -> None:
    """Send the headers one byte at a time, a byte every 0.5 s, until the server closes the connection."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            if reader.at_eof() or time.monotonic() - started > seconds:
                break
            await asyncio.sleep(0.5)
        kinds["trickler closed by the server" if reader.at_eof() else "trickler still open"] += 1
    except OSError:
        kinds["trickler closed by the server"] += 1
    finally:
        writer.transport.abort()


async def soak(url: str, args) -> tuple[list, Counter]:
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    rng = random.Random(args.seed)
    results: list = []
    kinds: Counter = Counter()
    long_prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(args.long_words))
    normals = [{"prompt": rng.choice(SHORT), "max_tokens": args.tokens, "temperature": 0} for _ in range(args.requests)]
    normals.insert(len(normals) // 3, {"prompt": long_prompt, "max_tokens": args.tokens, "temperature": 0})
    tasks = []
    for i, body in enumerate(normals):
        tasks.append(asyncio.create_task(normal(url, body, results, kinds, long=body["prompt"] is long_prompt)))
        if i % 4 == 0:
            await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(flood(url, args.flood, kinds)))
    tasks += [asyncio.create_task(slow_reader(url, kinds, never=i % 2 == 1)) for i in range(args.slow)]
    tasks += [asyncio.create_task(trickler(host, port, kinds, args.trickle_seconds)) for _ in range(args.tricklers)]
    sem = asyncio.Semaphore(32)  # disconnects come in waves, not 1,000 sockets at once

    async def one(stage: int) -> None:
        async with sem:
            await disconnect(host, port, stage, kinds)

    tasks += [asyncio.create_task(one(i % 5)) for i in range(args.disconnects)]
    await asyncio.gather(*tasks)
    return results, kinds


def run_soak(decoder: SpeculativeDecoder, args) -> dict:
    """`args.rounds` rounds of the soak against one server; the figures of the last, the memory after each."""
    config = ServeConfig(port=0, max_batch_size=args.batch, max_queue=args.queue, prefill_chunk=args.prefill_chunk,
                         header_timeout=args.header_timeout, send_timeout=args.send_timeout, request_timeout=120)
    with BackgroundServer(decoder, config) as server:
        scheduler = server.app.state.scheduler
        memory = [round(rss_mb(), 1)]
        for _ in range(args.rounds):
            started = time.monotonic()
            results, kinds = asyncio.run(soak(server.url, args))
            took = time.monotonic() - started
            deadline = time.monotonic() + 30
            while (scheduler.running or scheduler.cache_rows() or scheduler.queue_depth) and time.monotonic() < deadline:
                time.sleep(0.1)
            memory.append(round(rss_mb(), 1))
        health = httpx.get(server.url + "/health").json()
        short = [r for r in results if not r["long"]]
        return {
            "seconds": round(took, 1), "normal_requests": args.requests + 1, "normal_served": len(results),
            "answers": dict(sorted(kinds.items())),
            "latency_p50_s": round(percentile([r["latency"] for r in short], 50), 3),
            "latency_p99_s": round(percentile([r["latency"] for r in short], 99), 3),
            "first_token_p50_s": round(percentile([r["first_token"] for r in short], 50), 3),
            "first_token_p99_s": round(percentile([r["first_token"] for r in short], 99), 3),
            "long_prompt_first_token_s": next((round(r["first_token"], 3) for r in results if r["long"]), None),
            "after": {"running": scheduler.running, "cache_rows": scheduler.cache_rows(), "queued": scheduler.queue_depth,
                      "reserved_bytes": scheduler.reserved, "health": health, "faults": dict(scheduler.faults.counts)},
            "rss_mb_after_each_round": memory,
        }


async def stall_probe(url: str, long_prompt: str, short: int, tokens: int) -> dict:
    """`short` streams decode while one long prompt arrives: the longest wait between two of their chunks while
    the long prompt is read, and the long prompt's own time to first token."""
    arrivals: list[list[float]] = [[] for _ in range(short)]
    long_first: list[float] = []

    async def stream(body: dict, times: list[float]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c, \
                c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())

    body = {"prompt": "def fib(n):", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    tasks = [asyncio.create_task(stream(body, times)) for times in arrivals]
    await asyncio.sleep(2.0)  # the short ones are decoding
    sent = time.monotonic()
    await stream({"prompt": long_prompt, "max_tokens": 1, "temperature": 0}, long_first)
    first = long_first[0] - sent
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if sent <= b and a <= sent + first]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"long_prompt_first_token_s": round(first, 2), "others_longest_wait_s": round(max(gaps, default=0.0), 2)}


def run_stall(decoder: SpeculativeDecoder, args) -> list[dict]:
    """The stall probe for each prefill chunk in --stall (0: the whole prompt in one step)."""
    long_prompt = " ".join(random.Random(args.seed).choice(["alpha", "beta", "gamma", "delta"])
                           for _ in range(args.long_words))
    rows = []
    for chunk in (int(c) for c in args.stall.split(",")):
        config = ServeConfig(port=0, max_batch_size=args.batch, prefill_chunk=chunk or 10**9)
        with BackgroundServer(decoder, config) as server:
            result = asyncio.run(stall_probe(server.url, long_prompt, 3, args.tokens * 20))
        rows.append({"prefill_chunk": chunk or "whole prompt", **result})
        print(rows[-1], flush=True)
    return rows


def tiny_decoder() -> SpeculativeDecoder:
    """Tiny random models with the test suite's character tokenizer (no download)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_hf import save_tiny_model_dir

    root = Path(tempfile.mkdtemp(prefix="verispec-soak-"))
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    draft = save_tiny_model_dir(root / "draft", "llama", seed=1)
    return SpeculativeDecoder.load(str(target), str(draft))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model spec (default: tiny random models)")
    ap.add_argument("--draft", default="none", help="draft spec with --target (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=40, help="normal requests (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per normal request (default: %(default)s)")
    ap.add_argument("--long-words", type=int, default=60, help="words of the one long prompt (default: %(default)s)")
    ap.add_argument("--flood", type=int, default=80, help="requests in the flood (default: %(default)s)")
    ap.add_argument("--slow", type=int, default=6, help="slow and non-reading clients (default: %(default)s)")
    ap.add_argument("--tricklers", type=int, default=8, help="byte-by-byte header clients (default: %(default)s)")
    ap.add_argument("--disconnects", type=int, default=1000, help="clients leaving at every stage (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--queue", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=ServeConfig().prefill_chunk)
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--send-timeout", type=float, default=5.0)
    ap.add_argument("--trickle-seconds", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds against one server; memory is read after each "
                    "(the first warms the server up) (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall", metavar="CHUNKS", help="instead of the soak: how long one long prompt stalls three "
                    "decoding streams, for each prefill chunk given (e.g. 0,64,256; 0: the whole prompt in one step)")
    ap.add_argument("--out", help="write the summary as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    set_threads(args.threads)
    if args.target:
        decoder = SpeculativeDecoder.load(args.target, args.draft)
    else:
        decoder = tiny_decoder()
        args.long_words = min(args.long_words, 15)  # the tiny models' context window is 128 tokens
    if args.stall:
        rows = run_stall(decoder, args)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return 0
    summary = run_soak(decoder, args)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if clean(summary) else 1


def clean(summary: dict) -> bool:
    """Nothing left behind, the server healthy, and no 5xx but the 503 of the concurrency limit (a dead decoding
    thread also answers 503, but then /health says so)."""
    after = summary["after"]
    left = after["running"] + after["cache_rows"] + after["queued"] + after["reserved_bytes"]
    errors = [kind for kind in summary["answers"] if kind.split()[-1].startswith("5") and kind.split()[-1] != "503"]
    return left == 0 and not errors and after["health"] == {"status": "ok"}


if __name__ == "__main__":
    raise SystemExit(main())
