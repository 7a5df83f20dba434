"""How a target pass's cost grows with the tokens it verifies: v(k) = pass over k tokens / pass over one.

Speculation pays only where v stays near 1 for a few tokens. This prints the measured pass times and v
for a model on a backend (the same measurement `--auto-k` makes before decoding), e.g.

    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --backend llama.cpp
    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --weights packed \
        --json artifacts/pass_costs/torch.json --overlay artifacts/pass_costs/llamacpp.json --plot artifacts/pass_costs/v.png

--plot draws v(k) against k for this run and any earlier runs' --json files (--overlay), with the line
v = k: a pass over k tokens yields at most k tokens (all drafts accepted), so speculation can pay only
where a route's curve lies well below it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    parser.add_argument("--kernel-path", help="native backend: force a kernel path (portable, avx2, avx512-vnni, "
                        "amx, amx-emulated); default the best this CPU has")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--overlay", type=Path, nargs="*", default=[], help="earlier runs' --json files to plot beside")
    parser.add_argument("--plot", type=Path, help="PNG of v(k) for this run and the overlays")
    args = parser.parse_args()
    set_threads(args.threads)
    from verispec.models.gguf import native

    if args.kernel_path and native.set_path(args.kernel_path) != args.kernel_path:
        parser.error(f"this CPU cannot run the {args.kernel_path} kernel path")
    model = load_model(args.model, weights=args.weights, backend=args.backend)
    profile = measure_costs(model.make_runner(), None, k_max=args.max_tokens - 1, context=args.context,
                            repeats=args.repeats)
    for width, seconds in sorted(profile.target_pass.items()):
        print(f"{width:3d} tokens: {seconds * 1000:8.1f} ms   v = {seconds / profile.target_pass[1]:.2f}")
    result = {"model": args.model, "backend": args.backend, "weights": model.weights, "threads": args.threads,
              "kernel_path": native.path() if args.backend == "native" else None,
              "pass_seconds": profile.target_pass}
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot([result] + [json.loads(path.read_text()) for path in args.overlay], args.plot)
        print(f"written: {args.plot}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    widest = 1
    for r in results:
        passes = {int(k): v for k, v in r["pass_seconds"].items()}
        widths = sorted(passes)
        widest = max(widest, widths[-1])
        label = f"{Path(str(r['model'])).name} on {r['backend']}" + (f" ({r['weights']})" if r["backend"] == "torch" else "")
        if r.get("kernel_path"):
            label += f" ({r['kernel_path']})"
        ax.plot(widths, [passes[w] / passes[1] for w in widths], marker="o",
                label=f"{label}: {passes[1] * 1000:.0f} ms for 1 token")
    ax.plot([1, widest], [1, widest], color="grey", linestyle="--", label="v = k (no gain even if all accepted)")
    ax.set_xlabel("tokens in one target pass (k)")
    ax.set_ylabel("pass cost / one-token pass cost, v(k)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
