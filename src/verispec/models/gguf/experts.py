"""A mixture of experts' feed-forward on the native kernels (Qwen3's MoE, Mixtral).

Routing as llama.cpp's softmax gating computes it, each token alone: the router's logits, their softmax, the `used`
likeliest experts (ties to the lower index), their probabilities over their sum. Then each picked expert's SwiGLU on
the tokens that picked it, and a token's outputs summed weighted in the order of its picks. A token's bits are its
own whatever the pass holds: its routing is computed row by row, each expert's kernels are batch invariant, and its
sum runs over its own picks. `experts_forward` runs the experts in one C call (vs_moe_ffn); `experts_reference`
runs the same kernels one by one from Python, and the tests hold the two to the same bits.
"""

from __future__ import annotations

import ctypes

import numpy as np

from verispec.models.gguf import ops
from verispec.models.gguf.native import WeightStruct, check, lib, ptr


def route(layer, h: np.ndarray, used: int) -> tuple[np.ndarray, np.ndarray]:
    """h (N, E) -> each token's picks (N, K) int32 and their weights (N, K) float32, K = used."""
    logits = layer.router(ops.Activations(h))  # (N, X) float32
    picks = np.empty((len(h), used), np.int32)  # (N, K)
    weights = np.empty((len(h), used), np.float32)  # (N, K)
    for i, row in enumerate(logits):  # one token at a time: the same arithmetic alone or in a batch
        p = np.exp(row.astype(np.float64) - row.max())
        p = (p / p.sum()).astype(np.float32)  # (X,)
        top = np.argsort(-p, kind="stable")[:used]  # (K,) the likeliest, ties to the lower index
        picks[i] = top
        weights[i] = p[top] / np.float32(p[top].sum(dtype=np.float32))  # (K,) renormalized
    return picks, weights


class ExpertStructs:
    """A layer's experts as vs_moe_ffn takes them: three arrays of vs_weight_t (gate, up, down), made once."""

    def __init__(self, layer) -> None:
        def array(part: int):
            ws = [expert[part] for expert in layer.experts]
            return (WeightStruct * len(ws))(*[WeightStruct(w.qtype, w.address, w.rows, w.cols) for w in ws])

        self.gate, self.up, self.down = array(0), array(1), array(2)
        self.count, self.width = len(layer.experts), layer.experts[0][0].rows


def experts_forward(layer, h: np.ndarray, used: int, structs: ExpertStructs | None = None) -> np.ndarray:
    """A mixture of experts' feed-forward on h (N, E): (N, E), the picked experts run in one C call. structs: the
    layer's `ExpertStructs` (made here when not given)."""
    picks, weights = route(layer, h, used)
    s = structs or ExpertStructs(layer)
    h = np.ascontiguousarray(h, np.float32)
    out = np.empty_like(h)  # (N, E)
    check(lib().vs_moe_ffn(ctypes.byref(s.gate), ctypes.byref(s.up), ctypes.byref(s.down), s.count, s.width, ptr(h),
                           len(h), h.shape[1], used, ptr(picks), ptr(weights), ptr(out)), "a mixture of experts")
    return out


def experts_reference(layer, h: np.ndarray, used: int) -> np.ndarray:
    """What `experts_forward` computes, one kernel call at a time from Python."""
    picks, weights = route(layer, h, used)
    outputs = {}  # expert -> (token rows, their outputs)
    for e in sorted({int(x) for top in picks for x in top}):
        rows = np.array([i for i, top in enumerate(picks) if e in top], np.int64)
        gate, up, down = layer.experts[e]
        a = ops.Activations(np.ascontiguousarray(h[rows]))
        outputs[e] = (rows, down(ops.Activations(ops.silu_mul(gate(a), up(a)))))  # (n_e, E)
    out = np.zeros_like(h)
    for i, (top, w) in enumerate(zip(picks, weights)):
        for e, weight in zip(top.tolist(), w):
            rows, y = outputs[e]
            out[i] = out[i] + y[int(np.searchsorted(rows, i))] * weight
    return out
