"""The C kernels against the pure-torch reference (verispec.models.gguf.reference), per type and shape;
the SIMD and portable paths against each other, bit for bit; every kernel's batch invariance."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from tiny_gguf import ALL_TYPES, QUANTIZED, SCALE_FIELDS, T, random_raw
from verispec.errors import VerispecError
from verispec.models.gguf import native, reference
from verispec.models.gguf.ops import Activations, Weight, gelu_mul, rmsnorm, rope, rope_table, silu_mul
from verispec.models.gguf.native import lib, ptr

BEST = native.path()
PATHS = [p for p in ("portable", "avx2", "avx-vnni", "avx512-vnni", "amx-emulated", "amx") if native.set_path(p) == p]
# (path, the widest tile of the path's kernel, the fewest tokens for the AMX tiles): every path as it runs by default,
# the VNNI kernel's tiles of 6, 8 and 16 (its own; past 8 its sums spill), the AVX2 kernel's of 3 and 5 (native
# runners set the tiles measured on their machine, models/gguf/tiles.py), and where the CPU has AMX its tiles forced
# from 1 token (every tile through the real tile kernels) and from 5 (tiles of 16 and remainders on the VNNI kernel,
# for every type)
AVX2_PATHS = ("avx2", "avx-vnni")
SETTINGS = ([(p, 0, 0) for p in PATHS] + [("avx512-vnni", t, 0) for t in (6, 8, 16) if "avx512-vnni" in PATHS]
            + [(p, t, 0) for p in AVX2_PATHS for t in (3, 5) if p in PATHS]
            + [("amx", 0, m) for m in (1, 5) if "amx" in PATHS])


def use(path, tile, amx_min):
    assert native.set_path(path) == path
    native.set_avx512_tile(0 if path in AVX2_PATHS else tile)
    native.set_avx2_tile(tile if path in AVX2_PATHS else 0)
    native.set_amx_min(amx_min)


def restore():
    native.set_avx512_tile(0)
    native.set_avx2_tile(0)
    native.set_amx_min(0)
native.set_path(BEST)


@pytest.fixture(autouse=True)
def best_path_afterwards():
    yield
    native.set_path(BEST)


def make(qtype, rows, cols, seed=0):
    raw = random_raw(np.random.default_rng(seed), qtype, rows, cols)
    return raw, Weight.from_raw("w", int(qtype), raw, rows, cols)


def raw_rows(raw: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1))


def test_a_block_of_32s_scale_is_rounded_to_half_precision_as_torch_rounds_it():
    """The scales of blocks of 32 are llama.cpp's halves: rounded to nearest, ties to even, half's subnormals below
    2^-14 (multiples of 2^-24), infinity from 65520 up; the kernel's rounding equals torch's float16 cast."""
    rng = np.random.default_rng(9)
    # amax / 127 at: half's normal range, its subnormals, the smallest half and below, exact ties between two halves
    # (1 + (2k + 1) 2^-11), the overflow edge, and plain random values
    scales = np.concatenate([np.float32(2.0) ** rng.integers(-30, 16, 200), rng.uniform(1e-9, 6e-5, 100),
                             [2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-26, 65504.0, 65519.0, 65520.0, 70000.0],
                             1 + (2 * rng.integers(0, 1023, 60) + 1) * 2.0**-11]).astype(np.float32)
    amax = (scales * np.float32(127)).astype(np.float32)
    x = np.zeros((len(amax), 32), np.float32)
    x[:, 0] = amax
    x[:, 1:] = rng.uniform(-1, 1, (len(amax), 31)).astype(np.float32) * amax[:, None]
    _, d, _ = Activations(x).quantize(32)
    expected = (amax / np.float32(127)).astype(np.float32)
    assert np.array_equal(d[:, 0].view(np.int32), torch.from_numpy(expected).half().float().numpy().view(np.int32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,n", [(16, 256, 1), (40, 512, 7), (300, 768, 5)])
def test_matmul_equals_the_reference_up_to_float32_summation_order(qtype, rows, cols, n):
    raw, weight = make(qtype, rows, cols)
    x = np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32)
    expected = reference.reference_matmul(raw_rows(raw, rows), qtype, cols, torch.from_numpy(x)).numpy()  # (n, rows)
    for path in PATHS:
        native.set_path(path)
        out = weight(Activations(x))
        assert out.shape == (n, rows)
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6 * np.abs(expected).max(), err_msg=path)


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU has no SIMD path to compare")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_simd_and_portable_paths_give_the_same_bits(qtype):
    raw, weight = make(qtype, 48, 512, seed=2)
    x = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    outs = []
    for path in PATHS:
        assert native.set_path(path) == path
        outs.append(weight(Activations(x)))
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_the_tile_kernel_gives_every_paths_bits_at_every_width(qtype):
    """The AMX kernel (emulated tiles on every machine, the real ones where the CPU has them) against the portable
    path and the other SIMD paths, bit for bit, for widths from 1 to 70 tokens (AMX tiles of 16: full, partial and
    several; from two whole tiles on, group_wide's tiles in pairs, an odd one alone (48, 49), and the rest after them;
    the real path sends a type's matmuls to its tiles from the measured number of tokens (Q4_K 16, Q5_K 12, other
    types never) and the remainder to the VNNI kernel, forced here from 1 and 5 tokens; the VNNI kernel's tiles of
    up to 6, 8 or 16 (its own), all run here, and AVX2's of up to 4, split evenly: with 6, 7 as 3 + 4 and 13 as
    4 + 4 + 5; with 8, 7 and 8 in one tile, 9 as 4 + 5, 17 as 5 + 6 + 6; with 16, 9 to 16 in one tile, 17 as 8 + 9,
    33 as 11 + 11 + 11) and rows that end mid-group."""
    raw, weight = make(qtype, 40, 512, seed=6)
    x = np.random.default_rng(7).standard_normal((70, 512)).astype(np.float32) * 3
    native.set_path("portable")
    expected = weight(Activations(x))
    alone = np.concatenate([weight(Activations(x[i : i + 1].copy())) for i in range(70)])
    assert np.array_equal(expected, alone)
    try:
        for threads in (1, 2):
            native.set_threads(threads)
            for setting in SETTINGS:
                use(*setting)
                for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 24, 31, 32, 33, 35, 48, 49, 64, 70):
                    assert np.array_equal(weight(Activations(x[:n].copy())), expected[:n]), (setting, n, threads)
    finally:
        native.set_threads(1)
        restore()


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


@pytest.mark.skipif("avx512-vnni" not in PATHS, reason="no AVX-512 VNNI kernel on this CPU")
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_the_one_token_tiles_prefetching_or_not_give_the_same_bits_and_default_by_vendor(qtype):
    """The AVX-512 kernel's one-token tiles leave their weights to the hardware prefetchers on AMD CPUs and ask for
    them ahead elsewhere (csrc/cpu.h); either way the same bits as the portable path, at one token and past it."""
    _, weight = make(qtype, 40, 512, seed=8)
    x = np.random.default_rng(9).standard_normal((3, 512)).astype(np.float32)
    native.set_path("portable")
    expected = [weight(Activations(x[:n].copy())) for n in (1, 3)]
    try:
        assert native.set_prefetch_one(-1) == (cpu_vendor() != "AuthenticAMD")
        assert (native.set_prefetch_one(1), native.set_prefetch_one(7), native.set_prefetch_one(0)) == (True, True, False)
        native.set_path("avx512-vnni")
        for on in (1, 0):
            native.set_prefetch_one(on)
            for threads in (1, 2):
                native.set_threads(threads)
                for n, want in zip((1, 3), expected):
                    assert np.array_equal(weight(Activations(x[:n].copy())), want), (on, threads, n)
    finally:
        native.set_threads(1)
        native.set_prefetch_one(-1)


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU has no SIMD path to compare")
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", (0xFF, 0x7F, 0x80))
def test_the_largest_integer_sums_give_every_paths_bits(qtype, fill):
    """Every byte of the blocks but the fp16 scales set to one pattern (0xFF: every K-quant at its largest value), times
    activations all at +127, all at -127 and of mixed signs: the integer sums are at their largest. The AVX2 kernel
    adds vpmaddubsw's pairs as int16 over runs of slots (8 for values below 16, 4 below 32, 2 below 64); a run one
    slot too long wraps here, on any path that gets it wrong, and the bits part from the portable path's."""
    raw = random_raw(np.random.default_rng(9), qtype, 40, 512)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    extreme = np.full_like(blocks, fill)
    for offset in SCALE_FIELDS[qtype]:
        extreme[:, offset : offset + 2] = blocks[:, offset : offset + 2]
    weight = Weight.from_raw("w", int(qtype), extreme.reshape(raw.shape), 40, 512)
    x = np.ones((9, 512), np.float32)
    x[1::3] = -1.0
    x[2::3] = np.where(np.random.default_rng(10).random((3, 512)) < 0.5, -1.0, 1.0)
    native.set_path("portable")
    expected = weight(Activations(x))
    try:
        for setting in SETTINGS:
            use(*setting)
            for n in (1, 3, 9):
                assert np.array_equal(weight(Activations(x[:n].copy())), expected[:n]), (setting, n)
    finally:
        restore()


