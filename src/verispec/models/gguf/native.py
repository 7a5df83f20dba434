"""The C kernels (csrc/kernels.c, compiled by the package's install) through ctypes.

Arrays cross as numpy arrays (C-contiguous, the dtypes named); nothing here copies. The SIMD path is
chosen once by the library (AMX tiles, else AVX-512 with VNNI, else AVX2 with AVX-VNNI, else AVX2, else portable
C); all compute the same bits. `set_path` forces one, for tests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

from verispec.errors import VerispecError

PATHS = {0: "portable", 1: "avx512-vnni", 2: "avx2", 3: "amx", 4: "amx-emulated", 5: "avx-vnni"}
_P, _I, _I64, _F, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double
_SIGNATURES = {
    "vs_cpu_features": ([], _I),
    "vs_get_path": ([], _I),
    "vs_set_path": ([_I], _I),
    "vs_set_threads": ([_I], None),
    "vs_avx512_tile": ([], _I),
    "vs_set_avx512_tile": ([_I], _I),
    "vs_avx2_tile": ([], _I),
    "vs_set_avx2_tile": ([_I], _I),
    "vs_set_prefetch_one": ([_I], _I),
    "vs_amx_status": ([], _I),
    "vs_set_amx_min": ([_I], _I),
    "vs_packed_bytes": ([_I, _I64, _I64], _I64),
    "vs_repack": ([_I, _P, _I64, _I64, _P], _I),
    "vs_dequantize_rows": ([_I, _P, _I64, _I64, _P, _I64, _P], _I),
    "vs_quantize_rows": ([_P, _I64, _I64, _I, _P, _P, _P], _I),
    "vs_matmul": ([_I, _P, _I64, _I64, _I64, _P, _P, _P, _P], _I),
    "vs_matmul_float": ([_I, _P, _I64, _I64, _I64, _P, _P], _I),
    "vs_float_rows": ([_I, _P, _I64, _I64, _P, _I64, _P], _I),
    "vs_rmsnorm": ([_P, _I64, _I64, _P, _F, _P], None),
    "vs_rope_table": ([_P, _I64, _I, _D, _P, _P], None),
    "vs_rope": ([_P, _I64, _I, _I, _I, _P, _I], None),
    "vs_silu_mul": ([_P, _P, _I64, _P], None),
    "vs_gelu_mul": ([_P, _P, _I64, _P], None),
    "vs_attention": ([_P, _I64, _I, _I, _I, _F, _P, _P, _I64, _P, _P, _P, _P, _P], _I),
    "vs_attention_capped": ([_P, _I64, _I, _I, _I, _F, _P, _P, _I64, _P, _P, _P, _P, _P, _F], _I),
    "vs_attention_cache": ([_P, _I64, _I, _I, _I, _F, _P, _P, _I64, _P, _P, _P, _P, _P, _F, _I], _I),
    "vs_to_half": ([_P, _I64, _P], _I),
    "vs_layer_forward": ([_P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _I], _I),
    "vs_moe_ffn": ([_P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P], _I),
    "vs_profile_start": ([], None),
    "vs_profile_stop": ([_P, _I], _I),
}


# csrc's status codes (VS_EINVAL, VS_ERANGE, VS_ENOMEM)
EINVAL, ERANGE, ENOMEM = -1, -2, -3


def check(status: int, what: str) -> None:
    """A kernel's status as Python sees it: 0 passes; running out of memory is a MemoryError; anything else
    (a size or an id the kernel refused) one VerispecError line."""
    if status == 0:
        return
    if status == ENOMEM:
        raise MemoryError(f"{what}: the native kernels could not allocate their scratch memory")
    reason = {EINVAL: "sizes the kernel refuses", ERANGE: "an index out of range"}.get(status, f"status {status}")
    raise VerispecError(f"{what} failed in the native kernels ({reason})")


class WeightStruct(ctypes.Structure):
    """csrc's vs_weight_t."""

    _fields_ = [("qtype", _I64), ("data", _P), ("rows", _I64), ("cols", _I64)]


class LayerStruct(ctypes.Structure):
    """csrc's vs_layer_t: a layer's norms, biases, per-head query / key norms and post-sublayer norms (NULL where
    absent) and weights."""

    _fields_ = [(name, _P) for name in ("attn_norm", "ffn_norm", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
                                        "attn_post_norm", "ffn_post_norm")] + [
        (name, WeightStruct) for name in ("q", "k", "v", "out", "gate", "up", "down")]


