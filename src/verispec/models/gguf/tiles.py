"""The SIMD kernels' widest tile on this machine: measured once, remembered, applied.

A tile is how many tokens a kernel takes in one sweep over a group of weights. Any tiling gives the same bits (the
kernel tests compare several tiles with every path), only the speed differs: a tile wider than the registers hold
spills its sums, and a pass wider than the tile unpacks every weight once per tile. Which costs more depends on the
core. The kernels' own choices (the AVX-512 kernel's 16, the AVX2 kernel's 8) were measured on a Xeon with AMX and on
a Zen 4; the AVX-512 kernel's 6 on AMD, from a Zen 4 with earlier kernels, cost 1.1-1.25x at 7-9 tokens on both
machines with today's. So the first native runner on a machine times the candidates of the kernel its path runs
(AVX-512 for `avx512-vnni` and `amx`, AVX2 for `avx2` and `avx-vnni`) on synthetic Q4_K and Q6_K matrices the shape
of a 1.5B model's feed-forward (the two types of the Q4_K_M files users run; a fraction of a second) and keeps the
fastest, unless the kernel's own choice is within `MARGIN` of it; the result is kept in the cache directory per CPU,
kernel build, path and thread count, so later runs read it.
VERISPEC_KERNEL_TUNING=0 keeps the kernels' own choices (the tests do, except the tests of this module).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.atomic import atomic_write_json
from verispec.console import notice
from verispec.models.gguf import native
from verispec.models.gguf.ops import Activations, Weight

ENV = "VERISPEC_KERNEL_TUNING"
MARGIN = 0.03  # the kernel's own choice stays unless another is faster than this on average
Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
KEPT_ENTRIES = 32  # the cache keeps the entries measured last (several CPUs, paths, thread counts and builds)
TIMED = (Q4_K, Q6_K)  # the types timed: a Zen 4 scored tiles of 6 1.03 on Q4_K alone but 1.12 on Q6_K


@dataclass(frozen=True)
class Kernel:
    """A SIMD kernel whose widest tile is set at run time: the tiles timed (`candidates`), the tokens per matmul
    timed (`widths`: from the smallest width that some candidate splits), its getter and setter (0: its own)."""

    name: str
    candidates: tuple[int, ...]
    widths: tuple[int, ...]
    get: Callable[[], int]
    set: Callable[[int], int]
    measured_on: str  # the path to time it on ("": the one in force); AMX's would send some widths to its tiles


AVX512 = Kernel("AVX-512", (4, 6, 8, 12, 16), (5, 6, 7, 8, 9, 12, 16), native.avx512_tile, native.set_avx512_tile,
                "avx512-vnni")
AVX2 = Kernel("AVX2", (2, 4, 6, 8), (3, 4, 5, 6, 7, 8, 12), native.avx2_tile, native.set_avx2_tile, "")
KERNELS = {"avx512-vnni": AVX512, "amx": AVX512, "avx2": AVX2, "avx-vnni": AVX2}  # path -> the kernel it tiles


@dataclass(frozen=True)
class TileChoice:
    """What was measured and chosen: ms[tile][width] the median ms of one matmul of each timed type, summed; default
    the kernel's own tile."""

    tile: int
    default: int
    ms: dict[int, dict[int, float]]
    seconds: float  # how long the measuring took (0 where read from the cache)
    cached: bool = False


def synthetic_weight(rows: int = 1536, cols: int = 8960, seed: int = 0, qtype: GGMLQuantizationType = Q4_K
                     ) -> Weight:
    """A random Q4_K or Q6_K matrix, its scales finite halves (no NaN or subnormal in the timed float operations)."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]  # 256 weights in 144 (Q4_K) or 210 (Q6_K) bytes
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, block_bytes), dtype=np.uint8)  # as stored
    if qtype == Q4_K:
        blocks[:, :4] = np.array([0.01, 0.001], np.float16).view(np.uint8)  # d, dmin first
    elif qtype == Q6_K:
        blocks[:, -2:] = np.array([0.01], np.float16).view(np.uint8)  # d last (the scales are int8: finite)
    else:
        raise ValueError(f"no synthetic {qtype.name} matrix")
    return Weight.from_raw("tile-timing", int(qtype), blocks.reshape(rows, -1), rows, cols)


def measure(threads: int, kernel: Kernel = AVX512, candidates: tuple[int, ...] | None = None,
            widths: tuple[int, ...] | None = None, rounds: int = 5, weights: tuple[Weight, ...] | None = None
            ) -> dict[int, dict[int, float]]:
    """Median ms of one matmul of each of `weights` (one of each `TIMED` type unless given; their times summed) per
    (candidate tile, width) on `kernel` (its candidates and widths unless given), the candidates taking turns within
    each round; the kernel's own tile and the path are restored afterwards."""
    weights = weights or tuple(synthetic_weight(qtype=t) for t in TIMED)
    candidates, widths = candidates or kernel.candidates, widths or kernel.widths
    lib, path = native.lib(), native.path()
    lib.vs_set_threads(threads)
    if kernel.measured_on and path != kernel.measured_on:
        native.set_path(kernel.measured_on)
    samples: dict[int, dict[int, list[float]]] = {t: {w: [] for w in widths} for t in candidates}
    rng = np.random.default_rng(1)
    try:
        for width in widths:
            calls, kept = [], []
            for weight in weights:
                acts = Activations(rng.standard_normal((width, weight.cols)).astype(np.float32))
                acts.quantize(weight.block)
                out = np.empty((width, weight.rows), np.float32)
                kept.append((acts, out))  # the pointers below are valid while these live
                calls.append((weight.qtype, weight.address, weight.rows, weight.cols, width,
                              *acts.pointers[weight.block], native.ptr(out)))
            kernel.set(candidates[0])
            for args in calls:  # warm: the weights into cache
                native.check(lib.vs_matmul(*args), "timing the kernel's tiles")
            for _ in range(rounds):
                for tile in candidates:
                    kernel.set(tile)
                    start = time.perf_counter()
                    for args in calls:
                        lib.vs_matmul(*args)
                    samples[tile][width].append((time.perf_counter() - start) * 1000)  # ms per matmul of each
    finally:
        kernel.set(0)
        native.set_path(path)
    return {t: {w: round(statistics.median(s), 5) for w, s in by_width.items()} for t, by_width in samples.items()}


