"""A verispec server sent hostile requests, each beside a sentinel request that must still get its solo answer.

Run as a script (tests/test_serve_hostile.py runs it in a subprocess, so a request that ends the process fails the
test instead of the test run): starts a server on a tiny model whose vocabulary spells JSON, drafting with suffix
decoding (the server's default drafter), sends each case, prints one JSON line per case, then one with the server's
state afterwards.

    python tests/serve_hostile.py DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

import constraint_bombs as bombs
from verispec.config import Constraint

SENTINEL = {"prompt": "hello there", "max_tokens": 16, "temperature": 0}


def formatted(constraint) -> dict:
    """A completion request asking for this constraint as its response_format."""
    if constraint.kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(constraint.source)}}
    else:
        fmt = {"type": constraint.kind, constraint.kind: constraint.source}
    return {"prompt": "answer:", "max_tokens": 8, "temperature": 0, "response_format": fmt}


def short_ref_chain(n: int) -> dict:
    """A $ref chain with short names: 4,000 deep in about 100 KB, as a hostile client sent it."""
    defs = {f"{i:x}": {"$ref": f"#/$defs/{i + 1:x}"} for i in range(n)}
    defs[f"{n:x}"] = {"type": "integer"}
    return {"$ref": "#/$defs/0", "$defs": defs}


def cases() -> list[tuple[str, list[bytes], set[int]]]:
    """(name, bodies sent at once beside the sentinel, statuses each may get)."""
    out: list[tuple[str, list[bytes], set[int]]] = []

    def add(name, bodies, statuses={400}):
        out.append((name, [b if isinstance(b, bytes) else json.dumps(b).encode() for b in bodies], statuses))

    ref = {"prompt": "x", "max_tokens": 8, "response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": short_ref_chain(4000)}}}
    add("$ref chain 4,000 deep", [ref])
    for name, depth in (("allof", 2000), ("prop", 1000), ("cycle", 2), ("lark", 3000), ("terminal", 3000),
                        ("lark-json", 1000), ("gbnf", 3000), ("regex", 3000), ("repetition", 1000),
                        ("alternatives", 20000)):
        add(f"{name} {depth}", [formatted(bombs.BOMBS[name](depth)[0])])
    add("four 900 KB GBNF literals at once", [formatted(Constraint("grammar", 'root ::= "' + "x" * 900_000 + '"'))] * 4)
    add("regex with a lone surrogate", [b'{"prompt": "x", "max_tokens": 4, "response_format": {"type": "regex", '
                                        b'"regex": "a\\ud800"}}'])
    add("model with a lone surrogate", [b'{"prompt": "x", "max_tokens": 4, "model": "gpt\\ud800"}'], {404})
    add("prompt with a lone surrogate", [b'{"prompt": "x\\udfff", "max_tokens": 4}'])
    add("a schema nested past the parser", [b'{"prompt": "x", "max_tokens": 4, "response_format": {"type": '
                                            b'"json_schema", "json_schema": {"schema": ' + b'{"items": ' * 3000 +
                                            b"{}" + b"}" * 3000 + b"}}}"])
    add("a valid schema", [formatted(bombs.property_chain(3)[0])], {200})
    return out


async def send(url: str, bodies: list[bytes]) -> tuple[list[httpx.Response], httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        bad = [c.post("/v1/completions", content=b, headers={"content-type": "application/json"}) for b in bodies]
        *answers, good = await asyncio.gather(*bad, c.post("/v1/completions", json=SENTINEL))
        return answers, good


def main(folder: Path) -> None:
    from tiny_hf import save_tiny_model_dir

    from verispec import SpeculativeDecoder
    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    target = save_tiny_model_dir(folder / "target", "llama", seed=0, vocab_chars=bombs.JSON_CHARS)
    decoder = SpeculativeDecoder.load(str(target), "suffix")
    with BackgroundServer(decoder, ServeConfig(port=0, max_batch_size=8)) as server:
        solo = httpx.post(server.url + "/v1/completions", json=SENTINEL, timeout=60).json()["choices"][0]["text"]
        for name, bodies, statuses in cases():
            answers, good = asyncio.run(send(server.url, bodies))
            record = {"case": name, "statuses": [r.status_code for r in answers], "expected": sorted(statuses),
                      "errors": [r.json().get("error", {}).get("message", "")[:300] if r.status_code != 200 else ""
                                 for r in answers],
                      "params": [r.json().get("error", {}).get("param") if r.status_code != 200 else None
                                 for r in answers],
                      "sentinel": good.status_code == 200 and good.json()["choices"][0]["text"] == solo}
            if 200 in record["statuses"]:
                record["outputs"] = [r.json()["choices"][0]["text"] for r in answers if r.status_code == 200]
            print(json.dumps(record), flush=True)
        scheduler = server.app.state.scheduler
        health = httpx.get(server.url + "/health").json()
        print(json.dumps({"after": True, "health": health, "faults": dict(scheduler.faults.counts),
                          "running": scheduler.running, "reserved": scheduler.reserved}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]))
