"""A decoder model read from a GGUF file: its configuration and its weights as kernel-ready `Weight`s.

The file is read tensor by tensor (`gguf_file.GGUFFile`); each matmul weight is repacked once into the
kernels' layout (about its size in the file) and its source buffer dropped, norms and biases become
float32 arrays. The token embedding is a weight too: a lookup dequantizes only the rows asked for.

Architectures: `llama` (RoPE on adjacent pairs, as llama.cpp's converter permutes Q and K; Mistral, SmolLM2, and
Mixtral where the file has experts) and `qwen2` (RoPE on halves, biases on Q, K and V), and `qwen3` (Qwen2's layout
with each query and key head RMS-normed before RoPE, `attn_q_norm` / `attn_k_norm`), `gemma2`, `gemma3`, `phi3`,
`smollm3`, `granite`, `olmo2` and `qwen3moe` (`FAMILIES` says what each changes). RoPE: whole heads or their first
`rope.dimension_count` values, with linear, Llama 3, LongRoPE or YaRN scaling (`rope.py`). Anything else (another
architecture or RoPE scaling) is refused with one line, and so is a file holding a tensor the runner would not read:
a model is run whole or not at all.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.console import progress
from verispec.errors import VerispecError
from verispec.models.gguf.gguf_file import FLOAT_KINDS, INTEGER_KINDS, GGUFFile, TensorInfo, shown
from verispec.models.gguf.native import set_threads
from verispec.models.gguf.ops import FLOAT_TYPES, Weight, check_tensor
from verispec.models.gguf.rope import KINDS as ROPE_KINDS


@dataclass(frozen=True)
class Family:
    """What an architecture changes in the one forward the runner computes (RMSNorm, attention with RoPE over a
    cache, a gated feed-forward, residual adds), and nothing else: a family is this description, not its own code."""

    neox: bool  # RoPE on halves (i, i + D/2), else on adjacent pairs (llama.cpp's converter permutes Llama's Q and K)
    head_norms: bool = False  # each query and key head RMS-normed before RoPE (attn_q_norm, attn_k_norm)
    post_norms: bool = False  # each sublayer's output RMS-normed before its residual add (post_attention_norm, post_ffw_norm)
    gelu: bool = False  # a GeGLU feed-forward (GELU's tanh form, as llama.cpp takes it), else SwiGLU
    embed_scale: bool = False  # the token embedding times sqrt(E) on the way in
    local_layers: int = 0  # layers of sliding-window attention: of every `local_layers`, all but the last (0: none)
    window: int = 0  # the sliding window where the file does not say it (`attention.sliding_window`)
    local_rope_base: float | None = 10000.0  # local layers' RoPE base where the file does not say it, unscaled (None:
    # the global base and scaling)
    softcaps: tuple[float | None, float | None] = (None, None)  # attention's and the logits' soft-caps where the file
    # does not say them (attn_logit_softcapping, final_logit_softcapping); None: the family has none to read
    fused_ffn: bool = False  # gate and up in one tensor, ffn_up, of 2F rows: the gate's first
    no_rope_every: int = 0  # every n-th layer (n, 2n, ...) has no RoPE (0: all have it)
    scales: bool = False  # scalars from the metadata: embedding_scale, residual_scale, attention.scale, logit_scale
    pre_norms: bool = True  # an RMSNorm before each sublayer (attn_norm, ffn_norm); OLMo 2 has only the post-norms
    whole_qk_norm: bool = False  # the head norms norm each token's whole q and k (their weights: Hq D and Hkv D)
    moe: bool = False  # a mixture of experts for a feed-forward: a router picks `expert_used_count` of them a token
    experts_if_counted: bool = False  # a mixture of experts where the file counts experts (`expert_count` > 0), each
    # `feed_forward_length` wide (Mixtral is a llama file with experts)


FAMILIES = {
    "llama": Family(neox=False, experts_if_counted=True),  # Llama 1-3, Mistral, SmolLM2, Mixtral
    "qwen2": Family(neox=True),  # biases on Q, K and V where the file has them
    "qwen3": Family(neox=True, head_norms=True),
    "gemma3": Family(neox=True, head_norms=True, post_norms=True, gelu=True, embed_scale=True, local_layers=6,
                     softcaps=(None, 0.0)),
    "gemma2": Family(neox=True, post_norms=True, gelu=True, embed_scale=True, local_layers=2, window=4096,
                     local_rope_base=None, softcaps=(50.0, 30.0)),
    "phi3": Family(neox=True, fused_ffn=True),  # Phi-3, Phi-3.5, Phi-4-mini (LongRoPE, partial RoPE)
    "smollm3": Family(neox=False, no_rope_every=4),
    "granite": Family(neox=False, scales=True),  # Granite 3 dense
    "olmo2": Family(neox=True, head_norms=True, whole_qk_norm=True, post_norms=True, pre_norms=False),
    "qwen3moe": Family(neox=True, head_norms=True, moe=True),  # softmax routing, the picked weights renormalized
}
ARCHITECTURES = tuple(FAMILIES)
CHUNK_BYTES = 32 << 20  # a larger tensor is read and repacked in chunks: no whole source tensor is held


@dataclass(frozen=True)
class GGUFConfig:
    """What the forward needs to know, read from the file's metadata."""

    architecture: str
    layers: int
    hidden: int  # embedding length E
    heads: int  # query heads Hq
    kv_heads: int  # key/value heads Hkv (grouped-query attention: Hq / Hkv queries share one)
    head_dim: int  # D
    ffn: int  # feed-forward width F
    vocab: int  # V
    context: int  # trained context length
    rope_theta: float
    rms_eps: float
    neox: bool  # RoPE pairs (i, i + D/2) instead of (2i, 2i + 1)
    gelu: bool = False  # GeGLU feed-forward, else SwiGLU
    whole_qk_norm: bool = False  # q_norm / k_norm over each token's whole q / k, not each head
    embed_scale: float = 1.0  # the token embedding's rows times this (Gemma: sqrt(E) as a float32)
    attention_scale: float | None = None  # scores' scale (None: 1 / sqrt(D))
    window: int = 0  # local layers attend to the last `window` positions (0: no local layers)
    local: tuple[bool, ...] = ()  # per layer: a local (sliding-window) layer
    rope_theta_local: float = 10000.0  # the local layers' RoPE base
    rope_scale: float = 1.0  # RoPE's scaling factor s (1: none), applied as `rope_kind` says (the global layers')
    rope_kind: str = "linear"  # how: "none", "linear", "yarn" or "longrope" (`rope.rope_frequencies`)
    rope_dim: int | None = None  # RoPE turns each head's first rope_dim values (None: the whole head)
    rope_original_context: int = 0  # the context before scaling (rope.scaling.original_context_length; 0: context)
    rope_attn_factor: float = 1.0  # RoPE's cos and sin times this (rope.scaling.attn_factor)
    local_rope_scaled: bool = False  # the local layers take the global layers' scaling too (Gemma 2)
    final_softcap: float = 0.0  # logits = c tanh(logits / c) (0: none)
    attn_softcap: float = 0.0  # scores = c tanh(scores / c) before the softmax (0: none)
    residual_scale: float = 1.0  # each sublayer's output times this before its residual add
    logit_scale: float = 1.0  # logits divided by this (as a product by its float32 inverse)
    no_rope: tuple[bool, ...] = ()  # per layer: a layer without RoPE
    experts: int = 0  # a mixture of experts' size (0: dense feed-forwards)
    experts_used: int = 0  # experts a token's feed-forward runs
    expert_ffn: int = 0  # an expert's feed-forward width

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def rotated(self) -> int:
        """The values of each head RoPE turns (R)."""
        return self.head_dim if self.rope_dim is None else self.rope_dim

    @property
    def rope_context(self) -> int:
        """The context RoPE was trained at before scaling (YaRN's ramp and LongRoPE's choice read it)."""
        return self.rope_original_context or self.context

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.attention_scale is None else self.attention_scale


