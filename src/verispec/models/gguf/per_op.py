"""The native runner's layers one op at a time from Python: the reference for the fused C layer (the same kernels in the
same order, so the same bits; the tests compare the two), and the path a mixture of experts takes."""

from __future__ import annotations

import numpy as np

from verispec.models.gguf import ops
from verispec.models.gguf.attend import Query
from verispec.models.gguf.experts import ExpertStructs, experts_forward, experts_reference
from verispec.models.gguf.model import GGUFConfig, GGUFModel
from verispec.models.gguf.native import check, lib, ptr


def layers_per_op(model: GGUFModel, x: np.ndarray, queries: list[Query], rows: list,
                  layers: list[tuple[int, tuple]], skips: np.ndarray) -> np.ndarray:
    """Layers of `model` on x (N, E), one kernel call per op from Python: what vs_layer_forward does, in the same
    order (the runner's `fused=False`), a mixture of experts' too. rows: each query's `RowCache`; layers: (index,
    (what its queries attend to: an `Attend`, its RoPE table or None)); skips: (layers,) int32 sublayers to skip."""
    c, n = model.config, len(queries)
    # Keys and values of a row's new tokens go to consecutive columns: (row, first query, count, first column).
    runs: list[tuple[object, int, int, int]] = []  # (a RowCache, ...)
    for i, q in enumerate(queries):
        if runs and runs[-1][0] is rows[i] and runs[-1][3] + runs[-1][2] == q.column:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1, runs[-1][3])
        else:
            runs.append((rows[i], i, 1, q.column))
    attn = np.empty((n, c.heads * c.head_dim), np.float32)  # (N, Hq D)

    def qk_normed(t: np.ndarray, weight: np.ndarray) -> np.ndarray:  # each head (Qwen3) or each token's whole
        rows = t.reshape(n, -1) if c.whole_qk_norm else t.reshape(-1, c.head_dim)
        return ops.rmsnorm(rows, weight, c.rms_eps).reshape(n, -1)

    for i, (a, angles) in layers:
        layer = model.layers[i]
        if not skips[i] & 1:
            h = ops.Activations(x if layer.attn_norm is None else ops.rmsnorm(x, layer.attn_norm, c.rms_eps))
            q, k, v = layer.q(h), layer.k(h), layer.v(h)  # (N, Hq D), (N, Hkv D), (N, Hkv D)
            for t, bias in ((q, layer.q_bias), (k, layer.k_bias), (v, layer.v_bias)):
                if bias is not None:
                    t += bias
            if layer.q_norm is not None:
                q = qk_normed(q, layer.q_norm)
            if layer.k_norm is not None:
                k = qk_normed(k, layer.k_norm)
            if angles is not None:
                ops.rope(q, c.heads, angles, c.neox)
                ops.rope(k, c.kv_heads, angles, c.neox)
            for row, first, count, column in runs:  # (count, Hkv D) into the head-major (Hkv, columns, D)
                for cache, t in ((row.keys, k), (row.values, v)):
                    heads = t[first : first + count].reshape(count, c.kv_heads, -1)  # (count, Hkv, D)
                    with np.errstate(over="ignore"):  # to a half cache: past 65504 inf, as the fused layer writes
                        cache[i, :, column : column + count] = heads.swapaxes(0, 1)
            keys, values = a.key_base + i * a.layer_bytes, a.value_base + i * a.layer_bytes  # (N,) this layer's
            item = rows[0].keys.itemsize  # every row's cache has the runner's element type
            head_stride = a.layer_bytes // (item * c.kv_heads)  # (N,) elements between a row's key/value heads
            check(lib().vs_attention_cache(ptr(q), n, c.heads, c.kv_heads, c.head_dim, c.scale, ptr(keys),
                                           ptr(values), c.head_dim, ptr(head_stride), ptr(a.prefix),
                                           ptr(a.extra_off), ptr(a.extra), ptr(attn), c.attn_softcap,
                                           int(item == 2)), f"attention of layer {i}")
            x = x + _post_norm(c, layer.out(ops.Activations(attn)), layer.attn_post_norm)
        if not skips[i] & 2:
            if layer.experts:
                x = x + experts_sublayer(c, layer, x, reference=True)
                continue
            h = ops.Activations(x if layer.ffn_norm is None else ops.rmsnorm(x, layer.ffn_norm, c.rms_eps))
            act = ops.gelu_mul if c.gelu else ops.silu_mul
            x = x + _post_norm(c, layer.down(ops.Activations(act(layer.gate(h), layer.up(h)))), layer.ffn_post_norm)
    return x


def experts_sublayer(c: GGUFConfig, layer, x: np.ndarray, structs: ExpertStructs | None = None,
                     reference: bool = False) -> np.ndarray:
    """A mixture-of-experts layer's feed-forward sublayer on x (N, E): (N, E), what its residual add takes. The experts
    in one C call (structs: the layer's, made once by the runner), or with `reference` one kernel at a time."""
    normed = x if layer.ffn_norm is None else ops.rmsnorm(x, layer.ffn_norm, c.rms_eps)
    out = (experts_reference(layer, normed, c.experts_used) if reference else
           experts_forward(layer, normed, c.experts_used, structs))
    return _post_norm(c, out, layer.ffn_post_norm)


def _post_norm(c: GGUFConfig, out: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """A sublayer's output as its residual add takes it: normed (Gemma), scaled (Granite), or as it is."""
    out = out if weight is None else ops.rmsnorm(out, weight, c.rms_eps)
    if c.residual_scale != 1.0:
        out *= np.float32(c.residual_scale)
    return out
