"""How a target pass's cost grows with the tokens it verifies: v(k) = pass over k tokens / pass over one.

Speculation pays only where v stays near 1 for a few tokens. This prints the measured pass times and v
for a model on a backend (the same measurement `--auto-k` makes before decoding), e.g.

    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --backend llama.cpp
    .venv/bin/python benchmarks/pass_costs.py --model qwen2.5-coder-1.5b-instruct --weights packed \
        --json artifacts/pass_costs/torch.json --overlay artifacts/pass_costs/llamacpp.json --plot artifacts/pass_costs/v.png

--profile (native backend) also says where each width's pass goes: the matmuls by weight type, the activations'
quantization, attention, the layers' row ops (norms, rope, SiLU, residuals, cache writes), the output head and the
rest (Python), each in ms per pass, from the kernels' own timers (`native.profile`), then the GB/s each weight
type's matmuls stream (its packed bytes over its ms), all matmuls and the whole pass, each as a share of the
memory bandwidth the bench's probe reads, so that a kernel change is judged against the limit:

    .venv/bin/python benchmarks/pass_costs.py --backend native --threads 2 --max-tokens 32 --profile \
        --widths 1,2,4,8,16,32 --plot-profile artifacts/pass_costs/profile.png

--interleave takes the widths in turns, every width once a round (`pass_timing.py`), where by default each width's
repeats run one after the other as `--auto-k` measures them: on a VM whose bandwidth drifts, a step between two widths
is then the kernels', not the minute's.

--prefetch-one times one-token passes with the AVX-512 kernel's one-token tiles prefetching their weights and leaving
them to the hardware prefetchers (csrc/cpu.h: off by default on AMD CPUs), the two taking turns, --repeats rounds.

--plot draws v(k) against k for this run and any earlier runs' --json files (--overlay), with the line
v = k: a pass over k tokens yields at most k tokens (all drafts accepted), so speculation can pay only
where a route's curve lies well below it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verispec.api import set_threads
from verispec.bench.runner import memory_bandwidth_gbs
from verispec.errors import VerispecError
from verispec.models import load_model
from verispec.models.loading import BACKENDS, WEIGHT_FORMATS
from verispec.tree import chain_parents
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
    parser.add_argument("--kernel-path", help="native backend: force a kernel path (portable, avx2, avx-vnni, "
                        "avx512-vnni, amx, amx-emulated); default the best this CPU has")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--overlay", type=Path, nargs="*", default=[], help="earlier runs' --json files to plot beside")
    parser.add_argument("--plot", type=Path, help="PNG of v(k) for this run and the overlays")
    parser.add_argument("--profile", action="store_true", help="native backend: where each width's pass goes")
    parser.add_argument("--widths", default="1,2,4,8,16,32", help="--profile: the widths profiled")
    parser.add_argument("--plot-profile", type=Path, help="--profile: a stacked bar chart of it")
    parser.add_argument("--interleave", action="store_true", help="take the widths in turns, every width once a "
                        "round (a drifting machine then shifts every width alike)")
    parser.add_argument("--prefetch-one", action="store_true", help="native backend: one-token passes with the "
                        "AVX-512 kernel's one-token prefetching on and off, taking turns")
    args = parser.parse_args()
    if min(args.max_tokens, args.repeats, args.context) < 1:
        parser.error("--max-tokens, --repeats and --context take 1 or more")
    if args.interleave and args.profile:
        parser.error("--interleave orders the v(k) passes; --profile times its widths its own way: use one of them")
    set_threads(args.threads)
    from verispec.models.gguf import native, tiles

    if args.kernel_path and native.set_path(args.kernel_path) != args.kernel_path:
        parser.error(f"this CPU cannot run the {args.kernel_path} kernel path")
    if args.prefetch_one and (args.backend != "native" or native.path() not in native.PREFETCH_ONE_PATHS):
        parser.error("--prefetch-one sets the AVX-512 kernel's one-token tiles: use --backend native on a CPU with "
                     "AVX-512 VNNI")
    if args.prefetch_one and (args.interleave or args.profile):
        parser.error("--prefetch-one times one-token passes its own way: not with --interleave or --profile")
    try:
        model = load_model(args.model, weights=args.weights, backend=args.backend)
    except VerispecError as e:  # an unknown name or file: its one line, as the CLI says it
        parser.error(str(e))
    if args.profile:
        if args.backend != "native":
            parser.error("--profile reads the native kernels' timers: use --backend native")
        widths = [int(w) for w in args.widths.split(",")]
        runner = model.make_runner()
        rows = profile_passes(runner, widths, args.context, args.repeats)
        probe = memory_bandwidth_gbs()
        rates = bandwidth_report(weight_bytes(runner), rows, probe)
        result = {"model": args.model, "kernel_path": native.path(), "kernel_tile": tiles.in_force(),
                  "threads": args.threads, "context": args.context, "ms_per_pass": rows,
                  "memory_bandwidth_gbs": round(probe, 2), "gb_per_s": rates}
        print(json.dumps(result))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
        if args.plot_profile:
            plot_profile(result, args.plot_profile)
            print(f"written: {args.plot_profile}")
        return
    if args.prefetch_one:
        from pass_timing import settings_in_turns

        default = native.set_prefetch_one(-1)
        settings = {"on": lambda: native.set_prefetch_one(1), "off": lambda: native.set_prefetch_one(0)}
        seconds = settings_in_turns(model.make_runner(), settings, args.context, args.repeats)
        native.set_prefetch_one(-1)
        ratios = [on / off for on, off in zip(seconds["on"], seconds["off"])]
        print(f"one-token pass, {args.repeats} rounds taking turns: prefetch on {statistics.median(seconds['on']) * 1e3:.1f}"
              f" ms, off {statistics.median(seconds['off']) * 1e3:.1f} ms; on / off a round: median "
              f"{statistics.median(ratios):.3f}, off faster in {sum(r > 1 for r in ratios)} of {len(ratios)} "
              f"(this CPU's default: {'on' if default else 'off'}); bandwidth probe {memory_bandwidth_gbs():.1f} GB/s")
        return
    if args.interleave:
        from pass_timing import interleaved_costs

        passes = interleaved_costs(model.make_runner(), args.max_tokens, args.context, args.repeats)
    else:
        passes = measure_costs(model.make_runner(), None, k_max=args.max_tokens - 1, context=args.context,
                               repeats=args.repeats).target_pass
    for width, seconds in sorted(passes.items()):
        print(f"{width:3d} tokens: {seconds * 1000:8.1f} ms   v = {seconds / passes[1]:.2f}")
    result = {"model": args.model, "backend": args.backend, "weights": model.weights, "threads": args.threads,
              "kernel_path": native.path() if args.backend == "native" else None,
              "kernel_tile": tiles.in_force() if args.backend == "native" else None,  # the runner set this machine's
              "interleaved": args.interleave, "pass_seconds": passes}
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot([result] + [json.loads(path.read_text()) for path in args.overlay], args.plot)
        print(f"written: {args.plot}")


def profile_passes(runner, widths: list[int], context: int, repeats: int) -> dict[int, dict[str, float]]:
    """Per width: ms per pass in each part (the median pass's total; parts summed over the repeats / repeats)."""
    import time

    from verispec.models.gguf import native

    vocab = runner.vocab_size
    state = runner.new_state(1)
    runner.forward(state, [[(i * 7919) % vocab for i in range(context)]], [1])
    rows = {}
    for width in widths:
        tokens = [[(11 + i) % vocab for i in range(width)]]
        parents = [list(chain_parents(width))]  # a chain of draft nodes, as a verification pass reads them
        runner.forward(state, tokens, [width], parents)  # warm-up
        runner.commit(state, [[]])
        totals = []
        with native.profile() as parts:
            for _ in range(repeats):
                start = time.perf_counter()
                runner.forward(state, tokens, [width], parents)
                totals.append(time.perf_counter() - start)
                runner.commit(state, [[]])
        ms = {name: 1000 * seconds / repeats for name, seconds in parts.items()}
        layers = ms.pop("layers", 0.0)
        row = {name: ms[name] for name in sorted(ms) if name.startswith("matmul ")}
        row["quantize activations"] = ms.get("quantize activations", 0.0)
        row["attention"] = ms.get("attention", 0.0)
        inside = sum(row.values()) + ms.get("float matmuls", 0.0)  # all of them run inside layers
        row["layer row ops"] = max(layers - inside, 0.0)
        row["output head"] = ms.get("matmuls outside layers", 0.0)
        row["rest (Python)"] = max(1000 * sum(totals) / repeats - layers - ms.get("matmuls outside layers", 0.0), 0.0)
        row["total"] = 1000 * sorted(totals)[len(totals) // 2]
        rows[width] = {k: round(v, 3) for k, v in row.items()}
        parts_text = ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "total")
        print(f"{width:3d} tokens: {row['total']:7.1f} ms = {parts_text}")
    return rows


def weight_bytes(runner) -> dict[str, int]:
    """Bytes of packed weights one pass reads, under the profile's names: "matmul <type>" for the layers'
    matmuls of each weight type, "output head" for the head."""
    from verispec.models.gguf.ops import type_name

    sizes: dict[str, int] = {}
    for layer in runner.gguf.layers:
        for weight in (layer.q, layer.k, layer.v, layer.out, layer.gate, layer.up, layer.down):
            name = f"matmul {type_name(weight.qtype)}"
            sizes[name] = sizes.get(name, 0) + weight.data.nbytes
    sizes["output head"] = runner.gguf.head.data.nbytes
    return sizes


def bandwidth_report(sizes: dict[str, int], rows: dict[int, dict[str, float]], probe: float) -> dict[int, dict]:
    """Per width: GB/s each weight type's matmuls stream (its bytes over its ms per pass), all matmuls together,
    and the whole pass, against the probe's bandwidth; printed as one line a width."""
    print(f"memory bandwidth (probe) {probe:.1f} GB/s; weights per pass: "
          + ", ".join(f"{name.removeprefix('matmul ')} {size / 1e6:.0f} MB" for name, size in sizes.items()))
    report = {}
    for width, row in rows.items():
        rates = {name: size / row[name] / 1e6 for name, size in sizes.items() if row.get(name)}
        matmul_ms = sum(row.get(name, 0.0) for name in sizes)
        total = sum(sizes.values())
        rates["all matmuls"] = total / matmul_ms / 1e6 if matmul_ms else 0.0
        rates["whole pass"] = total / row["total"] / 1e6
        report[width] = {name: round(rate, 2) for name, rate in rates.items()}
        print(f"{width:3d} tokens: " + ", ".join(f"{name.removeprefix('matmul ')} {rate:.1f} GB/s ({rate / probe:.0%})"
                                              for name, rate in rates.items()))
    return report


def plot_profile(result: dict, path: Path) -> None:
    """Stacked bars: ms per pass in each part, one bar per width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {int(w): r for w, r in result["ms_per_pass"].items()}
    widths = sorted(rows)
    parts = [p for p in rows[widths[0]] if p != "total"]
    for w in widths:
        parts += [p for p in rows[w] if p != "total" and p not in parts]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(widths)
    labels = [str(w) for w in widths]
    for part in parts:
        values = [rows[w].get(part, 0.0) for w in widths]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("tokens in one target pass")
    ax.set_ylabel("ms per pass")
    ax.set_title(f"where a pass goes ({result['kernel_path']}, {result['threads']} threads)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