def test_the_emulated_tiles_follow_the_instructions_semantics():
    """The emulation's tile product is tdpbsud's: signed bytes of A times unsigned bytes of B, four to a dword, added
    to C; checked here against numpy on extreme values (-128, 255), where a sign slip would show."""
    raw, weight = make(T.Q8_0, 16, 64, seed=8)  # Q8_0 stores q + 128: every unsigned byte value occurs
    x = np.full((16, 64), -1.0, dtype=np.float32)
    x[::2] = 1.0  # quantized to -127 / 127: the extreme products
    native.set_path("portable")
    expected = weight(Activations(x))
    native.set_path("amx-emulated")
    assert np.array_equal(weight(Activations(x)), expected)


def test_the_real_tiles_are_used_where_the_cpu_and_os_allow_them():
    status = native.amx_status()
    if status != "usable":
        pytest.skip(f"AMX is {status} here: only the emulated tile kernel runs (tested above)")
    assert "amx" in PATHS and BEST == "amx"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_a_tokens_matmul_row_is_the_same_bits_in_any_batch(qtype):
    raw, weight = make(qtype, 40, 512, seed=4)
    x = np.random.default_rng(5).standard_normal((13, 512)).astype(np.float32)
    try:
        for setting in SETTINGS:
            use(*setting)
            alone = np.concatenate([weight(Activations(x[i : i + 1].copy())) for i in range(13)])
            for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13):  # tiles of up to 4 (6, 8 or 16 on AVX-512), split evenly
                assert np.array_equal(weight(Activations(x[:n].copy())), alone[:n]), (setting, n)
    finally:
        restore()


