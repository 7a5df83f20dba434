"""The SIMD kernels' widest tile, measured per machine (verispec.models.gguf.tiles): the choice from timings, the
cache (read, rewritten where unreadable, a choice even where unwritable), and runners applying it. No timing is
judged here: the measuring runs small and only its shape and its restoring the kernel's settings are checked."""

import json

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from verispec.models.gguf import native, tiles
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner

BEST = native.path()
# the paths with a tiled SIMD kernel this CPU runs (forcing one the CPU lacks falls back to portable)
TILED = [p for p in ("avx512-vnni", "amx", "avx2", "avx-vnni") if native.set_path(p) == p]
native.set_path(BEST)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache directory of the test's own, tuning on, nothing applied yet in this process; the kernel's own tile
    afterwards."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(tiles.ENV, "1")
    monkeypatch.setattr(tiles, "_applied", {})
    yield tmp_path / "cache" / "kernel-tiles.json"
    native.set_avx512_tile(0)
    native.set_avx2_tile(0)
    native.set_path(BEST)


def table(**by_tile):
    """ms[tile][width] from tile=(ms at widths 5, 8, 12)."""
    return {int(t[1:]): dict(zip((5, 8, 12), ms)) for t, ms in by_tile.items()}


def test_the_tile_fastest_over_the_widths_is_chosen():
    ms = table(t4=(1.3, 2.0, 2.6), t8=(1.0, 1.5, 2.5), t16=(1.0, 1.5, 1.9))
    assert tiles.choose(ms, default=6) == 16  # the default was not timed: the winner
    assert tiles.choose(ms, default=4) == 16


def test_a_near_tie_keeps_the_kernels_own_tile():
    ms = table(t6=(1.00, 1.52, 1.94), t16=(1.00, 1.50, 1.90))  # 6 within 3% of 16 on average
    assert tiles.choose(ms, default=6) == 6
    assert tiles.choose(ms, default=6, margin=0.0) == 16
    ms = table(t6=(1.00, 1.80, 2.40), t16=(1.00, 1.50, 1.90))  # 6 clearly slower where it needs two tiles
    assert tiles.choose(ms, default=6) == 16


def test_equal_timings_choose_the_smaller_tile():
    ms = table(t8=(1.0, 1.5, 2.0), t16=(1.0, 1.5, 2.0))
    assert tiles.choose(ms, default=4) == 8


@pytest.mark.parametrize("kernel", [tiles.AVX512, tiles.AVX2], ids=lambda k: k.name)
def test_measuring_times_every_candidate_and_width_and_restores_the_kernels_settings(kernel):
    default, path = kernel.get(), native.path()
    weights = tuple(tiles.synthetic_weight(rows=64, cols=512, qtype=t) for t in tiles.TIMED)
    ms = tiles.measure(1, kernel, candidates=(2, 4), widths=(5, 9), rounds=1, weights=weights)
    assert set(ms) == {2, 4} and all(set(by_width) == {5, 9} for by_width in ms.values())
    assert all(v > 0 for by_width in ms.values() for v in by_width.values())
    assert kernel.get() == default and native.path() == path


def test_measuring_times_one_matrix_of_each_timed_type_by_default(monkeypatch):
    """Q4_K and Q6_K, the Q4_K_M files' two types: on a Zen 4 tiles of 6 scored within the margin on Q4_K alone and
    1.12 on Q6_K. (Small matrices stand in for the 1536 x 8960 ones here.)"""
    made = []

    def small(qtype=tiles.Q4_K, **_):
        made.append(qtype)
        return real(rows=32, cols=512, qtype=qtype)

    real = tiles.synthetic_weight
    monkeypatch.setattr(tiles, "synthetic_weight", small)
    ms = tiles.measure(1, tiles.KERNELS.get(native.path(), tiles.AVX512), candidates=(2,), widths=(5,), rounds=1)
    assert made == [tiles.Q4_K, tiles.Q6_K] and set(ms) == {2}
    assert "timed on Q4_K+Q6_K" in tiles.cache_key(1)  # an entry timed on other types is measured again


@pytest.mark.parametrize("qtype", tiles.TIMED, ids=lambda t: t.name)
@pytest.mark.parametrize("path", TILED)
def test_the_synthetic_weight_is_finite_and_its_matmul_the_same_bits_in_every_tile(path, qtype):
    """What is timed is a real matmul of each timed type: finite outputs, and every tile's the same bits on each tiled
    path (so the choice is free)."""
    from verispec.models.gguf.ops import Activations

    kernel = tiles.KERNELS[path]
    native.set_path(path)
    weight = tiles.synthetic_weight(rows=32, cols=512, qtype=qtype)
    assert weight.qtype == qtype
    x = np.random.default_rng(0).standard_normal((9, 512)).astype(np.float32)
    outs = []
    for tile in (1, 3) + kernel.candidates:
        assert kernel.set(tile) == tile
        outs.append(weight(Activations(x)))
    kernel.set(0)
    native.set_path(BEST)
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    assert all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs[1:])


