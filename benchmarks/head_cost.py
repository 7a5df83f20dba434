"""What a drafted token costs next to a target pass, per system of a `verispec bench` run.

    .venv/bin/python benchmarks/head_cost.py artifacts/bench-heads/bench.json

For each system that drafted: the draft's seconds per drafted token and the target's seconds per pass, summed
over the run's prompts (the target's include each prompt's first pass, which reads the whole prompt), and the
drafted token's cost as a share of one decoding pass of plain decoding (verispec-plain's median milliseconds per
token after the first output): the issue's budget for heads is <= 10% of a pass per drafted token.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    runs = json.load(open(path))["runs"]
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for run in runs:
        stats = totals[run["system"]]
        for key in ("draft_seconds", "target_seconds", "draft_tokens", "target_forward_passes"):
            stats[key] += run["stats"][key]
    plain = sorted(1000 / r["decode_tokens_per_second"] for r in runs if r["system"] == "verispec-plain"
                   and r["decode_tokens_per_second"])
    one_pass = plain[len(plain) // 2] if plain else float("nan")
    print(f"plain decoding: {one_pass:.2f} ms per token (median over {len(plain)} prompts)")
    print(f"{'system':34} {'ms / drafted token':>19} {'ms / target pass':>17} {'share of a pass':>16}")
    for system, s in totals.items():
        if not s["draft_tokens"]:
            continue
        draft = 1000 * s["draft_seconds"] / s["draft_tokens"]
        target = 1000 * s["target_seconds"] / s["target_forward_passes"]
        print(f"{system:34} {draft:19.2f} {target:17.2f} {draft / one_pass:16.1%}")


if __name__ == "__main__":
    main(sys.argv[1])