@dataclass
class Layer:
    attn_norm: np.ndarray | None  # (E,), or None: no norm before the attention (OLMo 2)
    q: Weight  # (Hq D, E)
    k: Weight  # (Hkv D, E)
    v: Weight  # (Hkv D, E)
    q_bias: np.ndarray | None  # (Hq D,)
    k_bias: np.ndarray | None  # (Hkv D,)
    v_bias: np.ndarray | None  # (Hkv D,)
    out: Weight  # (E, Hq D)
    ffn_norm: np.ndarray | None  # (E,), or None
    gate: Weight | None  # (F, E); None in a mixture-of-experts layer
    up: Weight | None  # (F, E)
    down: Weight | None  # (E, F)
    q_norm: np.ndarray | None = None  # (D,) RMSNorm weight of every query head before RoPE (Qwen3), (Hq D) of the
    k_norm: np.ndarray | None = None  # whole q (OLMo 2), or None; the same for keys
    attn_post_norm: np.ndarray | None = None  # (E,) RMSNorm of the attention's output before the residual add (Gemma)
    ffn_post_norm: np.ndarray | None = None  # (E,) the same for the feed-forward's
    router: Weight | None = None  # (X, E): the experts' logits (a mixture-of-experts layer), or None
    experts: list[tuple[Weight, Weight, Weight]] | None = None  # each expert's (gate (F_x, E), up, down (E, F_x))


