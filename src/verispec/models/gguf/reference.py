"""Pure-PyTorch reference for the GGUF block formats the C kernels read.

The kernels are fast and opaque; this module is slow and plain, and the tests hold them to it.
`dequantize` turns GGUF rows, as stored, into float32 weights with ggml's own formulas, in float32
and in the order of ggml's C `dequantize_row_*`, so it agrees with ggml bit for bit.
`quantize_activations` is the contract for the int8 activations the kernels multiply with: its
arithmetic is spelled out so that a C kernel reproduces the int8 values bit for bit.
`reference_matmul` is what a kernel computes, in float64: only the kernel's float32 summation
order may differ from it.

Block layouts (little-endian; fp16 fields read with `.view(torch.float16)`):
  Q4_0  32 weights, 18 bytes:  d, qs[16]                  y = (q - 8) * d
  Q4_1  32 weights, 20 bytes:  d, m, qs[16]               y = q * d + m
  Q5_0  32 weights, 22 bytes:  d, qh[4], qs[16]           y = (q - 16) * d, q's 5th bit l from bit l of qh
  Q5_1  32 weights, 24 bytes:  d, m, qh[4], qs[16]        y = q * d + m
  Q8_0  32 weights, 34 bytes:  d, qs[32] int8             y = q * d
  Q2_K 256 weights, 84 bytes:  scales[16], qs[64], d, dmin          y = (d*(sc&15)) * q - dmin*(sc>>4), per 16
  Q3_K 256 weights, 110 bytes: hmask[32], qs[64], scales[12], d      y = (d*(sc-32)) * (q - 4), 3-bit q, per 16
  Q4_K 256 weights, 144 bytes: d, dmin, scales[12], qs[128]           y = (d*sc) * q - (dmin*m)
  Q5_K 256 weights, 176 bytes: d, dmin, scales[12], qh[32], qs[128]   same, q gets a 5th bit from qh
  Q6_K 256 weights, 210 bytes: ql[128], qh[64], scales[16] int8, d    y = (d*sc) * (q - 32)
  IQ4_NL  32 weights, 18 bytes:  d, qs[16]                  y = d * K[q], K = ggml's kvalues_iq4nl
  IQ4_XS 256 weights, 136 bytes: d, scales_h, scales_l[4], qs[128]    y = (d * (ls - 32)) * K[q], ls 6 bits a 32
"""

from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
SUPPORTED = FLOAT_TYPES | {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS}


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    """qtype as a supported GGMLQuantizationType, or a ValueError naming it."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        pass
    if qtype not in SUPPORTED:
        name = getattr(qtype, "name", str(qtype))
        supported = ", ".join(t.name for t in sorted(SUPPORTED))
        raise ValueError(f"GGUF tensor type {name} is not supported (supported: {supported})")
    return qtype


def block_shape(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a type, e.g. Q4_K -> (256, 144), F32 -> (1, 4)."""
    return tuple(GGML_QUANT_SIZES[_qtype(qtype)])


