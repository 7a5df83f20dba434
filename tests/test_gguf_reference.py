"""The pure-PyTorch GGUF reference against gguf's independent numpy implementation (gguf.quants),
against hand-computed values, and against numpy re-statements of the activation contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from verispec.models.gguf.reference import (SUPPORTED, activation_block, block_shape, dequantize,
                                            quantize_activations, reference_matmul)

QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
# Byte offsets of the fp16 scale fields in each block: random bytes there could be NaN / inf / huge.
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
               T.IQ4_NL: [0], T.IQ4_XS: [0]}


def random_rows(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes_per_row) uint8: random blocks whose fp16 fields hold values in [1e-3, 1e-1]
    (sign random for d of the symmetric types and for Q4_1's m)."""
    rng = np.random.default_rng(seed)
    block, nbytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)  # (B, nbytes)
    for off in FP16_FIELDS[qtype]:
        value = rng.uniform(1e-3, 1e-1, size=blocks.shape[0])
        if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS):
            value *= rng.choice([-1.0, 1.0], size=blocks.shape[0])
        blocks[:, off:off + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def bits(y: torch.Tensor) -> np.ndarray:
    """float32 bit patterns, so that equality also distinguishes -0.0 from 0.0."""
    return y.numpy().view(np.int32)


def test_block_shapes_and_activation_blocks():
    assert block_shape(T.Q4_K) == (256, 144) and block_shape(T.F32) == (1, 4) and block_shape(T.BF16) == (1, 2)
    assert [block_shape(t) for t in QUANTIZED] == [(32, 18), (32, 20), (32, 22), (32, 24), (32, 34), (256, 84), (256, 110), (256, 144), (256, 176), (256, 210),
                                                       (32, 18), (256, 136)]
    assert [activation_block(t) for t in QUANTIZED] == [32, 32, 32, 32, 32, 256, 256, 256, 256, 256, 32, 256]
    assert activation_block(T.F32) == activation_block(T.F16) == activation_block(T.BF16) == 0
    assert SUPPORTED == frozenset({T.F32, T.F16, T.BF16, *QUANTIZED})
    assert block_shape(int(T.Q6_K)) == (256, 210)  # plain ints are accepted too


# Exact (bit-for-bit) equality, no ulp of slack: in every format the products d * q, d * sc, dmin * m and
# (d * sc) * q are exact in float32 (an 11-bit fp16 significand times small integers: at most 23 significant
# bits, Q6_K's (d * sc) * q), so the only rounding is Q4_1's "+ m" and the K-quants' "- m1", which gguf's numpy
# and ggml's C do in the same float32 order (and an FMA would not change, the product being exact).
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_random_blocks(qtype):
    cols = 512
    raw = random_rows(qtype, rows=5, cols=cols, seed=int(qtype))
    expected = quants.dequantize(raw, qtype).reshape(5, cols)  # (5, cols) float32
    got = dequantize(torch.from_numpy(raw), qtype, cols)
    assert got.shape == (5, cols) and got.dtype == torch.float32
    np.testing.assert_array_equal(bits(got), expected.view(np.int32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_dequantize_round_trips_real_data_through_gguf_quantize(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 256)).astype(np.float32)  # (6, 256)
    raw = quants.quantize(x, qtype)  # (6, bytes_per_row) uint8
    got = dequantize(torch.from_numpy(raw), qtype, 256)
    np.testing.assert_array_equal(bits(got), quants.dequantize(raw, qtype).view(np.int32))
    step = np.abs(x).reshape(6, -1, 32).max(axis=-1) / (127 if qtype == T.Q8_0 else 7)  # (6, 8)
    err = np.abs(got.numpy() - x).reshape(6, -1, 32).max(axis=-1)  # (6, 8)
    assert (err <= step * 1.01).all()  # within one quantization step of the original data


def test_dequantize_hand_built_q4_0_block():
    d = np.float16(0.5)
    qs = np.array([0x8F] + [0x08] * 15, dtype=np.uint8)  # weight 0: nibble 15, weight 16: nibble 8
    raw = np.concatenate([np.array([d]).view(np.uint8), qs])[None]  # (1, 18)
    y = dequantize(torch.from_numpy(raw), T.Q4_0, 32)[0]  # (32,)
    expected = torch.zeros(32)
    expected[0], expected[1:16], expected[16], expected[17:] = 3.5, 0.0, 0.0, -4.0
    assert torch.equal(y, expected)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_dequantize_float_types(qtype):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 100  # (4, 64)
    stored = {T.F32: x, T.F16: x.half(), T.BF16: x.bfloat16()}[qtype]
    raw = stored.view(torch.uint8)  # (4, 64 * bytes)
    got = dequantize(raw, qtype, 64)
    assert torch.equal(got, stored.float()) and got.dtype == torch.float32
    if qtype != T.BF16:  # gguf's top-level dequantize reads F32 / F16 straight from the bytes
        as_stored = raw.numpy().view(stored.numpy().dtype)  # (4, 64) float32 / float16
        np.testing.assert_array_equal(got.numpy(), quants.dequantize(as_stored, qtype))
    else:
        np.testing.assert_array_equal(bits(got), quants.dequantize(raw.numpy(), qtype).view(np.int32))


def test_dequantize_rejects_wrong_row_size():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(torch.zeros(2, 143, dtype=torch.uint8), T.Q4_K, 256)


def numpy_quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The activation contract restated in numpy float32, independently of the torch code (blocks of 32 keep their
    scale in half precision, as llama.cpp's block_q8_0 does)."""
    xb = x.reshape(x.shape[0], -1, block).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    if block == 32:
        d = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)  # np.rint: half to even
    return q.reshape(x.shape), d


def test_quantize_activations_hand_computed():
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5,  # amax 127: d = 1, ties 2.5 -> 2, -3.5 -> -4, 0.5 -> 0
                       -254.0, 5.0, 3.0, 1.0,  # amax 254: d = 2, x * inv = -127, 2.5, 1.5, 0.5
                       0.0, 0.0, 0.0, 0.0]])  # all zero: d = 0, q = 0
    q, d = quantize_activations(x, 4)
    assert q.dtype == torch.int8 and d.dtype == torch.float32
    assert q.tolist() == [[127, 2, -4, 0, -127, 2, 2, 0, 0, 0, 0, 0]]
    assert d.tolist() == [[1.0, 2.0, 0.0]]


