"""How fast the native kernels read weights, apart from the runner: GB/s of the default target's own matrices, each
weight type's with the matrix in cache ("hot": the kernels' arithmetic) and a whole pass's matmuls streamed from
memory ("streamed": what a pass gets), against the bench's bandwidth probe. Where streamed falls well below both the
probe and hot, the core waits on memory it could have asked for earlier (this is how the prefetching kernels were
found: on a 2-core Xeon one core computed Q4_K at ~33 GB/s hot but streamed 9.6 GB/s).

    .venv/bin/python benchmarks/kernel_rates.py --threads 2 --widths 1,4

--against OTHER.so times another build of the kernels (`_native*.so`, e.g. the previous commit's) on the same
weights, taking turns, and checks that both give the same bits; the packed layout must be the same. --paths A,B times
this build's kernel paths the same way (e.g. `--paths avx2,avx-vnni`: the AVX2 kernel with and without AVX-VNNI).
--tiles A,B times this build under each widest tile of the path's kernel the same way (e.g. `--tiles 6,16 --widths
7,9`: the AVX-512 kernel's tiles, what `models/gguf/tiles.py` chooses between, on a whole pass streamed).
--prefetch-one on,off times the AVX-512 kernel's one-token tiles asking for their weights ahead and leaving it to the
hardware prefetchers (off by default on AMD CPUs, on elsewhere: csrc/cpu.h), e.g. `--prefetch-one on,off --widths 1`.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import subprocess
import time

import numpy as np


def load_kernels(path: str | None, threads: int):
    """The kernels of this installation, or of another build at `path`, typed as verispec types them."""
    from verispec.models.gguf import native

    if path is None:
        so = native.lib()
    else:
        so = ctypes.CDLL(path)
        for name, (args, result) in native._SIGNATURES.items():
            fn = getattr(so, name)
            fn.argtypes, fn.restype = args, result
    so.vs_set_threads(threads)
    return so


def calls_for(weights, n: int, rng) -> list[tuple]:
    """(vs_matmul's arguments, its output array, the activations) for each weight on n random tokens (activations
    quantized once per width; the raw pointers are valid while the returned arrays live)."""
    from verispec.models.gguf.native import ptr
    from verispec.models.gguf.ops import Activations

    acts, calls = {}, []
    for w in weights:
        if w.cols not in acts:
            acts[w.cols] = Activations(rng.standard_normal((n, w.cols)).astype(np.float32))
        a = acts[w.cols]
        a.quantize(w.block)
        out = np.empty((n, w.rows), np.float32)
        calls.append(((w.qtype, w.address, w.rows, w.cols, n, *a.pointers[w.block], ptr(out)), out, a))
    return calls


def timed(libs, calls, rounds: int, repeat: int = 1) -> list[float]:
    """Median seconds of one sweep over `calls` per (library, kernel path or None, widest tile or None[, one-token
    prefetch 1 / 0]), taking turns; outputs compared. A tile is set on this installation's kernel for its path in
    force (`tiles.KERNELS`: --tiles times this build only)."""
    from verispec.models.gguf import native, tiles

    seconds = [[] for _ in libs]
    for _ in range(rounds):
        outputs = []
        for i, (so, path, tile, *prefetch) in enumerate(libs):
            if path is not None:
                so.vs_set_path(path)
            if tile is not None:
                tiles.KERNELS[native.path()].set(tile)
            if prefetch:
                so.vs_set_prefetch_one(prefetch[0])
            start = time.perf_counter()
            for _ in range(repeat):
                for args, *_ in calls:
                    so.vs_matmul(*args)
            seconds[i].append((time.perf_counter() - start) / repeat)
            outputs.append(calls[-1][1].copy())
        if any(not np.array_equal(outputs[0].view(np.uint32), o.view(np.uint32)) for o in outputs[1:]):
            raise SystemExit("the builds give different bits: not the same kernels' arithmetic")
    return [statistics.median(s) for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--widths", default="1,4", help="tokens per matmul")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", help="another build of the kernels (a _native*.so) to time beside this one")
    parser.add_argument("--paths", default="", help="kernel paths of this build to time side by side (default: the "
                        "CPU's best)")
    parser.add_argument("--tiles", default="", help="widest tiles of this build's kernel to time side by side")
    parser.add_argument("--prefetch-one", default="", help="on,off: the AVX-512 kernel's one-token tiles with and "
                        "without prefetching, side by side")
    args = parser.parse_args()
    from verispec.bench.runner import memory_bandwidth_gbs
    from verispec.errors import VerispecError
    from verispec.models import load_model
    from verispec.models.gguf import native, tiles
    from verispec.models.gguf.ops import type_name

    try:
        tile_list = [int(t) for t in args.tiles.split(",") if t]
    except ValueError:
        parser.error(f"--tiles takes widest tiles as numbers, e.g. 6,16: not {args.tiles!r}")
    if tile_list and (args.paths or args.against):
        parser.error("--tiles compares this build's tiles on its own path: not with --paths or --against")
    prefetch = [p for p in args.prefetch_one.split(",") if p]
    if any(p not in ("on", "off") for p in prefetch):
        parser.error(f"--prefetch-one takes on and off, e.g. on,off: not {args.prefetch_one!r}")
    if prefetch and (args.paths or args.against or tile_list):
        parser.error("--prefetch-one compares this build's one-token tiles: not with --paths, --against or --tiles")
    if prefetch and native.path() not in native.PREFETCH_ONE_PATHS:
        parser.error(f"--prefetch-one: the {native.path()} kernel path always prefetches (only the AVX-512 kernel's "
                     "one-token tiles have the setting)")
    kernel = tiles.KERNELS.get(native.path())
    if tile_list and kernel is None:
        parser.error(f"--tiles: the {native.path()} kernel path has no tiles to set")
    most = max(kernel.candidates) if kernel else 0  # the kernel's widest, as tiles.tuned bounds a cached tile
    if any(not 1 <= t <= most for t in tile_list):
        parser.error(f"--tiles takes the {native.path()} path's widest tiles from 1 to {most}")
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout if platform.system() == "Linux" else "")
    try:
        model = load_model(args.model, backend="native").make_runner().gguf
    except VerispecError as e:  # an unknown name or file: its one line, as the CLI says it
        parser.error(str(e))
    codes = {name: code for code, name in native.PATHS.items()}
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in codes or native.set_path(p) != p:
            parser.error(f"this CPU cannot run the {p} kernel path")
    ours = load_kernels(None, args.threads)
    libs = ([(ours, codes[p], None) for p in paths] or [(ours, None, t) for t in tile_list]
            or [(ours, None, None, int(p == "on")) for p in prefetch] or [(ours, None, None)])
    names = ([f"this build ({p})" for p in paths] or [f"widest tile {t}" for t in tile_list]
             or [f"one-token prefetch {p}" for p in prefetch] or ["this build"])
    if args.against:
        theirs = load_kernels(args.against, args.threads)
        for p in paths:
            if theirs.vs_set_path(codes[p]) != codes[p]:
                parser.error(f"{args.against} has no kernel path {p}")
        libs += [(theirs, codes[p], None) for p in paths] or [(theirs, None, None)]
        names += [f"--against ({p})" for p in paths] or ["--against"]
    if paths:
        native.set_path(paths[0])
    weights = [w for layer in model.layers for w in (layer.q, layer.k, layer.v, layer.out, layer.gate, layer.up,
                                                      layer.down)] + [model.head]
    shapes = {}  # one matrix of each type and shape, the head left out (it does not fit a cache)
    for w in weights[:-1]:
        shapes.setdefault((type_name(w.qtype), w.rows, w.cols), w)
    rng = np.random.default_rng(0)
    probe = memory_bandwidth_gbs()
    tile_note = f"widest tiles {args.tiles}, taking turns" if tile_list else f"widest tile {tiles.in_force()}"
    if not prefetch and native.path() in native.PREFETCH_ONE_PATHS:
        tile_note += f", one-token prefetch {'on' if native.set_prefetch_one(-1) else 'off'}"
    print(f"kernel path {', '.join(paths) or native.path()} ({tile_note}), {args.threads} threads, "
          f"bandwidth probe {probe:.1f} GB/s")
    for n in (int(w) for w in args.widths.split(",")):
        for (kind, rows, cols), w in sorted(shapes.items()):
            times = timed(libs, calls_for([w], n, rng), args.rounds, repeat=max(1, int(2e8 // w.data.nbytes)))
            print(f"{n} tokens, hot {kind} {rows} x {cols} ({w.data.nbytes / 1e6:.1f} MB): "
                  + ", ".join(f"{name} {w.data.nbytes / t / 1e9:.1f} GB/s" for name, t in zip(names, times)))
        total = sum(w.data.nbytes for w in weights)
        times = timed(libs, calls_for(weights, n, rng), args.rounds)
        print(f"{n} tokens, streamed, a pass's matmuls ({total / 1e9:.2f} GB): "
              + ", ".join(f"{name} {t * 1e3:.1f} ms = {total / t / 1e9:.1f} GB/s ({total / t / 1e9 / probe:.0%} of "
                          f"the probe)" for name, t in zip(names, times)))


if __name__ == "__main__":
    main()