def test_thread_count_does_not_change_the_bits():
    raw, weight = make(T.Q4_K, 160, 512, seed=6)
    x = np.random.default_rng(7).standard_normal((5, 512)).astype(np.float32)
    native.set_threads(1)
    one = weight(Activations(x))
    native.set_threads(2)
    two = weight(Activations(x))
    assert np.array_equal(one, two)


@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantization_is_the_reference_bit_for_bit(block):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 100, size=(5, 1))).astype(np.float32)
    x[2, :block] = 0.0  # an all-zero block
    x[3, :block] = 1e-39  # 127 / amax overflows: zeros, not NaN
    q, d, bsum = Activations(x).quantize(block)
    q_ref, d_ref = reference.quantize_activations(torch.from_numpy(x), block)
    assert np.array_equal(q, q_ref.numpy()) and np.array_equal(d, d_ref.numpy())
    assert np.array_equal(bsum, q.reshape(5, -1, 16).astype(np.int32).sum(-1))
    assert not q[3, :block].any()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_equal_the_reference_dequantization(qtype):
    raw, weight = make(qtype, 40, 512, seed=9)
    ids = np.array([0, 17, 39, 17])
    expected = reference.dequantize(raw_rows(raw, 40), qtype, 512)[torch.from_numpy(ids)].numpy()
    np.testing.assert_allclose(weight.take_rows(ids), expected, rtol=1e-6, atol=1e-9)
    with pytest.raises(VerispecError, match="out of range"):
        weight.take_rows(np.array([40]))


def test_an_unsupported_type_or_a_truncated_tensor_is_one_clear_error():
    rng = np.random.default_rng(0)
    with pytest.raises(VerispecError, match=r"blk\.3\.ffn_up\.weight.*IQ2_XXS.*supported: "):
        Weight.from_raw("blk.3.ffn_up.weight", int(T.IQ2_XXS), rng.integers(0, 255, (16, 66), dtype=np.uint8), 16, 256)
    raw = random_raw(rng, T.Q4_K, 16, 256)
    with pytest.raises(VerispecError, match="damaged or truncated"):
        Weight.from_raw("token_embd.weight", int(T.Q4_K), raw[:-1], 16, 256)


