"""A Llama / Qwen2 model read from a GGUF file: its configuration and its weights as kernel-ready `Weight`s.

The file is read tensor by tensor (`gguf_file.GGUFFile`); each matmul weight is repacked once into the
kernels' layout (about its size in the file) and its source buffer dropped, norms and biases become
float32 arrays. The token embedding is a weight too: a lookup dequantizes only the rows asked for.

Architectures: `llama` (RoPE on adjacent pairs, as llama.cpp's converter permutes Q and K) and `qwen2`
(RoPE on halves, biases on Q, K and V). Anything else, or RoPE scaling, is refused with one line.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.console import progress
from verispec.errors import VerispecError
from verispec.models.gguf.gguf_file import GGUFFile, TensorInfo
from verispec.models.gguf.native import set_threads
from verispec.models.gguf.ops import FLOAT_TYPES, Weight, check_tensor

ARCHITECTURES = {"llama": False, "qwen2": True}  # name -> RoPE on halves ("neox")
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

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass
class Layer:
    attn_norm: np.ndarray  # (E,)
    q: Weight  # (Hq D, E)
    k: Weight  # (Hkv D, E)
    v: Weight  # (Hkv D, E)
    q_bias: np.ndarray | None  # (Hq D,)
    k_bias: np.ndarray | None  # (Hkv D,)
    v_bias: np.ndarray | None  # (Hkv D,)
    out: Weight  # (E, Hq D)
    ffn_norm: np.ndarray  # (E,)
    gate: Weight  # (F, E)
    up: Weight  # (F, E)
    down: Weight  # (E, F)


@dataclass
class GGUFModel:
    path: Path
    config: GGUFConfig
    embed: Weight  # (V, E)
    layers: list[Layer]
    norm: np.ndarray  # (E,)
    head: Weight  # (V, E); the embedding itself where the file ties them

    @property
    def nbytes(self) -> int:
        weights = [self.embed, self.head] + [w for layer in self.layers for w in (layer.q, layer.k, layer.v, layer.out,
                                                                                 layer.gate, layer.up, layer.down)]
        return sum({id(w): w.data.nbytes for w in weights}.values())


def read_config(reader: GGUFFile, path: Path) -> GGUFConfig:
    arch = reader.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise VerispecError(f"{path.name}: architecture '{arch}' is not supported by verispec's CPU runner "
                            f"(supported: {', '.join(ARCHITECTURES)}); use --backend torch or llama.cpp")
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise VerispecError(f"{path.name}: RoPE scaling '{scaling}' is not supported by verispec's CPU runner")

    def need(key: str):
        value = reader.fields.get(f"{arch}.{key}")
        if value is None:
            raise VerispecError(f"{path.name}: metadata '{arch}.{key}' is missing: not a complete {arch} GGUF")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(reader.fields.get(f"{arch}.attention.key_length", hidden // heads))
    embed = _tensor(reader, "token_embd.weight", path)
    return GGUFConfig(
        architecture=arch, layers=int(need("block_count")), hidden=hidden, heads=heads,
        kv_heads=int(reader.fields.get(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        ffn=int(need("feed_forward_length")), vocab=int(embed.shape[1]), context=int(need("context_length")),
        rope_theta=float(reader.fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")), neox=ARCHITECTURES[arch],
    )


def _tensor(reader: GGUFFile, name: str, path: Path, required: bool = True) -> TensorInfo | None:
    tensor = reader.tensors.get(name)
    if tensor is None and required:
        raise VerispecError(f"{path.name}: tensor '{name}' is missing")
    return tensor


def _weight(reader: GGUFFile, name: str, path: Path, rows: int, cols: int) -> Weight:
    tensor = _tensor(reader, name, path)
    if list(tensor.shape) != [cols, rows]:  # ggml order: (cols, rows)
        raise VerispecError(f"{path.name}: tensor '{name}' has shape {list(tensor.shape[::-1])}, expected [{rows}, {cols}]")
    if tensor.qtype in FLOAT_TYPES or tensor.nbytes <= CHUNK_BYTES:
        return Weight.from_raw(name, tensor.qtype, reader.read(name), rows, cols)
    row_bytes = check_tensor(name, tensor.qtype, tensor.nbytes, rows, cols)
    return Weight.from_chunks(name, tensor.qtype, rows, cols,
                              lambda r0, r1: reader.read(name, r0 * row_bytes, r1 * row_bytes), CHUNK_BYTES // row_bytes)


def _vector(reader: GGUFFile, name: str, path: Path, size: int, required: bool = True) -> np.ndarray | None:
    tensor = _tensor(reader, name, path, required)
    if tensor is None:
        return None
    if tensor.qtype != 0 or tensor.n_elements != size:
        raise VerispecError(f"{path.name}: tensor '{name}' should be {size} float32 values")
    return reader.read(name).view(np.float32)


def load_gguf(path: Path, show_progress: bool = True) -> GGUFModel:
    """Read and repack a GGUF model. Damaged files and unsupported content are one VerispecError."""
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError, struct.error, MemoryError) as err:
        raise VerispecError(f"{path}: not a readable GGUF file ({type(err).__name__}: {str(err)[:120]}); "
                            "the file is damaged or truncated") from None
    set_threads(torch.get_num_threads())  # repacking runs on the kernels' threads
    c = read_config(reader, path)
    qkv = (c.heads * c.head_dim, c.kv_dim, c.kv_dim)
    layers = []
    with progress(f"repacking {path.name}", c.layers, enabled=show_progress) as advance:
        for i in range(c.layers):
            p = f"blk.{i}."
            layers.append(Layer(
                attn_norm=_vector(reader, p + "attn_norm.weight", path, c.hidden),
                q=_weight(reader, p + "attn_q.weight", path, qkv[0], c.hidden),
                k=_weight(reader, p + "attn_k.weight", path, qkv[1], c.hidden),
                v=_weight(reader, p + "attn_v.weight", path, qkv[2], c.hidden),
                q_bias=_vector(reader, p + "attn_q.bias", path, qkv[0], required=False),
                k_bias=_vector(reader, p + "attn_k.bias", path, qkv[1], required=False),
                v_bias=_vector(reader, p + "attn_v.bias", path, qkv[2], required=False),
                out=_weight(reader, p + "attn_output.weight", path, c.hidden, qkv[0]),
                ffn_norm=_vector(reader, p + "ffn_norm.weight", path, c.hidden),
                gate=_weight(reader, p + "ffn_gate.weight", path, c.ffn, c.hidden),
                up=_weight(reader, p + "ffn_up.weight", path, c.ffn, c.hidden),
                down=_weight(reader, p + "ffn_down.weight", path, c.hidden, c.ffn),
            ))
            advance()
    embed = _weight(reader, "token_embd.weight", path, c.vocab, c.hidden)
    head = _weight(reader, "output.weight", path, c.vocab, c.hidden) if _tensor(reader, "output.weight", path, False) else embed
    norm = _vector(reader, "output_norm.weight", path, c.hidden)
    return GGUFModel(path, c, embed, layers, norm, head)
