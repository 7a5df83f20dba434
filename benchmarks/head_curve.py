"""The EAGLE-3 head's learning curve: held-out agreement and tau against the training tokens it saw.

Trains one head per point on a seeded sample of N answer tokens of a corpus (`verispec collect`; several are read
as one), a smaller sample part of a larger one, each validated on the corpus's held-out split, and writes the
curve (JSON, and a PNG with --plot). Points already trained (their OUT/N/training.json exists) are read back, so
a stopped run goes on where it stopped. The features are computed once, in the corpus's store.

    python benchmarks/head_curve.py --corpus CORPUS --out OUT --tokens-points 58000,250000,1000000 \
        --plot docs/head_curve.png -- --steps 3000 --batch-size 8

Arguments after `--` go to every `verispec train-heads` run (the head's shape, steps, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verispec.cli import main as verispec


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, nargs="+", required=True, help="one or more corpora, read as one")
    parser.add_argument("--out", type=Path, required=True, help="one head folder per point: OUT/N")
    parser.add_argument("--tokens-points", default="58000,250000,1000000", help="training tokens per point")
    parser.add_argument("--target", default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    points = sorted(int(p) for p in args.tokens_points.split(","))
    curve = []
    for n in points:
        head = args.out / str(n)
        if not (head / "training.json").is_file():
            command = ["train-heads", "--kind", "eagle3", "--corpus", *map(str, args.corpus), "--corpus-tokens", str(n),
                       "--out", str(head), *(["--target", args.target] if args.target else []), *extra]
            if (head.with_name(head.name + ".partial")).is_dir():
                command.append("--resume")
            if verispec(command) != 0:
                sys.exit(f"train-heads failed at the point of {n} tokens")
        log = json.loads((head / "training.json").read_text())
        last = log["validation"][-1]
        curve.append({"tokens_asked": n, "train_tokens": log["train_tokens"], "train_answers": log["train_answers"],
                      "val_answers": log["val_answers"], "agreement": last["agreement"], "tau": last["tau"],
                      "seconds": log["seconds"]})
        print(json.dumps(curve[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curve.json").write_text(json.dumps(curve, indent=1))
    if args.plot:
        plot(curve, args.plot)
        print(f"written: {args.plot}")


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [c["train_tokens"] for c in curve]
    left.plot(tokens, [c["tau"] for c in curve], marker="o")
    left.set(xscale="log", xlabel="training answer tokens", ylabel="tau (held-out, greedy chain)",
             title="EAGLE-3 head: tokens per target pass")
    for j in range(len(curve[0]["agreement"])):
        right.plot(tokens, [c["agreement"][j] for c in curve], marker="o", label=f"draft {j + 1}")
    right.set(xscale="log", xlabel="training answer tokens", ylabel="agreement with the target (held-out)",
              title="agreement by draft position")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