@dataclass
class GGUFModel:
    path: Path
    config: GGUFConfig
    embed: Weight  # (V, E)
    layers: list[Layer]
    norm: np.ndarray  # (E,)
    head: Weight  # (V, E); the embedding itself where the file ties them
    rope_factors: np.ndarray | None = None  # (R/2,) float32: each RoPE pair's frequency divided by it (Llama 3's,
    # LongRoPE's long or short ones)

    @property
    def nbytes(self) -> int:
        weights = [self.embed, self.head] + [w for layer in self.layers for w in (layer.q, layer.k, layer.v, layer.out,
                                                                                 layer.gate, layer.up, layer.down,
                                                                                 layer.router) if w is not None]
        weights += [w for layer in self.layers for expert in layer.experts or () for w in expert]
        return sum({id(w): w.data.nbytes for w in weights}.values())


INT32_MAX = 2**31 - 1  # the kernels take head counts, head sizes and cache columns as C int / int32


def read_config(reader: GGUFFile, path: Path) -> GGUFConfig:
    """The model's configuration from the file's metadata, checked (`check_config`) before any kernel sees it."""
    arch = reader.fields.get("general.architecture")
    if arch not in FAMILIES:
        raise VerispecError(f"{path.name}: architecture '{shown(arch)}' is not supported by verispec's CPU runner "
                            f"(supported: {', '.join(ARCHITECTURES)}); use --backend torch or llama.cpp")
    scaling = reader.fields.get(f"{arch}.rope.scaling.type", "linear")  # llama.cpp's default: a factor alone is linear

    def field(key: str, kinds: frozenset, default=None):
        """The value of `{arch}.{key}`, of one of these GGUF types; missing: `default`, or an error if None."""
        name = f"{arch}.{key}"
        if name not in reader.fields:
            if default is None:
                raise VerispecError(f"{path.name}: metadata '{name}' is missing: not a complete {arch} GGUF")
            return default
        if reader.kinds[name] not in kinds:
            raise VerispecError(f"{path.name}: metadata '{name}' is {shown(reader.fields[name])} (GGUF type "
                                f"{reader.kinds[name]}), not {'an integer' if kinds == INTEGER_KINDS else 'a number'}")
        return reader.fields[name]

    number = INTEGER_KINDS | FLOAT_KINDS
    hidden, heads = field("embedding_length", INTEGER_KINDS), field("attention.head_count", INTEGER_KINDS)
    if heads > 0 and f"{arch}.attention.key_length" not in reader.fields and hidden % heads:
        raise VerispecError(f"{path.name}: metadata '{arch}.embedding_length' ({hidden}) is not a multiple of "
                            f"'{arch}.attention.head_count' ({heads}), and no '{arch}.attention.key_length' says "
                            "the heads' size: the file is damaged")
    head_dim = field("attention.key_length", INTEGER_KINDS, hidden // heads if heads > 0 else 0)
    value_dim = field("attention.value_length", INTEGER_KINDS, head_dim)
    if value_dim != head_dim:
        raise VerispecError(f"{path.name}: metadata '{arch}.attention.value_length' ({value_dim}) differs from the "
                            f"key length ({head_dim}); verispec's CPU runner needs them equal")
    embed = _tensor(reader, "token_embd.weight", path)
    if len(embed.shape) != 2:
        raise VerispecError(f"{path.name}: tensor 'token_embd.weight' has {len(embed.shape)} dimensions, not 2")
    rotated = field("rope.dimension_count", INTEGER_KINDS, head_dim)
    family, layers = FAMILIES[arch], field("block_count", INTEGER_KINDS)
    experts = family.experts_if_counted and field("expert_count", INTEGER_KINDS, 0) > 0  # Mixtral
    window = field("attention.sliding_window", INTEGER_KINDS, family.window) if family.local_layers else 0
    if arch == "olmo2" and field("attention.sliding_window", INTEGER_KINDS, 0):  # OLMo 3: llama.cpp reads it
        raise VerispecError(f"{path.name}: metadata '{arch}.attention.sliding_window' asks for sliding-window layers, "
                            f"which verispec's CPU runner does not read for '{arch}'; use --backend llama.cpp")
    # llama.cpp's Gemma 2 / 3 27B (46 / 62 layers) scale scores by the width per head, the others by the heads' size
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62)) and heads
    scales = dict(embed_scale=float(np.sqrt(np.float32(hidden))) if family.embed_scale else 1.0,
                  attention_scale=1.0 / math.sqrt(hidden // heads) if big else None)
    rope_theta = float(field("rope.freq_base", number, 10000.0))
    # RoPE's scaling factor (rope.scaling.factor, or the older rope.scale_linear), applied as llama.cpp does unless the
    # type is "none" (Gemma 3 4B+: linear, 8, on its global layers only)
    factor = float(field("rope.scaling.factor", number, 0.0)) or float(field("rope.scale_linear", number, 0.0))
    rope_scale = factor if scaling != "none" and factor else 1.0
    caps = [float(field(key, number, default)) if default is not None else 0.0
            for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), family.softcaps)]
    if family.scales:
        scales = _scales(field, number)
    config = GGUFConfig(
        architecture=arch, layers=layers, hidden=hidden, heads=heads,
        kv_heads=field("attention.head_count_kv", INTEGER_KINDS, heads), head_dim=head_dim,
        ffn=field("feed_forward_length", INTEGER_KINDS), vocab=int(embed.shape[1]),
        context=field("context_length", INTEGER_KINDS),
        rope_theta=rope_theta, rope_scale=rope_scale, rope_kind=scaling, rope_dim=rotated,
        rope_original_context=field("rope.scaling.original_context_length", INTEGER_KINDS, 0),
        rope_attn_factor=float(field("rope.scaling.attn_factor", number, 1.0)),
        rms_eps=float(field("attention.layer_norm_rms_epsilon", number)), neox=family.neox, gelu=family.gelu,
        whole_qk_norm=family.whole_qk_norm,
        window=window, local=_local_layers(reader, path, arch, family, layers) if window > 0 else (),
        rope_theta_local=float(field("rope.freq_base_swa", number, family.local_rope_base or rope_theta)),
        local_rope_scaled=family.local_rope_base is None,
        attn_softcap=caps[0], final_softcap=caps[1],
        no_rope=tuple((i + 1) % family.no_rope_every == 0 for i in range(layers)) if family.no_rope_every else (),
        **(_expert_sizes(field, family) if family.moe or experts else {}),
        **scales,
    )
    check_config(config, path.name)
    return config


