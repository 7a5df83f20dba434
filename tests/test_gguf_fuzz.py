"""Reliability: thousands of damaged variants of a small valid GGUF file (tests/gguf_fuzz.py: every truncation
inside the header and metadata and a sample in the tensor data, every header number set to edge values, the
configuration's fields set to what the kernels cannot run, seeded random bytes) each either load (and run a
forward pass) or stop with one VerispecError line naming the file: never a signal, never a traceback.

The variants are loaded in subprocesses (so a signal is seen), many per process, two processes at a time;
after a crash a fresh process goes on past the variant that crashed. Offline, about 10 s on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gguf_fuzz import base_layout
from tiny_gguf import T, write_tiny_gguf

DRIVER = str(Path(__file__).resolve().parent / "gguf_fuzz.py")
PROCESSES = 2


def run_driver(base: Path, part: int, work: Path) -> tuple[list[dict], list[str]]:
    """Every variant i with i % PROCESSES == part: their outcomes, and one line per crash."""
    rows, crashes, first = [], [], part
    while True:
        done = subprocess.run([sys.executable, DRIVER, str(base), str(first), str(PROCESSES), str(work)],
                              capture_output=True, text=True, timeout=300)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        rows += [line for line in lines if "i" in line]
        if done.returncode == 0 and lines and lines[-1].get("done"):
            return rows, crashes
        crashed = (rows[-1]["i"] + PROCESSES) if rows and rows[-1]["i"] >= first else first
        crashes.append(f"variant {crashed}: the process ended with status {done.returncode} "
                       f"({' / '.join(done.stderr.strip().splitlines()[-3:])[:300]})")
        first = crashed + PROCESSES


def test_damaged_gguf_files_load_or_fail_in_one_line_never_crash(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", types=(T.Q8_0,), hidden=64, heads=4, kv_heads=2, ffn=128,
                           vocab=64, layers=1)
    base = tmp_path / "base.gguf"
    base.write_bytes(base_layout(tiny).build())
    with ThreadPoolExecutor(PROCESSES) as pool:
        parts = list(pool.map(lambda part: run_driver(base, part, tmp_path), range(PROCESSES)))
    rows = sorted((row for part, _ in parts for row in part), key=lambda row: row["i"])
    crashes = [crash for _, part in parts for crash in part]
    counts = Counter(row["outcome"] for row in rows)
    tried = len(rows) + len(crashes)
    summary = (f"{tried} variants tried: {counts['error']} clean errors, {counts['ok']} loaded and ran, "
               f"{len(crashes)} crashes, {counts['traceback']} tracebacks")
    tracebacks = [f"{row['name']}: {row['detail']}" for row in rows if row["outcome"] == "traceback"]
    print(summary)  # shown with pytest -rP
    assert not crashes, f"{summary}; crashes: {crashes[:5]}"
    assert not tracebacks, f"{summary}; tracebacks: {tracebacks[:5]}"
    assert [row["i"] for row in rows] == list(range(tried)), summary  # every variant reported once
    assert rows[0]["name"] == "the base file" and rows[0]["outcome"] == "ok", f"{summary}; {rows[0]}"
    assert tried > 3000 and counts["error"] > 2500 and counts["ok"] > 50, summary
