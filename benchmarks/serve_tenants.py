"""One API key floods `verispec serve`; how long does another key's request wait? Fair admission against the plain
first-come queue, side by side in one run.

    .venv/bin/python benchmarks/serve_tenants.py --flood 24 --tokens 96 --probes 4 --threads 2

Two servers in turn (each `verispec serve` in its own process, two API keys, the default drafter), one with the
default `--key-share` and one with `--key-share 1` (no per-key limit: first come, first served). On each, key A sends
`--flood` requests of `--tokens` tokens at once (ignore_eos, so each makes them all); once they run, key B sends
`--probes` short requests one after another. The report: each probe's latency (request to answer) against the same
probe alone on an idle server, A's answers and refusals, and whether every answer equals the idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import contextmanager

import httpx

from server_process import free_port, server

KEYS = ("flooder:key-of-a", "other:key-of-b")
A, B = {"authorization": "Bearer key-of-a"}, {"authorization": "Bearer key-of-b"}
PROBE = {"prompt": "def add(a, b):\n    return", "max_tokens": 8, "temperature": 0}


@contextmanager
def serve(args, share: float, keys_file: str):
    port = free_port()
    command = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--draft", args.draft,
               "--port", str(port), "--threads", str(args.threads), "--api-keys-file", keys_file,
               "--key-share", str(share), "--max-batch-size", str(args.batch), "--max-queue", str(args.queue)]
    with server(command, port, timeout_s=600) as url:
        yield url


async def round_(url: str, args) -> dict:
    long = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": args.tokens, "ignore_eos": True,
            "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=900) as c:
        alone = []
        for _ in range(args.probes):  # the probe on an idle server
            started = time.monotonic()
            r = await c.post("/v1/completions", json=PROBE, headers=B)
            alone.append((time.monotonic() - started, r.json()["choices"][0]["text"]))
        flood = [asyncio.create_task(c.post("/v1/completions", json=long, headers=A)) for _ in range(args.flood)]
        while True:  # the flood holds rows and queue places before the probes start
            metrics = (await c.get("/metrics", headers=A)).text
            depth = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("verispec_queue_depth "))
            if depth >= 1 or all(t.done() for t in flood):
                break
            await asyncio.sleep(0.05)
        probes = []
        for _ in range(args.probes):
            started = time.monotonic()
            r = await c.post("/v1/completions", json=PROBE, headers=B)
            probes.append((time.monotonic() - started, r.status_code, r.json()["choices"][0]["text"]
                           if r.status_code == 200 else r.json()["error"]["message"]))
        flooded = await asyncio.gather(*flood)
    codes = [r.status_code for r in flooded]
    return {"probe_alone_s": [t for t, _ in alone], "probe_under_flood_s": [t for t, _, _ in probes],
            "probe_status": [s for _, s, _ in probes],
            "probe_same_answer": [text == alone[0][1] for _, _, text in probes],
            "flood_200": codes.count(200), "flood_429": codes.count(429), "flood_other": len(codes) - codes.count(200)
            - codes.count(429)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="suffix")
    ap.add_argument("--flood", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--queue", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--share", type=float, default=0.75, help="the fair server's --key-share")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    keys_file = "/tmp/verispec-bench-keys.txt"
    with open(keys_file, "w") as f:
        f.write("\n".join(KEYS) + "\n")
    results = {}
    for name, share in (("fair (--key-share %g)" % args.share, args.share), ("first come (--key-share 1)", 1.0)):
        with serve(args, share, keys_file) as url:
            results[name] = asyncio.run(round_(url, args))
        r = results[name]
        print(f"{name}: probe alone median {statistics.median(r['probe_alone_s']):.2f} s, under the flood median "
              f"{statistics.median(r['probe_under_flood_s']):.2f} s (max {max(r['probe_under_flood_s']):.2f}), "
              f"statuses {r['probe_status']}, same answers {all(r['probe_same_answer'])}; flood: {r['flood_200']} "
              f"answered, {r['flood_429']} refused 429, {r['flood_other']} other", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