def _expert_sizes(field, family: Family) -> dict:
    """A mixture of experts' sizes. An expert's width as llama.cpp reads it: Mixtral's is the feed-forward length;
    Qwen3's is its own key, or by default the feed-forward length over the experts used."""
    count, used = field("expert_count", INTEGER_KINDS), field("expert_used_count", INTEGER_KINDS)
    ffn = field("feed_forward_length", INTEGER_KINDS)
    width = ffn if family.experts_if_counted else (field("expert_feed_forward_length", INTEGER_KINDS, 0) or
                                                   ffn // max(used, 1))
    return dict(experts=count, experts_used=used, expert_ffn=width)


def _scales(field, number) -> dict:
    """Granite's scalars, each as llama.cpp reads it: 0 or missing means none (the logit scale is required)."""
    embed, residual, attention = (float(field(key, number, 0.0)) for key in ("embedding_scale", "residual_scale",
                                                                               "attention.scale"))
    return dict(embed_scale=embed or 1.0, residual_scale=residual or 1.0, attention_scale=attention or None,
                logit_scale=float(field("logit_scale", number)))


def _local_layers(reader: GGUFFile, path: Path, arch: str, family: Family, layers: int) -> tuple[bool, ...]:
    """Which layers attend through the sliding window: `{arch}.attention.sliding_window_pattern` as one flag a layer,
    or as n (of every n layers all but the last), else the family's n, as llama.cpp reads them."""
    name = f"{arch}.attention.sliding_window_pattern"
    pattern = reader.fields.get(name, family.local_layers)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers or not all(isinstance(v, bool) for v in pattern):
            raise VerispecError(f"{path.name}: metadata '{name}' should hold one flag per layer ({layers})")
        return tuple(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise VerispecError(f"{path.name}: metadata '{name}' is {shown(pattern)}, not a layer count")
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(layers))


def check_config(c: GGUFConfig, where: str) -> None:
    """Refuse, in one line naming `where` and the field, a configuration the kernels cannot run: every count
    positive and within their int types, query heads a multiple of key/value heads, an even head size (RoPE
    rotates pairs), a finite positive RoPE base and a finite non-negative epsilon. Runs before any kernel."""
    arch = c.architecture
    names = {"layers": "block_count", "hidden": "embedding_length", "heads": "attention.head_count",
             "kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
             "ffn": "feed_forward_length", "vocab": "vocabulary size (token_embd.weight)",
             "context": "context_length"}
    for name, meta in names.items():
        value = getattr(c, name)
        label = meta if name == "vocab" else f"metadata '{arch}.{meta}'"
        if not 0 < value <= INT32_MAX:
            raise VerispecError(f"{where}: {label} is {value}; it must be between 1 and {INT32_MAX}")
    if c.heads % c.kv_heads:
        raise VerispecError(f"{where}: metadata '{arch}.attention.head_count' ({c.heads}) is not a multiple of "
                            f"'{arch}.attention.head_count_kv' ({c.kv_heads})")
    if c.head_dim % 2:
        raise VerispecError(f"{where}: the heads' size ({c.head_dim}, metadata '{arch}.attention.key_length' or "
                            f"embedding_length / head_count) is odd; RoPE rotates pairs")
    if c.heads * c.head_dim > INT32_MAX:
        raise VerispecError(f"{where}: {c.heads} heads of {c.head_dim} values are more than the kernels index")
    if not (math.isfinite(c.rope_theta) and c.rope_theta > 0):
        raise VerispecError(f"{where}: metadata '{arch}.rope.freq_base' is {c.rope_theta}; it must be positive")
    if not (math.isfinite(c.rms_eps) and c.rms_eps >= 0):
        raise VerispecError(f"{where}: metadata '{arch}.attention.layer_norm_rms_epsilon' is {c.rms_eps}; it must "
                            "be a finite number >= 0")
    if c.experts and not (0 < c.experts_used <= c.experts <= 4096 and 0 < c.expert_ffn <= INT32_MAX):
        raise VerispecError(f"{where}: metadata '{arch}.expert_count' ({c.experts}), 'expert_used_count' "
                            f"({c.experts_used}) and 'expert_feed_forward_length' ({c.expert_ffn}) do not make a "
                            "mixture of experts")
    if not 0 <= c.window <= INT32_MAX:
        raise VerispecError(f"{where}: metadata '{arch}.attention.sliding_window' is {c.window}; it must be >= 0")
    if not (math.isfinite(c.rope_scale) and c.rope_scale > 0):
        raise VerispecError(f"{where}: metadata '{arch}.rope.scaling.factor' is {c.rope_scale}; it must be positive")
    if not (0 < c.rotated <= c.head_dim and c.rotated % 2 == 0):
        raise VerispecError(f"{where}: metadata '{arch}.rope.dimension_count' ({c.rotated}) must be an even number of "
                            f"a head's {c.head_dim} values")
    if not (math.isfinite(c.rope_attn_factor) and c.rope_attn_factor > 0):
        raise VerispecError(f"{where}: metadata '{arch}.rope.scaling.attn_factor' is {c.rope_attn_factor}; it must be "
                            "a finite number > 0")
    if not 0 <= c.rope_original_context <= INT32_MAX:
        raise VerispecError(f"{where}: metadata '{arch}.rope.scaling.original_context_length' is "
                            f"{c.rope_original_context}; it must be between 0 and {INT32_MAX}")
    if not isinstance(c.rope_kind, str) or c.rope_kind not in ROPE_KINDS:
        raise VerispecError(f"{where}: RoPE scaling '{shown(c.rope_kind)}' is not supported by verispec's CPU runner "
                            f"(supported: {', '.join(ROPE_KINDS)}); use --backend llama.cpp")
    if c.local and not (math.isfinite(c.rope_theta_local) and c.rope_theta_local > 0):
        raise VerispecError(f"{where}: metadata '{arch}.rope.freq_base_swa' is {c.rope_theta_local}; it must be positive")
    for name, value in (("embedding_scale", c.embed_scale), ("residual_scale", c.residual_scale),
                        ("attention.scale", c.scale), ("logit_scale", c.logit_scale)):
        if not (math.isfinite(value) and value > 0):
            raise VerispecError(f"{where}: metadata '{arch}.{name}' is {value}; it must be a finite number > 0")
    for name, value in (("final_logit_softcapping", c.final_softcap), ("attn_logit_softcapping", c.attn_softcap)):
        if not (math.isfinite(value) and value >= 0):
            raise VerispecError(f"{where}: metadata '{arch}.{name}' is {value}; it must be a finite number >= 0")


def _tensor(reader: GGUFFile, name: str, path: Path, required: bool = True) -> TensorInfo | None:
    reader.asked.add(name)  # every tensor the runner looks for: the others are refused (`_refuse_unread`)
    tensor = reader.tensors.get(name)
    if tensor is None and required:
        raise VerispecError(f"{path.name}: tensor '{name}' is missing")
    return tensor


def _weight(reader: GGUFFile, name: str, path: Path, rows: int, cols: int, first: int = 0,
            total: int | None = None, experts: int = 0) -> Weight:
    """The tensor `name`, (total or rows) x cols, as a weight: its rows first .. first + rows - 1 (a part of a fused
    tensor: Phi-3's attn_qkv and ffn_up; an expert of a 3-D experts tensor, experts x rows x cols, read as its
    experts rows x cols), or all of it."""
    total = rows if total is None else total
    tensor = _tensor(reader, name, path)
    shape = [cols, total // experts, experts] if experts else [cols, total]  # ggml order: (cols, rows[, experts])
    if list(tensor.shape) != shape:
        raise VerispecError(f"{path.name}: tensor '{name}' has shape {list(tensor.shape[::-1])}, expected {shape[::-1]}")
    try:
        row_bytes = check_tensor(name, tensor.qtype, tensor.nbytes, total, cols)  # before any byte is read
    except VerispecError as err:
        raise VerispecError(f"{path.name}: {err}") from None
    start = first * row_bytes
    if tensor.qtype in FLOAT_TYPES or rows * row_bytes <= CHUNK_BYTES:
        return Weight.from_raw(name, tensor.qtype, reader.read(name, start, start + rows * row_bytes), rows, cols)
    return Weight.from_chunks(name, tensor.qtype, rows, cols,
                              lambda r0, r1: reader.read(name, start + r0 * row_bytes, start + r1 * row_bytes),
                              CHUNK_BYTES // row_bytes)


def _attention_weights(reader: GGUFFile, p: str, path: Path, sizes: tuple[int, int, int], hidden: int) -> tuple:
    """A layer's q, k and v: three tensors, or one fused attn_qkv (Phi-3) whose rows are q's, then k's, then v's."""
    if _tensor(reader, p + "attn_qkv.weight", path, required=False) is None:
        return tuple(_weight(reader, p + f"attn_{x}.weight", path, rows, hidden) for x, rows in zip("qkv", sizes))
    return tuple(_weight(reader, p + "attn_qkv.weight", path, rows, hidden, first, sum(sizes))
                 for rows, first in zip(sizes, (0, sizes[0], sizes[0] + sizes[1])))


def _vector(reader: GGUFFile, name: str, path: Path, size: int, required: bool = True) -> np.ndarray | None:
    tensor = _tensor(reader, name, path, required)
    if tensor is None:
        return None
    if tensor.qtype != 0 or tensor.n_elements != size:
        raise VerispecError(f"{path.name}: tensor '{name}' should be {size} float32 values")
    return reader.read(name).view(np.float32)


def load_gguf(path: Path, show_progress: bool = True) -> GGUFModel:
    """Read and repack a GGUF model. Damaged files and unsupported content are one VerispecError line naming the
    file (and the field, where one is at fault); the configuration is checked before any kernel runs."""
    path = Path(path)
    try:
        return _load_gguf(path, show_progress)
    except VerispecError:
        raise
    except (OSError, ValueError, struct.error, OverflowError, IndexError, KeyError, TypeError, RecursionError) as err:
        what = " ".join(f"{type(err).__name__}: {err}".split())[:160]  # one line
        raise VerispecError(f"{path}: not a readable GGUF file ({what}); the file is damaged or truncated") from None


def _load_gguf(path: Path, show_progress: bool) -> GGUFModel:
    reader = GGUFFile(path)
    set_threads(torch.get_num_threads())  # repacking runs on the kernels' threads
    c = read_config(reader, path)
    family = FAMILIES[c.architecture]
    qkv = (c.heads * c.head_dim, c.kv_dim, c.kv_dim)
    layers = []
    with progress(f"repacking {path.name}", c.layers, enabled=show_progress) as advance:
        for i in range(c.layers):
            p = f"blk.{i}."
            q, k, v = _attention_weights(reader, p, path, qkv, c.hidden)
            router = experts = None
            if c.experts:
                gate = up = None
                router = _weight(reader, p + "ffn_gate_inp.weight", path, c.experts, c.hidden)
                x, f = c.experts, c.expert_ffn
                experts = [tuple(_weight(reader, p + f"ffn_{name}_exps.weight", path, rows, cols, e * rows, x * rows, x)
                                 for name, rows, cols in (("gate", f, c.hidden), ("up", f, c.hidden), ("down", c.hidden, f)))
                           for e in range(x)]
            elif family.fused_ffn:
                gate, up = (_weight(reader, p + "ffn_up.weight", path, c.ffn, c.hidden, first, 2 * c.ffn)
                            for first in (0, c.ffn))
            else:
                gate = _weight(reader, p + "ffn_gate.weight", path, c.ffn, c.hidden)
                up = _weight(reader, p + "ffn_up.weight", path, c.ffn, c.hidden)
            layers.append(Layer(
                attn_norm=_vector(reader, p + "attn_norm.weight", path, c.hidden) if family.pre_norms else None,
                q=q, k=k, v=v,
                q_bias=_vector(reader, p + "attn_q.bias", path, qkv[0], required=False),
                k_bias=_vector(reader, p + "attn_k.bias", path, qkv[1], required=False),
                v_bias=_vector(reader, p + "attn_v.bias", path, qkv[2], required=False),
                out=_weight(reader, p + "attn_output.weight", path, c.hidden, qkv[0]),
                ffn_norm=_vector(reader, p + "ffn_norm.weight", path, c.hidden) if family.pre_norms else None,
                gate=gate, up=up,
                down=None if c.experts else _weight(reader, p + "ffn_down.weight", path, c.hidden, c.ffn),
                router=router, experts=experts,
                **({"q_norm": _vector(reader, p + "attn_q_norm.weight", path, qkv[0] if family.whole_qk_norm else c.head_dim),
                    "k_norm": _vector(reader, p + "attn_k_norm.weight", path, qkv[1] if family.whole_qk_norm else c.head_dim)}
                   if family.head_norms else {}),
                **({"attn_post_norm": _vector(reader, p + "post_attention_norm.weight", path, c.hidden),
                    "ffn_post_norm": _vector(reader, p + "post_ffw_norm.weight", path, c.hidden)}
                   if family.post_norms else {}),
            ))
            advance()
    embed = _weight(reader, "token_embd.weight", path, c.vocab, c.hidden)
    head = _weight(reader, "output.weight", path, c.vocab, c.hidden) if _tensor(reader, "output.weight", path, False) else embed
    norm = _vector(reader, "output_norm.weight", path, c.hidden)
    factors = _rope_factors(reader, path, c)
    _refuse_unread(reader, path, c.architecture)
    return GGUFModel(path, c, embed, layers, norm, head, None if factors is None else factors.copy())


def _rope_factors(reader: GGUFFile, path: Path, c: GGUFConfig) -> np.ndarray | None:
    """(R/2,) per-pair RoPE frequency divisors the file carries, or None: Llama 3's (`rope_freqs.weight`), or
    LongRoPE's long or short ones (`rope_factors_long.weight`, `rope_factors_short.weight`): the long ones where the
    context the runner offers (the model's, `context_length`) exceeds the original one, as llama.cpp chooses them
    when run at the model's context."""
    found = {name: _vector(reader, f"{name}.weight", path, c.rotated // 2, required=False)
             for name in ("rope_freqs", "rope_factors_long", "rope_factors_short")}
    for name, factors in found.items():
        if factors is not None and not (np.isfinite(factors).all() and (factors > 0).all()):
            raise VerispecError(f"{path.name}: tensor '{name}.weight' holds factors that are not finite and positive")
    freqs, long, short = found.values()
    if (long is None) != (short is None) or (freqs is not None and long is not None):
        present = ", ".join(f"'{name}.weight'" for name, f in found.items() if f is not None)
        raise VerispecError(f"{path.name}: the file holds RoPE factors {present}: LongRoPE needs both its long and "
                            "short factors, and no rope_freqs beside them")
    if long is None:
        return freqs
    return long if c.context > c.rope_context else short


def _refuse_unread(reader: GGUFFile, path: Path, arch: str) -> None:
    """One line naming a tensor of the file the runner did not read (a norm, a scale, a bias of a variant it does
    not know): ignoring it would decode another model, silently."""
    unread = sorted(set(reader.tensors) - reader.asked)
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise VerispecError(f"{path.name}: tensor '{unread[0]}'{more} is not read by verispec's CPU runner for "
                            f"'{arch}': running without it would be another model; use --backend llama.cpp")
