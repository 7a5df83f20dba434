"""How a target pass's cost grows with the tokens it verifies: v(k) = pass over k tokens / pass over one.

Speculation pays only where v stays near 1 for a few tokens. This prints the measured pass times and v
for a model on a backend (the same measurement `--auto-k` makes before decoding), e.g.

    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --backend llama.cpp
    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --weights packed
"""

from __future__ import annotations

import argparse
import json

from verispec.api import set_threads
from verispec.models import load_model
from verispec.models.loading import BACKENDS, WEIGHT_FORMATS
from verispec.tuning import measure_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--backend", default="torch", choices=BACKENDS)
    parser.add_argument("--weights", default="packed", choices=WEIGHT_FORMATS, help="torch backend only")
    parser.add_argument("--max-tokens", type=int, default=16, help="widest pass measured")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    model = load_model(args.model, weights=args.weights, backend=args.backend)
    profile = measure_costs(model.make_runner(), None, k_max=args.max_tokens - 1, context=args.context,
                            repeats=args.repeats)
    for width, seconds in sorted(profile.target_pass.items()):
        print(f"{width:3d} tokens: {seconds * 1000:8.1f} ms   v = {seconds / profile.target_pass[1]:.2f}")
    print(json.dumps({"model": args.model, "backend": args.backend, "weights": model.weights,
                      "pass_seconds": profile.target_pass}))


if __name__ == "__main__":
    main()
