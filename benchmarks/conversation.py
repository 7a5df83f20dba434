"""Multi-turn sessions that resend the conversation, as assistants and agents do: `verispec serve` (its defaults) against
llama-cpp-python's OpenAI server on the same GGUF, and a plain verispec server (no drafter, no prefix reuse) whose
answers every verispec answer must equal.

    .venv/bin/python benchmarks/conversation.py --threads 2 --sessions 2

Each session: a coding task, then "add type hints", "add input validation", "rename the variables", each asking for
the whole code back, the conversation resent every turn with the official `openai` client, greedy, streamed. Each
server runs alone (its own process, started and stopped in turn). Reported per server: the median time to the first
token of turns 2-4 and of turn 1, each session's end to end seconds, and the ratio of llama-cpp-python's session time
to verispec's (median over sessions); then whether verispec's answers equal the plain server's. llama-cpp-python's
server needs its extra (`pip install sse_starlette starlette_context pydantic_settings`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import httpx

from server_process import free_port, server

TASKS = [
    "Write a Python function that parses a CSV line into a list of fields, handling quoted fields with commas.",
    "Write a Python class for a bounded least-recently-used cache with get and put methods.",
    "Write a Python function that merges overlapping intervals given as a list of (start, end) pairs.",
]
FOLLOW_UPS = ["Add type hints. Reply with the whole code.", "Add input validation. Reply with the whole code.",
              "Rename the variables to be more descriptive. Reply with the whole code."]


def session(url: str, model: str, task: str, max_tokens: int) -> list[dict]:
    """One session's turns: {first_s, seconds, text} each."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    messages, turns = [{"role": "user", "content": task}], []
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up is not None:
            messages += [{"role": "assistant", "content": turns[-1]["text"]}, {"role": "user", "content": follow_up}]
        start, first, pieces = time.perf_counter(), None, []
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                pieces.append(chunk.choices[0].delta.content)
        turns.append({"first_s": first or 0.0, "seconds": time.perf_counter() - start, "text": "".join(pieces)})
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write every turn here")
    args = parser.parse_args()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags")[0].strip())
    print(f"python {platform.python_version()}, {args.threads} threads, {args.sessions} sessions of 4 turns, "
          f"up to {args.max_tokens} tokens a turn, greedy")
    from verispec.models.loading import load_model

    gguf = load_model(args.target).source
    serve = [sys.executable, "-m", "verispec", "serve", "--target", args.target, "--threads", str(args.threads)]
    servers = {
        "verispec": serve,
        "verispec-plain": serve + ["--draft", "none", "--prefix-cache-bytes", "0"],
        "llama-cpp-python": [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "8192",
                             "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)],
    }
    results: dict[str, list[list[dict]]] = {}
    for name, command in servers.items():
        port = free_port()
        with server(command + ["--port", str(port)], port, f"/tmp/conversation-{name}.log") as url:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            session(url, model, "Say hi.", 8)  # warm up
            results[name] = [session(url, model, task, args.max_tokens) for task in TASKS[: args.sessions]]
        turns = results[name]
        print(f"{name:18s} first token: turn 1 {statistics.median(t[0]['first_s'] for t in turns):.2f} s, turns 2-4 "
              f"{statistics.median(x['first_s'] for t in turns for x in t[1:]):.2f} s (median); sessions "
              + ", ".join(f"{sum(x['seconds'] for x in t):.1f} s" for t in turns), flush=True)
    base = results["llama-cpp-python"]
    for name in ("verispec", "verispec-plain"):
        ratio = statistics.median(sum(x["seconds"] for x in b) / sum(x["seconds"] for x in r)
                                  for b, r in zip(base, results[name]))
        print(f"{name}: session {ratio:.2f}x llama-cpp-python's speed (median over sessions)")
    same = sum(a["text"] == b["text"] for s, p in zip(results["verispec"], results["verispec-plain"])
               for a, b in zip(s, p))
    print(f"verispec answers equal to the plain server's: {same}/{sum(len(s) for s in results['verispec'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
