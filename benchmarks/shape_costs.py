"""Pass costs at the sizes users run: a random-weight GGUF of the Llama-3-8B or Qwen3-8B shape in the Q4_K_M layout
(Q4_K weights, Q6_K for attn_v, ffn_down and the output head, as llama.cpp's Q4_K_M mostly has them), timed on the
native runner and on llama.cpp from the same file, side by side in one run: one token and v(2..K).

The weights are random bytes with sane scales (tests/tiny_gguf.py: every bit pattern is a valid block), so a pass
streams exactly what a real file of that shape streams; the vocabulary is a placeholder of the right size (llama.cpp
needs one). The file is written once under --dir (about 4.7 GB for Llama-3-8B) and reused.

    .venv/bin/python benchmarks/shape_costs.py --shape llama3-8b --max-tokens 8 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from pass_timing import interleaved_costs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the random GGUF writer the native runner's tests use

SHAPES = {  # hidden, heads, kv heads, head dim, ffn, layers, vocab, arch (experts: count, a token's, width)
    "llama3-8b": dict(arch="llama", hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, layers=32, vocab=128256),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288, layers=36, vocab=151936),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, layers=48,
                          vocab=151936, experts=(128, 8, 768)),
}


def q4_k_m(name: str):
    from tiny_gguf import T
    return T.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) or \
        name == "output.weight" else T.Q4_K


def write(shape: str, path: Path, layers: int | None = None) -> Path:
    from tiny_gguf import write_tiny_gguf
    s = dict(SHAPES[shape], **({"layers": layers} if layers else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    started = time.perf_counter()
    write_tiny_gguf(partial, arch=s.pop("arch"), types=q4_k_m, context=4096, vocab_tokens=True, **s)
    partial.rename(path)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def cpu_name() -> str:
    """`lscpu`'s model name (platform.processor() is empty on Linux), and whether AMX tiles are listed."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{name}, {'AMX' if 'amx_tile' in flags else 'no AMX'}"


def costs(runner, max_tokens: int, context: int, repeats: int, interleave: bool = False) -> dict[int, float]:
    """Seconds per pass by width (1..max_tokens): each width's median in turn (`measure_costs`), or with `interleave`
    the widths taken in turns (`pass_timing.interleaved_costs`: a VM's slow minutes then shift every width alike)."""
    if interleave:
        return interleaved_costs(runner, max_tokens, context, repeats)
    from verispec.tuning import measure_costs
    return measure_costs(runner, None, k_max=max_tokens - 1, context=context, repeats=repeats).target_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/verispec-shapes"))
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--interleave", action="store_true", help="time the widths in rounds, taking turns (see costs)")
    parser.add_argument("--layers", type=int, help="write only this many of the shape's layers (a mixture of experts "
                        "too large for the machine's memory: its pass is the layers' sum, reported per layer too)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if min(args.max_tokens, args.repeats, args.context) < 1:
        parser.error("--max-tokens, --repeats and --context take 1 or more")
    from verispec.api import set_threads
    from verispec.bench.runner import memory_bandwidth_gbs
    from verispec.models.gguf import native
    from verispec.models.gguf.model import load_gguf
    from verispec.models.gguf.runner import NativeRunner
    from verispec.models.runners.llamacpp import LlamaCppRunner

    set_threads(args.threads)
    layers = f"-{args.layers}layers" if args.layers else ""
    path = args.dir / f"{args.shape}{layers}-q4_k_m-random.gguf"
    if not path.is_file():
        write(args.shape, path, args.layers)
    result = {"shape": args.shape, "layers": args.layers or SHAPES[args.shape]["layers"], "threads": args.threads, "context": args.context, "cpu": cpu_name(),
              "kernel_path": native.path(), "memory_bandwidth_gbs": round(memory_bandwidth_gbs(), 2)}
    runner = NativeRunner(load_gguf(path, show_progress=False))
    result["native"] = costs(runner, args.max_tokens, args.context, args.repeats, args.interleave)
    del runner
    result["llama.cpp"] = costs(LlamaCppRunner(path, context_window=args.context + args.max_tokens + 64,
                                               threads=args.threads), args.max_tokens, args.context, args.repeats,
                             args.interleave)
    print(f"{result['cpu']}; {args.shape} ({result['layers']} of {SHAPES[args.shape]['layers']} layers), {args.threads} threads, {args.context} cached tokens, kernel path {result['kernel_path']}, "
          f"probe {result['memory_bandwidth_gbs']} GB/s; ms per pass (v)")
    print(f"{'tokens':>6} {'native':>16} {'llama.cpp':>16} {'native / llama.cpp':>19}")
    for width in sorted(result["native"]):
        a, b = result["native"][width], result["llama.cpp"][width]
        print(f"{width:>6} {1e3 * a:>9.1f} ({a / result['native'][1]:.2f}) {1e3 * b:>9.1f} ({b / result['llama.cpp'][1]:.2f})"
              f" {a / b:>19.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
