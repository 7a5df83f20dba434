"""What verifying a batch's greedy chain rows together costs against verifying them one by one (`verispec.step`).

The pass's logits are random, of the default target's vocabulary (151,936 ids); each row carries a chain draft of K
tokens. "one by one" is `StepRules.verify_one` per row (the step before the batched path: an amax, an argmax and a
read of the device per row); "together" is `StepRules.verify_rows` (one amax and argmax over the rows, one read).
Both give the same verdicts (checked here too). Medians of --repeats, per step, in milliseconds.

    .venv/bin/python benchmarks/verify_batch.py --rows 1 8 --k 4 --repeats 200 [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.core.drafter import Draft
from verispec.core.sequence import Sequence
from verispec.step import StepRules


def timed(work, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(max_new_tokens=64)
    rules = StepRules(set())
    print(f"{'rows':>5} {'one by one (ms)':>16} {'together (ms)':>14} {'ratio':>6}")
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        logits = torch.randn(rows, args.k + 1, args.vocab, generator=gen).to(device)  # (B, K + 1, V)
        best = logits.argmax(-1).cpu()  # (B, K + 1)
        drafts = [Draft(best[b, : args.k].clone()) for b in range(rows)]  # every draft accepted: all K compared
        seqs = [Sequence(b, [1], 1, greedy, torch.Generator(), 64, spec) for b in range(rows)]
        index = list(range(rows))
        one = lambda: [rules.verify_one(seqs[b], drafts[b], logits[b]) for b in index]  # noqa: E731
        together = lambda: rules.verify_rows(index, seqs, drafts, logits)  # noqa: E731
        assert list(together().values()) == one()
        a, b = timed(one, args.repeats, device), timed(together, args.repeats, device)
        print(f"{rows:>5} {a:>16.3f} {b:>14.3f} {a / b:>5.2f}x")


if __name__ == "__main__":
    main()