def torch_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, neox: bool) -> torch.Tensor:
    """x (N, H, D): the rotation as transformers writes it (halves), or on adjacent pairs."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    angle = positions.double()[:, None] * freqs[None]  # (N, D/2)
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]  # (N, 1, D/2)
    a, b = (x[..., : d // 2], x[..., d // 2 :]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.cat([ra, rb], -1) if neox else torch.stack([ra, rb], -1).flatten(-2)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_equals_the_torch_rotation(neox):
    x = torch.randn(6, 3 * 64)
    positions = torch.tensor([0, 1, 7, 100, 1000, 4095])
    mine = x.numpy().copy()
    rope(mine, 3, rope_table(positions.numpy(), 64, 10000.0), neox)
    expected = torch_rope(x.reshape(6, 3, 64), positions, 10000.0, neox).reshape(6, -1)
    torch.testing.assert_close(torch.from_numpy(mine), expected, rtol=1e-5, atol=1e-5)


def test_rmsnorm_and_swiglu_equal_torch_and_are_row_invariant():
    x = torch.randn(5, 300)
    w = torch.randn(300)
    out = rmsnorm(x.numpy(), w.numpy(), 1e-6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(rmsnorm(x[2:3].numpy().copy(), w.numpy(), 1e-6)[0], out[2])
    g, u = torch.randn(4, 1000) * 10, torch.randn(4, 1000)
    out = silu_mul(g.numpy(), u.numpy())
    torch.testing.assert_close(torch.from_numpy(out), torch.nn.functional.silu(g) * u, rtol=2e-6, atol=1e-6)
    # an element's value does not depend on where it falls in a vector: a 17-element tail, an offset slice
    part = silu_mul(g.numpy()[1, 3:20].copy(), u.numpy()[1, 3:20].copy())
    assert np.array_equal(part, out[1, 3:20])


def attend(q, keys, values, prefix, extra, cap: float = 0.0, head_major: bool = True, half: bool = False):
    """vs_attention on one cache for all queries (scores soft-capped at `cap`: vs_attention_capped; half: the cache
    holds keys and values as float16, vs_attention_cache). q (N, Hq, D); keys, values (L, Hkv, D), laid out for the
    kernel head-major (Hkv, L, D) as the runner's caches are, or as given (a column holding every head)."""
    n, hq, d = q.shape
    length, hkv = keys.shape[:2]
    if head_major:
        keys, values = np.ascontiguousarray(keys.swapaxes(0, 1)), np.ascontiguousarray(values.swapaxes(0, 1))
        stride, head_stride = d, np.full(n, length * d, np.int64)
    else:
        keys, values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
        stride, head_stride = hkv * d, np.full(n, d, np.int64)
    q = np.ascontiguousarray(q)
    kb = np.full(n, keys.ctypes.data, np.int64)
    vb = np.full(n, values.ctypes.data, np.int64)
    off = np.zeros(n + 1, np.int32)
    off[1:] = np.cumsum([len(e) for e in extra])
    flat = np.array([c for e in extra for c in e] or [0], np.int32)
    pre = np.array(prefix, np.int32)
    out = np.empty((n, hq * d), np.float32)
    if half:
        assert keys.dtype == values.dtype == np.float16
        status = lib().vs_attention_cache(ptr(q), n, hq, hkv, d, 1 / np.sqrt(d), ptr(kb), ptr(vb), stride,
                                          ptr(head_stride), ptr(pre), ptr(off), ptr(flat), ptr(out), cap, 1)
    elif cap:
        status = lib().vs_attention_capped(ptr(q), n, hq, hkv, d, 1 / np.sqrt(d), ptr(kb), ptr(vb), stride,
                                           ptr(head_stride), ptr(pre), ptr(off), ptr(flat), ptr(out), cap)
    else:
        status = lib().vs_attention(ptr(q), n, hq, hkv, d, 1 / np.sqrt(d), ptr(kb), ptr(vb), stride, ptr(head_stride),
                                    ptr(pre), ptr(off), ptr(flat), ptr(out))
    assert status == 0
    return out.reshape(n, hq, d)