@pytest.mark.parametrize("block", [32, 256])
def test_quantize_activations_matches_contract_and_error_bound(block):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * block, generator=gen) * torch.logspace(-3, 2, 7)[:, None]  # (7, 2 * block)
    x[0, :block] = 0.0  # a zero block
    q, d = quantize_activations(x, block)
    assert q.shape == (7, 2 * block) and d.shape == (7, 2)
    q_np, d_np = numpy_quantize_activations(x.numpy(), block)
    np.testing.assert_array_equal(q.numpy(), q_np)
    np.testing.assert_array_equal(d.numpy(), d_np)
    assert q.abs().max() == 127 and (q[0, :block] == 0).all() and d[0, 0] == 0
    d_full = d.double().repeat_interleave(block, dim=1)  # (7, 2 * block)
    slack = 127 * 2.0**-11 if block == 32 else 1e-6  # a scale kept in half precision is off by up to 2^-11 of itself
    assert ((q.double() * d_full - x.double()).abs() <= d_full * (0.5 + slack)).all()


def test_quantize_activations_rounds_half_to_even_after_float32_multiply():
    # amax 127 * 2: d = 2, inv = 0.5 exactly; odd integers become exact .5 ties.
    x = torch.tensor([[254.0] + [float(2 * i + 1) for i in range(31)]])  # (1, 32)
    q, _ = quantize_activations(x, 32)
    expected = [127] + [round((2 * i + 1) / 2) for i in range(31)]  # Python round: half to even
    assert q[0].tolist() == expected
    assert q[0, 1:4].tolist() == [0, 2, 2]  # 0.5, 1.5, 2.5: not 1, 2, 3 (half away from zero)