def choose(ms: dict[int, dict[int, float]], default: int, margin: float = MARGIN) -> int:
    """The tile with the lowest geometric mean, over the widths, of its time over the fastest tile's at that width;
    the default where it is within `margin` of that (timings are noisy: a near tie keeps what the kernel chose)."""
    widths = next(iter(ms.values())).keys()
    best = {w: min(by_width[w] for by_width in ms.values()) for w in widths}
    score = {t: math.exp(statistics.fmean(math.log(by_width[w] / best[w]) for w in widths))
             for t, by_width in ms.items()}
    winner = min(score, key=lambda t: (score[t], t))
    if default in score and score[default] <= score[winner] * (1 + margin):
        return default
    return winner


@lru_cache(maxsize=1)
def _build_id() -> str:
    """The kernels' build: the compiled library's size and modification time (another build may want another tile;
    a rebuild writes the file anew). A stat, not a digest of its 6 MB: this runs at every process's first runner."""
    stat = Path(native.lib()._name).stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def _cpu_id() -> str:
    """The CPU as /proc/cpuinfo names it (vendor, family, model, stepping, model name), else what platform says."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model", "stepping", "model name")]
    return " / ".join(parts) if any(parts) else platform.processor() or platform.machine()


def cache_key(threads: int) -> str:
    """The CPU, path, threads, kernel build and the types timed (an entry timed on other types is measured again)."""
    timed_on = "+".join(t.name for t in TIMED)
    return f"{_cpu_id()} | {native.path()} | {threads} threads | kernels {_build_id()} | timed on {timed_on}"


def cache_file() -> Path:
    from verispec.models.registry import cache_dir

    return cache_dir() / "kernel-tiles.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return data if isinstance(data, dict) else {}


def _newest(entries: dict, count: int) -> dict:
    """The `count` entries measured last (by their "measured" stamp, then the file's order; an entry without one
    counts as oldest), in the file's order: every rebuild of the kernels adds a key (its build is in the key), and
    the entries of builds gone would otherwise pile up for good."""
    def stamp(item):
        index, (_, entry) = item
        measured = entry.get("measured") if isinstance(entry, dict) else None
        return (measured if isinstance(measured, str) else "", index)

    kept = {index for index, _ in sorted(enumerate(entries.items()), key=stamp)[-count:]}
    return {key: entry for index, (key, entry) in enumerate(entries.items()) if index in kept}


def _from_entry(entry, default: int, most: int) -> TileChoice | None:
    """A cached entry as a TileChoice, or None where it is not one (hand-edited, another version's)."""
    try:
        tile = int(entry["tile"])
        ms = {int(t): {int(w): float(v) for w, v in by_width.items()} for t, by_width in entry["ms"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not 1 <= tile <= most:
        return None
    return TileChoice(tile, default, ms, 0.0, cached=True)


def tuned(threads: int, measure_with: Callable[[int, Kernel], dict] = measure) -> TileChoice:
    """This machine's tile for the kernel its path runs, at `threads` threads: from the cache, else measured and
    cached (a cache that cannot be written leaves the choice to this process)."""
    kernel = KERNELS[native.path()]
    default = kernel.set(0)
    path, key = cache_file(), cache_key(threads)
    entries = _read_cache(path)
    if (choice := _from_entry(entries.get(key), default, max(kernel.candidates))) is not None:
        return choice
    start = time.perf_counter()
    ms = measure_with(threads, kernel)
    choice = TileChoice(choose(ms, default), default, ms, time.perf_counter() - start)
    entries = _read_cache(path)  # another process may have written meanwhile
    entries[key] = {"tile": choice.tile, "default": default, "ms": ms, "measured": time.strftime("%Y-%m-%d %H:%M")}
    entries = _newest(entries, KEPT_ENTRIES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, entries, indent=1)
    except OSError:
        pass
    return choice


_applied: dict[tuple[str, int], TileChoice] = {}


def apply(threads: int) -> TileChoice | None:
    """Set the widest tile of the kernel this path runs to this machine's (`tuned`), measured at most once a
    process per path and thread count; None where the path has no such kernel (portable C) or
    VERISPEC_KERNEL_TUNING=0."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if (kernel := KERNELS.get(native.path())) is None:
        return None
    key = (native.path(), threads)
    if key not in _applied:
        _applied[key] = choice = tuned(threads)
        if not choice.cached:
            notice(f"[dim]native runner: measured this CPU's {kernel.name} kernel tiles once ({choice.seconds:.1f} s): "
                   f"{choice.tile} tokens (the kernel's own choice {choice.default}); kept in {cache_file()}[/dim]")
    kernel.set(_applied[key].tile)
    return _applied[key]


def in_force() -> int | None:
    """The widest tile of the kernel the path in force runs (None on the portable path): what benchmarks report."""
    kernel = KERNELS.get(native.path())
    return None if kernel is None else kernel.get()
