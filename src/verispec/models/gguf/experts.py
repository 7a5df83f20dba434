"""A mixture of experts' feed-forward on the native kernels (Qwen3's MoE, Mixtral), run op by op."""

from __future__ import annotations

import numpy as np

from verispec.models.gguf import ops


def experts_forward(layer, h: np.ndarray, used: int) -> np.ndarray:
    """A mixture of experts' feed-forward on h (N, E), each token alone as llama.cpp's softmax routing computes it: the
    router's logits, their softmax, the `used` likeliest experts (ties to the lower index), their probabilities over
    their sum; each picked expert's SwiGLU on the tokens that picked it, and a token's outputs summed weighted in the
    order of its picks. A token's bits are its own whatever the pass holds: its routing is computed row by row, each
    expert's kernels are batch invariant, and its sum runs over its own picks."""
    logits = layer.router(ops.Activations(h))  # (N, X) float32
    picks, weights = [], []
    for row in logits:  # one token at a time: the same arithmetic alone or in a batch
        p = np.exp(row.astype(np.float64) - row.max())
        p = (p / p.sum()).astype(np.float32)  # (X,)
        top = np.argsort(-p, kind="stable")[:used]  # (K,) the likeliest, ties to the lower index
        picks.append(top)
        weights.append(p[top] / np.float32(p[top].sum(dtype=np.float32)))  # (K,) renormalized
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