def activation_block(qtype: GGMLQuantizationType | int) -> int:
    """How many activations share one int8 scale when multiplied with weights of this type:
    256 for the K-quants and IQ4_XS, 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL (llama.cpp's Q8_K and Q8_0
    activations), 0 for float types (activations stay float32)."""
    qtype = _qtype(qtype)
    return 0 if qtype in FLOAT_TYPES else block_shape(qtype)[0]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(B, 2) uint8 little-endian fp16 fields -> (B,) float32 (exact)."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2, n) uint8: the low nibbles, then the high nibbles."""
    return torch.stack([qs & 0xF, qs >> 4], dim=-2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])  # (B,)
    q = _nibbles(b[:, 2:18]).flatten(1).float() - 8  # (B, 32): y[l] low nibble, y[l + 16] high
    return q * d[:, None]  # (B, 32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (B,), (B,)
    q = _nibbles(b[:, 4:20]).flatten(1).float()  # (B, 32)
    return q * d[:, None] + m[:, None]  # (B, 32): product then sum, two float32 roundings


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(B, 4) uint8, a little-endian 32-bit word -> (B, 32) uint8: bit l of the word, times 16."""
    bits = torch.arange(32)  # (32,)
    word = qh.long()[:, bits // 8] >> (bits % 8)  # (B, 32)
    return ((word & 1) << 4).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])  # (B,)
    q = (_nibbles(b[:, 6:22]).flatten(1) | _fifth_bits(b[:, 2:6])).float() - 16  # (B, 32)
    return q * d[:, None]  # (B, 32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (B,), (B,)
    q = (_nibbles(b[:, 8:24]).flatten(1) | _fifth_bits(b[:, 4:8])).float()  # (B, 32)
    return q * d[:, None] + m[:, None]  # (B, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])  # (B,)
    q = b[:, 2:34].view(torch.int8).float()  # (B, 32)
    return q * d[:, None]  # (B, 32)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4: (B, 12) uint8 -> 6-bit (sc, m), each (B, 8) uint8.

    Sub-blocks 0..3 take the low 6 bits of bytes 0..3 (sc) and 4..7 (m); sub-blocks 4..7 take a
    nibble of bytes 8..11 (sc low, m high) and the top 2 bits of bytes 0..3 (sc) and 4..7 (m)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # (B, 4) each
    sc = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)  # (B, 8)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)  # (B, 8)
    return sc, m


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: q (B, 8, 32) float32 quants of the 8 sub-blocks -> (B, 256) float32."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (B,), (B,)
    sc, m = _scale_min_k4(b[:, 4:16])  # (B, 8), (B, 8)
    d1 = d[:, None] * sc.float()  # (B, 8) float32, as ggml's d1 = d * sc
    m1 = dmin[:, None] * m.float()  # (B, 8) float32, as ggml's m1 = min * m
    return (d1[..., None] * q - m1[..., None]).flatten(1)  # (B, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[:, 16:144].reshape(-1, 4, 32)  # (B, 4, 32): one 64-weight chunk per row
    return _k_affine(b, _nibbles(qs).reshape(-1, 8, 32).float())  # chunk c: sub-blocks 2c (low), 2c+1 (high)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48]  # (B, 32): bit s is the 5th bit of sub-block s
    ql = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)  # (B, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]  # (8, 1)
    high = (qh[:, None, :] >> shifts) & 1  # (B, 8, 32)
    return _k_affine(b, (ql | (high << 4)).float())


def _two_bit_fields(qs: torch.Tensor) -> torch.Tensor:
    """(B, 64) uint8 -> (B, 256) uint8, Q2_K / Q3_K's order: weight 128 n + 32 j + l is bits 2j, 2j + 1 of
    qs[32 n + l]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device)[:, None]  # (4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)  # (B, 2, 4, 32) -> (B, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[:, 0:16]  # (B, 16): 4-bit scale | 4-bit min << 4, a unit of 16 weights
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])  # (B,), (B,)
    dl = d[:, None] * (sc & 0xF).float()  # (B, 16) float32, as ggml's dl = d * (sc & 0xF)
    ml = dmin[:, None] * (sc >> 4).float()  # (B, 16) as ggml's ml = min * (sc >> 4)
    q = _two_bit_fields(b[:, 16:80]).reshape(-1, 16, 16).float()  # (B, 16, 16)
    return (dl[..., None] * q - ml[..., None]).flatten(1)  # (B, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    j = torch.arange(16, device=b.device)  # (16,)
    s12 = b[:, 96:108].long()  # (B, 12): low nibbles of 16 scales in bytes 0-7, their 2 high bits in bytes 8-11
    low = torch.where(j < 8, s12[:, j % 8] & 0xF, s12[:, j % 8] >> 4)  # (B, 16)
    high = (s12[:, 8 + j % 4] >> (2 * (j // 4))) & 3  # (B, 16)
    d = _f16(b[:, 108:110])  # (B,)
    dl = d[:, None] * ((low | (high << 4)) - 32).float()  # (B, 16) float32, as ggml's dl = d_all * (scales - 32)
    k = torch.arange(256, device=b.device)  # (256,)
    hbit = (b[:, k % 32].long() >> (4 * (k // 128) + k % 128 // 32)) & 1  # (B, 256): hmask bit 4n + j of byte l
    q = _two_bit_fields(b[:, 32:96]).long() - 4 * (1 - hbit)  # (B, 256): -4..3
    return (dl[..., None] * q.reshape(-1, 16, 16).float()).flatten(1)  # (B, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 2, 128)  # (B, 2, 128) low 4 bits per half
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]  # (4, 1)
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # (B, 2, 4, 32): 32 weights per shift
    q = (ql | (qh.reshape(-1, 2, 128) << 4)).reshape(-1, 16, 16).float() - 32  # (B, 16, 16)
    sc = b[:, 192:208].view(torch.int8).float()  # (B, 16)
    d = _f16(b[:, 208:210])  # (B,)
    return ((d[:, None] * sc)[..., None] * q).flatten(1)  # (B, 256): (d * sc) * q, as ggml


# ggml's kvalues_iq4nl: the 16 non-linear values the 4-bit indices of IQ4_NL and IQ4_XS stand for
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 index pairs -> (..., 32) float32: K[low nibbles] (weights 0-15), then K[high] (16-31)."""
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=qs.device)  # (16,)
    return table[_nibbles(qs).flatten(-2).long()]  # (..., 32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])  # (B,)
    return d[:, None] * _iq4_values(b[:, 2:18])  # (B, 32): d * K[q], as ggml


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])  # (B,)
    sh = b[:, 2].long() | (b[:, 3].long() << 8)  # (B,) scales_h: 2 bits a sub-block
    j = torch.arange(8, device=b.device)  # (8,)
    low = (b[:, 4 + j // 2].long() >> (4 * (j % 2))) & 0xF  # (B, 8) scales_l: a nibble a sub-block
    ls = low | (((sh[:, None] >> (2 * j)) & 3) << 4)  # (B, 8) 6-bit scales
    dl = d[:, None] * (ls - 32).float()  # (B, 8) float32, as ggml's dl = d * (ls - 32)
    q = _iq4_values(b[:, 8:136].reshape(-1, 8, 16))  # (B, 8, 32)
    return (dl[..., None] * q).flatten(1)  # (B, 256)


_BLOCK_DEQUANT = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q2_K: _q2_k, T.Q3_K: _q3_k,
                  T.Q4_K: _q4_k, T.Q5_K: _q5_k,
                  T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType | int, cols: int) -> torch.Tensor:
    """raw: (R, bytes_per_row) uint8, the GGUF rows as stored; -> (R, cols) float32."""
    qtype = _qtype(qtype)
    block, nbytes = block_shape(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or cols % block or raw.shape[1] != cols // block * nbytes:
        raise ValueError(f"{qtype.name} rows of {cols} weights are ({cols // block * nbytes},) uint8 each, "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    rows = raw.shape[0]
    raw = raw.contiguous()  # (R, bytes_per_row)
    if qtype == T.F32:
        return raw.view(torch.float32).clone()  # (R, cols)
    if qtype == T.F16:
        return raw.view(torch.float16).float()  # (R, cols)
    if qtype == T.BF16:  # bf16 bits are the high half of the float32 with the same value
        return (raw.view(torch.int16).int() << 16).view(torch.float32)  # (R, cols)
    blocks = raw.view(-1, nbytes)  # (R * cols / block, nbytes)
    return _BLOCK_DEQUANT[qtype](blocks).reshape(rows, cols)  # (R, cols)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (N, K) float32, K a multiple of block -> (q (N, K) int8, d (N, K // block) float32).

    Per block of `block` consecutive values of a row: amax = max|x|; d = amax / 127 (for blocks of 32 rounded to
    half precision, as llama.cpp's block_q8_0 keeps it);
    inv = 127 / amax (0 where amax is 0, or so small that 127 / amax overflows); q = clamp(round_half_to_even(x * inv), -127, 127),
    each a single correctly rounded float32 operation. This exact arithmetic is a contract: a C kernel
    reproduces the int8 values bit for bit (inv is 127 / amax, not 1 / d nor 1 / amax * 127; ties go to even)."""
    n, k = x.shape
    if x.dtype != torch.float32 or block <= 0 or k % block:
        raise ValueError(f"quantize_activations needs float32 (N, K) with K a multiple of {block}, "
                         f"got {tuple(x.shape)} {x.dtype}")
    xb = x.reshape(n, k // block, block)  # (N, K/block, block)
    amax = xb.abs().amax(dim=-1)  # (N, K/block)
    # 127 as a tensor: torch evaluates `127.0 / t` as t.reciprocal() * 127, two roundings, not one division.
    c127 = torch.full_like(amax, 127.0)  # (N, K/block)
    d = amax / c127  # (N, K/block)
    if block == 32:  # llama.cpp's block_q8_0 holds its scale as a half
        d = d.half().float()
    inv = c127 / amax  # (N, K/block)
    inv = torch.where((amax > 0) & torch.isfinite(inv), inv, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)  # (N, K/block, block) float32
    return q.to(torch.int8).reshape(n, k), d


def reference_matmul(raw: torch.Tensor, qtype: GGMLQuantizationType | int, cols: int, x: torch.Tensor) -> torch.Tensor:
    """raw: (R, bytes_per_row) uint8 weight rows; x: (N, cols) float32 activations -> (N, R) float64.

    For float types, x @ W.T; for quantized types, the activations are first quantized with
    quantize_activations(x, activation_block(qtype)) and the result is (q * d) @ W.T, where W is the
    dequantized weight, all in float64. This is what the kernels compute, up to float32 summation order."""
    w = dequantize(raw, qtype, cols).double()  # (R, cols)
    block = activation_block(qtype)
    if block == 0:
        return x.double() @ w.T  # (N, R)
    q, d = quantize_activations(x, block)  # (N, cols) int8, (N, cols / block)
    xq = q.double() * d.double().repeat_interleave(block, dim=1)  # (N, cols)
    return xq @ w.T  # (N, R)