def test_attention_equals_torch_and_each_query_is_the_same_bits_alone():
    rng = np.random.default_rng(10)
    keys = rng.standard_normal((20, 2, 32)).astype(np.float32)  # (L, Hkv, D)
    values = rng.standard_normal((20, 2, 32)).astype(np.float32)
    q = rng.standard_normal((4, 6, 32)).astype(np.float32)  # (N, Hq, D): 3 query heads per key/value head
    prefix, extra = [5, 12, 10, 10], [[], [], [13, 15], [12, 16, 19]]  # the last two: tree nodes
    out = attend(q, keys, values, prefix, extra)
    for i in range(4):
        columns = list(range(prefix[i])) + extra[i]
        k = torch.from_numpy(keys[columns]).repeat_interleave(3, dim=1)  # (C, Hq, D)
        v = torch.from_numpy(values[columns]).repeat_interleave(3, dim=1)
        weights = torch.softmax(torch.einsum("hd,chd->hc", torch.from_numpy(q[i]), k) / np.sqrt(32), -1)  # (Hq, C)
        torch.testing.assert_close(torch.from_numpy(out[i]), torch.einsum("hc,chd->hd", weights, v), rtol=1e-5, atol=1e-5)
        assert np.array_equal(attend(q[i : i + 1], keys, values, prefix[i : i + 1], extra[i : i + 1])[0], out[i])


def test_soft_capped_attention_equals_torch_on_every_path_and_alone():
    """Gemma 2's soft-cap, c tanh(s / c) on each score before the softmax, against torch; the AVX-512 kernel (which
    reads a run's shared prefix once) and the portable one give the same bits, and each query alone the same."""
    rng = np.random.default_rng(12)
    keys = (rng.standard_normal((40, 2, 32)) * 3).astype(np.float32)  # (L, Hkv, D): large scores, the cap binds
    values = rng.standard_normal((40, 2, 32)).astype(np.float32)
    q = (rng.standard_normal((5, 4, 32)) * 3).astype(np.float32)
    prefix, extra, cap = [20, 33, 21, 21, 40], [[], [], [24, 30], [22], []], 5.0
    outs = []
    for path in PATHS:
        native.set_path(path)
        outs.append(attend(q, keys, values, prefix, extra, cap))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    out = outs[0]
    for i in range(5):
        columns = list(range(prefix[i])) + extra[i]
        k = torch.from_numpy(keys[columns]).repeat_interleave(2, dim=1)  # (C, Hq, D)
        v = torch.from_numpy(values[columns]).repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,chd->hc", torch.from_numpy(q[i]), k) / np.sqrt(32)  # (Hq, C)
        assert scores.abs().max() > 2 * cap  # the cap binds
        weights = torch.softmax(cap * torch.tanh(scores / cap), -1)
        torch.testing.assert_close(torch.from_numpy(out[i]), torch.einsum("hc,chd->hd", weights, v), rtol=1e-5, atol=1e-5)
        assert np.array_equal(attend(q[i : i + 1], keys, values, prefix[i : i + 1], extra[i : i + 1], cap)[0], out[i])


def test_a_tree_nodes_attention_equals_the_chains_over_the_same_entries_bit_for_bit():
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((12, 1, 16)).astype(np.float32)
    values = rng.standard_normal((12, 1, 16)).astype(np.float32)
    chain_keys, chain_values = keys.copy(), values.copy()
    chain_keys[8:10], chain_values[8:10] = keys[[9, 11]], values[[9, 11]]  # the node's path laid out as a chain
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    node = attend(q, keys, values, [8], [[9, 11]])
    chain = attend(q, chain_keys, chain_values, [10], [[]])
    assert np.array_equal(node, chain)


def test_every_supported_type_is_covered_here():
    assert {int(t) for t in ALL_TYPES} == {int(t) for t in reference.SUPPORTED}
    assert set(QUANTIZED) == set(reference.SUPPORTED) - {T.F32, T.F16, T.BF16}


# head sizes whose 16-float chunks the AVX-512 kernel weighs 6 or 4 heads (64, 128, 256 in blocks of 4 chunks), 8, 4
# or 2 heads (16, 32, 64), three or two (128, 256 in blocks of 8 chunks), or one head at a time (48, 80), with
# query heads per key/value head that fill those groups and leave a remainder; columns: fewer than 16 (no block of
# 16 scores), whole and partial blocks of 16 scores and of 32 weighed columns, a tree's extra columns after the
# prefix; a chain of queries on one cache (which the kernel reads together over their shared prefix), with one and
# two key/value heads (runs split for two threads); caches head-major and with every head in a column
@pytest.mark.parametrize("dim, group", [(64, 6), (64, 10), (16, 11), (32, 6), (48, 3), (80, 2), (128, 7), (128, 6), (256, 1),
                                        (256, 4)])