class DimsStruct(ctypes.Structure):
    """csrc's vs_dims_t."""

    _fields_ = [(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "neox", "gelu",
                                                 "whole_qk_norm", "rope_dim")] + [
        ("eps", _D), ("scale", _D), ("residual_scale", _D), ("attn_softcap", _D), ("kv_half", _I64)]


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """The loaded library, its functions typed. A missing build is one clear error."""
    try:
        from verispec.models.gguf import _native
    except ImportError:
        raise VerispecError("verispec's C kernels are not built in this installation: reinstall it with "
                            "`pip install -e .` (needs gcc), or use --backend torch") from None
    so = ctypes.CDLL(_native.__file__)
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, result
    return so


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def cpu_features() -> dict[str, bool]:
    bits = lib().vs_cpu_features()
    names = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c", "amx-tile", "amx-int8",
             "avx-vnni")
    return {name: bool(bits >> i & 1) for i, name in enumerate(names)}


def path() -> str:
    return PATHS[lib().vs_get_path()]


def set_path(name: str) -> str:
    """Force 'portable', 'avx2', 'avx-vnni' (the AVX2 kernel with 256-bit vpdpbusd), 'avx512-vnni', 'amx' or
    'amx-emulated' (the AMX kernel on software tiles, on any CPU: tests compare it with the others); one the CPU lacks
    falls back to portable. Returns the one in force."""
    code = {v: k for k, v in PATHS.items()}[name]
    return PATHS[lib().vs_set_path(code)]


def amx_status() -> str:
    """Whether the AMX kernels can run here: "usable", "absent" (no AMX tiles on this CPU), "no AVX-512" (the
    kernel's epilogue needs it) or "refused" (the OS did not grant the tile state: arch_prctl failed)."""
    return ("usable", "absent", "no AVX-512", "refused")[lib().vs_amx_status()]


def avx512_tile() -> int:
    """The most tokens the AVX-512 kernel takes in one tile (its own choice 16; a native runner sets the one measured
    on its machine, `tiles.apply`; any tiling gives the same bits)."""
    return lib().vs_avx512_tile()


def set_avx512_tile(tile: int) -> int:
    """Force the AVX-512 kernel's widest tile (1-16; tests run several), 0 for the CPU's own choice; returns it."""
    return lib().vs_set_avx512_tile(int(tile))


PREFETCH_ONE_PATHS = ("avx512-vnni", "amx")  # the paths whose one-token tiles run the AVX-512 kernel, which has it


def set_prefetch_one(on: int) -> bool:
    """Whether the AVX-512 kernel's one-token tiles prefetch their weights: 1 on, 0 off, -1 the CPU's default (off on
    AMD, where the hardware prefetchers alone streamed one token faster; csrc/cpu.h); returns the setting in force.
    The same bits either way."""
    return bool(lib().vs_set_prefetch_one(int(on)))


def avx2_tile() -> int:
    """The most tokens the AVX2 kernel (with or without AVX-VNNI) takes in one tile: 8 unless set."""
    return lib().vs_avx2_tile()


def set_avx2_tile(tile: int) -> int:
    """Force the AVX2 kernel's widest tile (1-8), 0 for its own (8); returns it."""
    return lib().vs_set_avx2_tile(int(tile))


def set_amx_min(tokens: int) -> int:
    """Force the fewest tokens a matmul sends through the AMX tile kernels, for every weight type (1: every tile, as
    the tests run them); 0 restores the measured table (csrc/matmul.h, amx_min_tokens: Q4_K from 16 tokens, Q5_K from 12,
    the other types never, where the VNNI kernel was faster). Returns the minimum in force (0: the table)."""
    return lib().vs_set_amx_min(int(tokens))


def set_threads(n: int) -> None:
    lib().vs_set_threads(int(n))


# csrc's profile slots: its named ones, then one per GGUF tensor type from PROFILE_TYPES
PROFILE_NAMES = {0: "quantize activations", 1: "attention", 2: "layers", 3: "float matmuls",
                 4: "matmuls outside layers"}
PROFILE_TYPES = 8
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL",
              23: "IQ4_XS"}


@contextmanager
def profile() -> Iterator[dict[str, float]]:
    """Time the kernels while the block runs: the dict filled at its end maps "quantize activations", "attention",
    "layers" (whole fused layers, their matmuls and attention included), "float matmuls", "matmul Q4_K" (one per
    weight type, inside layers) and "matmuls outside layers" (the output head) to wall seconds. For benchmarks: calls from several Python threads at once would mix."""
    seconds: dict[str, float] = {}
    lib().vs_profile_start()
    try:
        yield seconds
    finally:
        out = np.zeros(64, np.float64)
        slots = lib().vs_profile_stop(ptr(out), out.size)
        for slot in range(min(slots, out.size)):
            name = PROFILE_NAMES.get(slot) if slot < PROFILE_TYPES else \
                f"matmul {TYPE_NAMES.get(slot - PROFILE_TYPES, f'type {slot - PROFILE_TYPES}')}"
            if name is not None and out[slot] > 0:
                seconds[name] = float(out[slot])