def test_the_tile_setters_keep_to_each_kernels_range():
    assert native.set_avx2_tile(99) == 8 and native.set_avx2_tile(0) == 8 and native.set_avx2_tile(3) == 3
    assert native.set_avx512_tile(99) == 16 and native.set_avx512_tile(5) == 5
    assert native.set_avx512_tile(0) == 16  # the kernel's own choice on every CPU (AMD's 6 was slower on a Zen 4)
    native.set_avx2_tile(0)
    native.set_avx512_tile(0)


def fake(ms):
    calls = []

    def measure_with(threads, kernel):
        calls.append(threads)
        return ms

    return measure_with, calls


def test_a_measured_choice_is_cached_per_machine_and_read_back(cache):
    measure_with, calls = fake(table(t6=(1.0, 1.8, 2.4), t16=(1.0, 1.5, 1.9)))
    first = tiles.tuned(2, measure_with)
    assert (first.tile, first.cached, calls) == (16, False, [2])
    entry = json.loads(cache.read_text())[tiles.cache_key(2)]
    assert entry["tile"] == 16 and entry["ms"]["16"]["12"] == 1.9
    again = tiles.tuned(2, fake({})[0])  # read, not measured (an empty table would fail to choose)
    assert (again.tile, again.cached, again.ms) == (16, True, first.ms)
    other, calls = fake(table(t6=(1.0, 1.5, 1.9), t16=(1.0, 1.5, 1.9)))
    tiles.tuned(1, other)  # another thread count: measured
    assert calls == [1]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"KEY": {"tile": 99, "ms": {}}}),
                                     json.dumps({"KEY": {"tile": "eight"}})])
def test_an_unreadable_or_foreign_cache_entry_is_measured_again_and_rewritten(cache, content):
    cache.parent.mkdir(parents=True)
    cache.write_text(content.replace("KEY", tiles.cache_key(2)))
    measure_with, calls = fake(table(t6=(1.0, 1.8, 2.4), t16=(1.0, 1.5, 1.9)))
    assert tiles.tuned(2, measure_with).tile == 16 and calls == [2]
    assert json.loads(cache.read_text())[tiles.cache_key(2)]["tile"] == 16


def test_a_cache_that_cannot_be_written_still_gives_the_choice(cache):
    cache.mkdir(parents=True)  # a directory where the file would go: neither read nor written
    measure_with, calls = fake(table(t6=(1.0, 1.8, 2.4), t16=(1.0, 1.5, 1.9)))
    assert tiles.tuned(2, measure_with).tile == 16 and calls == [2]
    assert cache.is_dir()


def test_the_cache_keeps_the_entries_measured_last(cache, monkeypatch):
    """Each rebuild of the kernels keys entries of its own: the file keeps the newest, not every build's."""
    monkeypatch.setattr(tiles, "KEPT_ENTRIES", 3)
    old = {"a": {"tile": 6, "measured": "2026-01-01 00:00"}, "b": {"tile": 6}, "c": {"tile": 6, "measured": "2026-03-01 00:00"},
           "d": {"tile": 6, "measured": "2026-02-01 00:00"}, "e": "not an entry", "f": {"tile": 6, "measured": 7}}
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(old))
    measure_with, calls = fake(table(t6=(1.0, 1.8, 2.4), t16=(1.0, 1.5, 1.9)))
    assert tiles.tuned(2, measure_with).tile == 16 and calls == [2]
    assert list(json.loads(cache.read_text())) == ["c", "d", tiles.cache_key(2)]  # the newest, in the file's order


def write_entry(cache, threads, tile):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({tiles.cache_key(threads): {"tile": tile, "ms": {str(tile): {"5": 1.0}}}}))


def test_tuning_off_leaves_the_kernels_own_tile(cache, monkeypatch):
    write_entry(cache, 1, 5)
    monkeypatch.setenv(tiles.ENV, "0")
    assert tiles.apply(1) is None
    assert native.avx512_tile() == native.set_avx512_tile(0)


@pytest.mark.parametrize("path", TILED)
def test_a_native_runner_applies_the_machines_tile(cache, tmp_path, path):
    native.set_path(path)
    kernel = tiles.KERNELS[path]
    write_entry(cache, 1, 5)  # a tile neither kernel takes by default (the key names the path in force)
    runner = NativeRunner(load_gguf(write_tiny_gguf(tmp_path / "m.gguf"), show_progress=False), threads=1)
    assert kernel.get() == 5
    state = runner.new_state(1)
    runner.forward(state, [[1, 2, 3]], [3])  # runs under it


def test_the_portable_path_has_no_tile_to_measure(cache):
    native.set_path("portable")
    assert tiles.apply(1) is None and not cache.exists()
