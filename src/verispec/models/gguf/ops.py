"""Weights and the forward's ops over numpy float32 arrays, each one C kernel call (see csrc/kernels.c).

`Weight` holds one matmul weight: a quantized GGUF tensor repacked once into the kernels' lane-interleaved
layout (about the size it has in the file), or a float tensor as stored. `Activations` quantizes an input
once per activation block size and lets every weight that reads it (q, k and v; gate and up) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from verispec.errors import VerispecError
from verispec.models.gguf.native import ENOMEM, check, lib, ptr
from verispec.models.gguf.reference import FLOAT_TYPES, SUPPORTED, activation_block, block_shape

GROUP_ROWS = 16  # rows the kernels interleave (csrc/layout.h, GROUP)


def check_tensor(name: str, qtype: int, nbytes: int, rows: int, cols: int) -> int:
    """One clear line for a type the kernels lack or a size that does not fit the shape; -> bytes per row."""
    if qtype not in SUPPORTED:
        raise VerispecError(f"tensor '{name}' has GGUF type {type_name(qtype)}, which verispec's CPU runner "
                            f"does not support (supported: {', '.join(sorted(type_name(t) for t in SUPPORTED))})")
    per_block, block_bytes = block_shape(qtype)
    if cols % per_block or nbytes != rows * cols // per_block * block_bytes:
        raise VerispecError(f"tensor '{name}' ({type_name(qtype)}, {rows} x {cols}) holds {nbytes} bytes, "
                            f"not {rows * cols // per_block * block_bytes}: the file is damaged or truncated")
    return cols // per_block * block_bytes


def type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"#{qtype}"


@dataclass
class Activations:
    """x (N, K) float32, with its int8 quantization per block size, made on first use."""

    x: np.ndarray
    quantized: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    pointers: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def quantize(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> q (N, K) int8, d (N, K / block) float32, bsum (N, K / 16) int32."""
        if block not in self.quantized:
            n, k = self.x.shape
            q = np.empty((n, k), np.int8)
            d = np.empty((n, k // block), np.float32)
            bsum = np.empty((n, k // 16), np.int32)
            self.pointers[block] = (ptr(q), ptr(d), ptr(bsum))
            check(lib().vs_quantize_rows(ptr(self.x), n, k, block, *self.pointers[block]),
                  f"quantizing activations of width {k} in blocks of {block}")
            self.quantized[block] = (q, d, bsum)
        return self.quantized[block]


@dataclass
class Weight:
    """A (rows, cols) matmul weight. data: the packed bytes (quantized types) or the raw rows (float types)."""

    name: str
    qtype: int
    rows: int
    cols: int
    data: np.ndarray

    @classmethod
    def from_raw(cls, name: str, qtype: int, raw: np.ndarray, rows: int, cols: int) -> "Weight":
        """raw: the tensor's bytes as stored in the GGUF file (any shape, uint8 or the float dtype)."""
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        row_bytes = check_tensor(name, qtype, raw.size, rows, cols)
        if qtype in FLOAT_TYPES:
            return cls(name, qtype, rows, cols, raw)
        return cls.from_chunks(name, qtype, rows, cols, lambda r0, r1: raw[r0 * row_bytes : r1 * row_bytes], rows)

    @classmethod
    def from_chunks(cls, name: str, qtype: int, rows: int, cols: int, read, chunk_rows: int) -> "Weight":
        """A quantized weight repacked chunk by chunk: read(r0, r1) gives rows r0..r1-1 as stored (uint8).
        Groups of 16 rows are independent in the packed layout, so only one chunk of the source is ever held."""
        group_bytes = lib().vs_packed_bytes(qtype, GROUP_ROWS, cols)
        packed = np.empty(lib().vs_packed_bytes(qtype, rows, cols), np.uint8)
        step = max(GROUP_ROWS, chunk_rows // GROUP_ROWS * GROUP_ROWS)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            raw = np.ascontiguousarray(read(r0, r1))
            target = packed[r0 // GROUP_ROWS * group_bytes :]
            if lib().vs_repack(qtype, ptr(raw), r1 - r0, cols, ptr(target)) != 0:
                raise VerispecError(f"tensor '{name}' could not be repacked ({type_name(qtype)}, {rows} x {cols})")
        return cls(name, qtype, rows, cols, packed)

    def first_rows(self, n: int) -> "Weight":
        """The weight of rows 0..n-1 alone, sharing this one's memory (groups of 16 rows are independent in
        the packed layout): a draft's LM head over the first n token ids. n: a multiple of 16, at most rows."""
        if not 0 < n <= self.rows or (self.qtype not in FLOAT_TYPES and n % GROUP_ROWS):
            raise VerispecError(f"'{self.name}': cannot take its first {n} rows (of {self.rows}; a multiple of {GROUP_ROWS})")
        size = self.data.nbytes // self.rows * n if self.qtype in FLOAT_TYPES else lib().vs_packed_bytes(self.qtype, n, self.cols)
        return Weight(self.name, self.qtype, n, self.cols, self.data[:size])

    def __post_init__(self) -> None:
        self.block = activation_block(self.qtype)
        self.address = ptr(self.data)  # looked up once: a pointer lookup costs ~1 us, and a pass makes ~200 calls
        self._matmul, self._matmul_float = lib().vs_matmul, lib().vs_matmul_float

    def __call__(self, x: Activations) -> np.ndarray:
        """x (N, cols) -> (N, rows) float32."""
        n = x.x.shape[0]
        out = np.empty((n, self.rows), np.float32)
        if self.qtype in FLOAT_TYPES:
            status = self._matmul_float(self.qtype, self.address, self.rows, self.cols, n, ptr(x.x), ptr(out))
        else:
            x.quantize(self.block)
            status = self._matmul(self.qtype, self.address, self.rows, self.cols, n, *x.pointers[self.block], ptr(out))
        check(status, f"matmul with '{self.name}'")
        return out

    def take_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ids (n,) int64 as float32 (n, cols): an embedding lookup."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty((ids.size, self.cols), np.float32)
        if self.qtype in FLOAT_TYPES:
            status = lib().vs_float_rows(self.qtype, ptr(self.data), self.rows, self.cols, ptr(ids), ids.size, ptr(out))
        else:
            status = lib().vs_dequantize_rows(self.qtype, ptr(self.data), self.rows, self.cols, ptr(ids), ids.size, ptr(out))
        if status == ENOMEM or status == -1:
            check(status, f"rows of '{self.name}'")
        if status != 0:
            raise VerispecError(f"token id out of range 0..{self.rows - 1} for '{self.name}'")
        return out


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (N, E) -> (N, E)."""
    out = np.empty_like(x)
    lib().vs_rmsnorm(ptr(x), x.shape[0], x.shape[1], ptr(weight), eps, ptr(out))
    return out


def rope_table(positions: np.ndarray, dim: int, theta: float, factors: np.ndarray | None = None,
               mscale: float = 1.0) -> np.ndarray:
    """positions (N,) int64 -> (N, R/2, 2) float32 cos, sin of each pair's angle, R = dim the rotated dimensions;
    factors (R/2,) float32 or None: each pair's frequency divided by its factor (`rope.rope_frequencies`); mscale: cos
    and sin times it (YaRN's and LongRoPE's attention factor, one float32 product a value as llama.cpp takes it)."""
    table = np.empty((positions.size, dim // 2, 2), np.float32)
    lib().vs_rope_table(ptr(positions), positions.size, dim, theta, None if factors is None else ptr(factors), ptr(table))
    if mscale != 1.0:
        table *= np.float32(mscale)
    return table


def rope(x: np.ndarray, heads: int, table: np.ndarray, neox: bool) -> None:
    """In place on x (N, H D), read as (N, H, D), with a rope_table of its positions: its R/2 pairs turn each head's
    first R values (R < D: partial RoPE)."""
    lib().vs_rope(ptr(x), x.shape[0], heads, x.shape[1] // heads, 2 * table.shape[1], ptr(table), int(neox))


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(N, F), (N, F) -> silu(gate) * up (N, F)."""
    out = np.empty_like(gate)
    lib().vs_silu_mul(ptr(gate), ptr(up), gate.size, ptr(out))
    return out


def gelu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(N, F), (N, F) -> gelu(gate) * up (N, F), GELU's tanh form through half precision as llama.cpp takes it."""
    out = np.empty_like(gate)
    lib().vs_gelu_mul(ptr(gate), ptr(up), gate.size, ptr(out))
    return out