def test_quantize_activations_multiplies_by_127_over_amax():
    # Near-ties found by search, where x * (127 / amax) rounds differently from x * (1 / d) and x / d
    # (which give 124, 61, 91): a kernel using either of those would break the contract.
    amax = [1.4099537, 0.94956785, 1.2287531]  # each exact in float32 (shortest repr)
    x = torch.zeros(1, 96)  # (1, 96): three blocks of 32
    x[0, 0::32], x[0, 1::32] = torch.tensor(amax), torch.tensor([1.3710967, 0.45983008, 0.8852827])
    q, _ = quantize_activations(x, 32)
    assert q[0, 0::32].tolist() == [127] * 3 and q[0, 1::32].tolist() == [123, 62, 92]


def test_quantize_activations_near_ties_match_contract():
    # Values at and one ulp either side of x * 127 / amax = k + 0.5, over many amax: here a 1-ulp
    # difference in inv (e.g. from 1 / d, or torch's `127.0 / t` = t.reciprocal() * 127) flips q.
    rng = np.random.default_rng(6)
    scale = np.float32(2.0) ** rng.integers(-20, 20, size=(4096, 1))  # (4096, 1)
    amax = rng.uniform(0.5, 2.0, size=(4096, 1)).astype(np.float32) * scale  # (4096, 1)
    ties = ((rng.integers(0, 127, size=(4096, 31)) + 0.5) * amax / 127).astype(np.float32)  # (4096, 31)
    ties = np.nextafter(ties, ties * rng.choice([0.0, 1.0, 2.0], size=ties.shape).astype(np.float32))
    x = np.concatenate([amax * rng.choice([-1, 1], size=(4096, 1)), ties * rng.choice([-1, 1], size=ties.shape)], 1)
    x = x.astype(np.float32).reshape(128, 32 * 32)  # (128, 1024): blocks of 32
    q, d = quantize_activations(torch.from_numpy(x), 32)
    q_np, d_np = numpy_quantize_activations(x, 32)
    np.testing.assert_array_equal(q.numpy(), q_np)
    np.testing.assert_array_equal(d.numpy().view(np.int32), d_np.view(np.int32))


@pytest.mark.parametrize("qtype", QUANTIZED + [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_reference_matmul(qtype):
    rows, cols = 16, 512
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, cols, generator=gen)  # (3, cols)
    if qtype in QUANTIZED:  # real weights quantized by gguf where it can, random blocks otherwise
        w_true = np.random.default_rng(5).standard_normal((rows, cols)).astype(np.float32) * 0.05
        raw = quants.quantize(w_true, qtype) if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) else random_rows(qtype, rows, cols)
        w = quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)  # (rows, cols)
        q_np, d_np = numpy_quantize_activations(x.numpy(), activation_block(qtype))
        xa = q_np.astype(np.float64) * np.repeat(d_np.astype(np.float64), activation_block(qtype), axis=1)
        raw = torch.from_numpy(raw)
    else:
        stored = (torch.randn(rows, cols, generator=gen) * 0.05).to({T.F32: torch.float32, T.F16: torch.float16,
                                                                    T.BF16: torch.bfloat16}[qtype])
        raw, w, xa = stored.view(torch.uint8), stored.double().numpy(), x.double().numpy()
    got = reference_matmul(raw, qtype, cols, x)
    assert got.shape == (3, rows) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), xa @ w.T, rtol=1e-12, atol=1e-12)
    approx = x @ dequantize(raw, qtype, cols).T  # (3, rows) float32, unquantized activations
    rel = (got - approx.double()).norm() / approx.double().norm()
    # int8 activations: about 0.7% of the product's size on random blocks (0.5-1.1% over seeds and types: the ratio
    # rests on a few large outputs), against 1e-6 for float weights
    assert rel < (2e-2 if activation_block(qtype) else 1e-6)


def test_unsupported_type_raises_naming_it():
    for call in (lambda: block_shape(T.IQ2_XXS), lambda: activation_block(T.IQ2_XXS),
                 lambda: dequantize(torch.zeros(1, 66, dtype=torch.uint8), T.IQ2_XXS, 256)):
        with pytest.raises(ValueError, match=r"GGUF tensor type IQ2_XXS is not supported \(supported: .*Q4_K"):
            call()