def test_attention_paths_give_the_same_bits(dim, group):
    rng = np.random.default_rng(12 + dim)
    layouts = [([40, 17, 30, 9, 70], [[], [20, 33], [31], [], [71, 72, 74]]),  # rows' queries, tree nodes
               ([66, 67, 68, 69, 70, 71, 50], [[]] * 6 + [[66, 69]]),  # a chain, then a node
               ([40, 40, 40], [[41, 43], [42, 44], [45, 46]])]  # sibling nodes: equal counts, other columns
    for heads in (2, 1):
        keys = rng.standard_normal((75, heads, dim)).astype(np.float32) * 3
        values = rng.standard_normal((75, heads, dim)).astype(np.float32)
        keys16, values16 = keys.astype(np.float16), values.astype(np.float16)
        for prefix, extra in layouts:
            q = rng.standard_normal((len(prefix), heads * group, dim)).astype(np.float32)
            outs, halves = [], []
            for path in PATHS:
                native.set_path(path)
                for threads in (1, 2):
                    native.set_threads(threads)
                    outs.append(attend(q, keys, values, prefix, extra))
                    outs.append(attend(q, keys, values, prefix, extra, head_major=False))  # every head in a column
                    # a half cache: the float cache's values rounded to halves, read as exactly those floats
                    halves.append(attend(q, keys16, values16, prefix, extra, half=True))
                    halves.append(attend(q, keys16, values16, prefix, extra, head_major=False, half=True))
            native.set_threads(1)
            for other in outs[1:]:
                assert np.array_equal(outs[0], other)
            widened = attend(q, keys16.astype(np.float32), values16.astype(np.float32), prefix, extra)
            assert not np.array_equal(widened, outs[0])  # the rounding shows
            for other in halves:
                assert np.array_equal(widened, other)
            for i in range(len(prefix)):  # each query alone: the same bits
                assert np.array_equal(attend(q[i : i + 1], keys, values, prefix[i : i + 1], extra[i : i + 1])[0], outs[-1][i])


def test_the_half_caches_rounding_is_numpys_float16_cast():
    """What the fused layer writes to a half cache (vs_to_half) is what the per-op path's numpy assignment writes:
    round to nearest, ties to even, through the subnormals, to inf from 65520, NaN kept NaN with its sign."""
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.996, 65520, -65520, 1e9, 2.0**-24,
                        2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 * (1 - 2.0**-11), 1 + 2.0**-11, 1 + 3 * 2.0**-11,
                        np.finfo(np.float32).max, np.finfo(np.float32).tiny], np.float32)
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)  # every exponent, signs
    for x in (special, bits, (rng.standard_normal(100_000) * 10).astype(np.float32)):
        out = np.empty(x.size, np.uint16)
        assert lib().vs_to_half(ptr(x), x.size, ptr(out)) == 0
        with np.errstate(over="ignore", invalid="ignore"):
            expected = x.astype(np.float16)
        nan = np.isnan(x)
        assert np.array_equal(out[~nan], expected[~nan].view(np.uint16))
        assert np.isnan(out[nan].view(np.float16)).all()
        assert np.array_equal(out[nan] >> 15, x[nan].view(np.uint32) >> 31)  # the sign stays


def test_gelu_mul_is_llamacpps_geglu_through_halves():
    """Gemma's GeGLU as llama.cpp's CPU backend computes it: the gate rounded to half, GELU's tanh form in float32
    (libm's tanhf) rounded to half, times up; 0 at and below -10, the gate itself at and above 10. Every half in
    (-10, 10) and random values between and beyond; the kernel reads a table, this reference computes each."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves) & (np.abs(halves) < 10)]
    gate = np.concatenate([halves, np.random.default_rng(0).uniform(-12, 12, 3000), [-10, 10]]).astype(np.float32)
    up = np.random.default_rng(1).uniform(-2, 2, gate.size).astype(np.float32)
    h = torch.from_numpy(gate).half().float().numpy()
    f32 = np.float32
    inner = f32(0.79788456080286535587989211986876) * h * (f32(1) + f32(0.044715) * h * h)
    tanh = np.array([libm.tanhf(float(v)) for v in inner], np.float32)
    gelu = torch.from_numpy(f32(0.5) * h * (f32(1) + tanh)).half().float().numpy()
    expected = np.where(gate <= -10, f32(0), np.where(gate >= 10, gate, gelu) * up).astype(np.float32)
    got = gelu_mul(gate[None].copy(), up[None].copy())[0]
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))
