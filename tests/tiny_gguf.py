"""Tiny GGUF files with random weights, written with gguf's own writer, for the native runner's tests.

Every matmul weight can take any supported type; quantized blocks are random bytes with sane fp16 scales
(every bit pattern of the values is a valid block), so the kernels see all of them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType
QUANTIZED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
ALL_TYPES = QUANTIZED + (T.F16, T.BF16, T.F32)
# fp16 scale fields (byte offset in the block) of each quantized type
SCALE_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
                T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def random_raw(rng: np.random.Generator, qtype, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
    """A (rows, cols) tensor of this type as it is stored: (rows, bytes per row) uint8, or the float dtype."""
    if qtype in (T.F32, T.F16):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype == T.BF16:
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, block_bytes), dtype=np.uint8)
    # d such that a weight's typical size is about `scale` (IQ4_XS: values to 127 times scales to 32)
    unit = scale / (16 if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1) else 64 if qtype in (T.Q8_0, T.IQ4_NL)
                    else 1024 if qtype == T.IQ4_XS else 64 if qtype == T.Q2_K else 128 if qtype == T.Q3_K
                    else 256)
    for offset in SCALE_FIELDS[qtype]:
        halves = rng.uniform(0.25 * unit, unit, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, arch: str = "qwen2", types=(T.Q4_K,), seed: int = 0, hidden: int = 256,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 512, vocab: int = 300, layers: int = 2,
                    tied: bool = False, context: int = 512, rope_factors: np.ndarray | None = None,
                    vocab_tokens: bool = False, extra: dict | None = None, metadata: dict | None = None,
                    head_dim: int | None = None, head_norm: float = 1.0, rope_theta: float = 10000.0,
                    post_norm: float = 1.0, experts: tuple[int, int, int | None] = (4, 2, None)) -> Path:
    """Write a random Llama / Qwen2 model; matmul weights take `types` in turn (cycled), or `types(name)` where it is a
    function of the tensor's name. rope_factors (D/2,): Llama 3's
    RoPE scaling as its files carry it (rope_freqs.weight); vocab_tokens: a placeholder vocabulary (llama.cpp needs
    one); extra: more tensors by name; metadata: more key/value pairs (name -> (value, GGUFValueType)); head_dim: the
    heads' size where it is not hidden / heads (Qwen3's is not; written as attention.key_length). "qwen3": Qwen2's
    layout without biases, with each query and key head normed (attn_q_norm, attn_k_norm). "gemma3": Qwen3's with
    each sublayer's output normed (post_attention_norm, post_ffw_norm); pass its sliding window in `metadata`.
    "gemma2": Gemma 3's without the head norms.
    "olmo2": no norm before a sublayer, each one's output normed, q and k normed whole (not per head).
    "qwen3moe": Qwen3's with a mixture of 4 experts of ffn / 2 for a feed-forward, 2 a token (the metadata is written
    here: expert_count, expert_used_count, expert_feed_forward_length). "mixtral": a llama file with 4 experts of ffn,
    2 a token.
    "phi3": Llama's with q, k and v in one tensor (attn_qkv) and gate and up in one (ffn_up, 2F rows).
    head_norm: about what those head norms' weights are (larger: sharper attention); post_norm: Gemma's post-norms'.
    experts: a mixture's (experts, experts a token, an expert's width: None for the default above)."""
    rng = np.random.default_rng(seed)
    mixtral, arch = arch == "mixtral", "llama" if arch == "mixtral" else arch
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_theta)
    count, used, width = experts
    width = width or (ffn if mixtral else ffn // 2)
    if arch == "qwen3moe" or mixtral:
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(width)
    for key, (value, vtype) in (metadata or {}).items():
        writer.add_key_value(key, value, vtype)
    if vocab_tokens:
        add_placeholder_vocab(writer, vocab)
    order = [] if callable(types) else [types[i % len(types)] for i in range(8 * layers + 2)]
    picks = iter(order)

    def matrix(name: str, rows: int, cols: int) -> None:
        qtype = types(name) if callable(types) else next(picks)
        raw = random_raw(rng, qtype, rows, cols)
        if qtype == T.BF16:
            raw = raw.view(np.uint8)  # gguf's writer takes a BF16 tensor as its bytes
        writer.add_tensor(name, raw, raw_dtype=qtype if qtype in QUANTIZED or qtype == T.BF16 else None)

    def experts_tensor(name: str, count: int, rows: int, cols: int) -> None:  # a 3-D tensor: count x rows x cols
        qtype = types(name) if callable(types) else next(picks)
        raw = random_raw(rng, qtype, count * rows, cols)
        raw = raw.view(np.uint8) if qtype == T.BF16 else raw
        writer.add_tensor(name, raw.reshape(count, rows, -1),
                          raw_dtype=qtype if qtype in QUANTIZED or qtype == T.BF16 else None)

    def vector(name: str, size: int, around: float = 1.0) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(size)).astype(np.float32))

    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    head_dim = head_dim or hidden // heads
    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        if arch != "olmo2":  # OLMo 2 norms each sublayer's output only
            vector(p + "attn_norm.weight", hidden)
        if arch == "phi3":  # q, k and v in one tensor
            matrix(p + "attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, hidden)
        else:
            matrix(p + "attn_q.weight", heads * head_dim, hidden)
            matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
            matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for name, size in (("attn_q.bias", heads * head_dim), ("attn_k.bias", kv_heads * head_dim),
                               ("attn_v.bias", kv_heads * head_dim)):
                vector(p + name, size, around=0.0)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            vector(p + "attn_q_norm.weight", head_dim, around=head_norm)
            vector(p + "attn_k_norm.weight", head_dim, around=head_norm)
        if arch == "olmo2":  # over each token's whole q and k
            vector(p + "attn_q_norm.weight", heads * head_dim, around=head_norm)
            vector(p + "attn_k_norm.weight", kv_heads * head_dim, around=head_norm)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        if arch != "olmo2":
            vector(p + "ffn_norm.weight", hidden)
        if arch == "qwen3moe" or mixtral:  # 4 experts of ffn // 2 (Mixtral: of ffn), 2 a token, by default
            writer.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((count, hidden)) * 0.5).astype(np.float32))
            experts_tensor(p + "ffn_gate_exps.weight", count, width, hidden)
            experts_tensor(p + "ffn_up_exps.weight", count, width, hidden)
            experts_tensor(p + "ffn_down_exps.weight", count, hidden, width)
        elif arch == "phi3":  # gate and up in one tensor, the gate's rows first
            matrix(p + "ffn_up.weight", 2 * ffn, hidden)
        else:
            matrix(p + "ffn_gate.weight", ffn, hidden)
            matrix(p + "ffn_up.weight", ffn, hidden)
        if arch != "qwen3moe" and not mixtral:
            matrix(p + "ffn_down.weight", hidden, ffn)
        if arch in ("gemma2", "gemma3", "olmo2"):
            vector(p + "post_attention_norm.weight", hidden, around=post_norm)
            vector(p + "post_ffw_norm.weight", hidden, around=post_norm)
    vector("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", vocab, hidden)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute_for_llama(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's Q / K rows -> GGUF's (llama.cpp's converter does this): RoPE then pairs adjacent rows."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def add_placeholder_vocab(writer: GGUFWriter, size: int) -> None:
    """A SentencePiece-style vocabulary of `size` (>= 5) tokens: <unk>, <s>, </s>, the newline byte and plain
    pieces. llama.cpp will not load a GGUF without one (verispec's own loader does not need it); the tests pass
    token ids, never text, so the pieces' spelling does not matter."""
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>"] + [f"t{i}" for i in range(4, size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types([2, 3, 3, 6] + [1] * (size - 4))  # unknown, control, control, byte, normal
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def gguf_from_hf(model, path: Path, qtype=T.F32, vocab: bool = False) -> Path:
    """Write a transformers Llama / Qwen2 model (tiny_model) as a GGUF with its matmul weights in `qtype`
    (F32, F16, BF16, Q8_0, Q4_0 or Q4_1: the types gguf's numpy code can quantize). vocab: add a placeholder
    vocabulary (`add_placeholder_vocab`), so that llama.cpp loads the file."""
    from gguf import quants

    config = model.config
    arch = "llama" if config.model_type == "llama" else "qwen2"
    writer = GGUFWriter(str(path), arch)
    if vocab:
        add_placeholder_vocab(writer, config.vocab_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def matrix(name: str, w: np.ndarray) -> None:
        if qtype == T.F32:
            writer.add_tensor(name, w.astype(np.float32))
        elif qtype == T.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    matrix("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        writer.add_tensor(p + "attn_norm.weight", state[h + "input_layernorm.weight"])
        q, k = state[h + "self_attn.q_proj.weight"], state[h + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute_for_llama(q, config.num_attention_heads), _permute_for_llama(k, config.num_key_value_heads)
        matrix(p + "attn_q.weight", q)
        matrix(p + "attn_k.weight", k)
        matrix(p + "attn_v.weight", state[h + "self_attn.v_proj.weight"])
        if arch == "qwen2":
            for name in ("q", "k", "v"):
                writer.add_tensor(p + f"attn_{name}.bias", state[h + f"self_attn.{name}_proj.bias"])
        matrix(p + "attn_output.weight", state[h + "self_attn.o_proj.weight"])
        writer.add_tensor(p + "ffn_norm.weight", state[h + "post_attention_layernorm.weight"])
        matrix(p + "ffn_gate.weight", state[h + "mlp.gate_proj.weight"])
        matrix(p + "ffn_up.weight", state[h + "mlp.up_proj.weight"])
        matrix(p + "ffn_down.weight", state[h + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    matrix("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------ a GGUF file as parts to edit (the fuzz tests)

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class GGUFLayout:
    """A GGUF file split into what a test edits, independently of the reader under test.

    fields: [key, value type, the value's encoding]; tensors: [name, dims, type id, offset from the data's
    start]; data: the tensor data (from the aligned start to the end); slots: (offset, size, what) of every
    number in the header (counts, lengths, types, values, dims, offsets), for byte-level mutations."""

    version: int
    fields: list[list]
    tensors: list[list]
    data: bytes
    alignment: int
    header_end: int  # where the header ends (before the padding to the data)
    data_start: int
    slots: list[tuple[int, int, str]] = field(default_factory=list)

    def field_value(self, key: str):
        for k, vtype, raw in self.fields:
            if k == key and vtype in _SCALAR_FORMATS:
                return struct.unpack(_SCALAR_FORMATS[vtype], raw)[0]
        return None

    def with_field(self, key: str, vtype: int, value) -> "GGUFLayout":
        """A copy with `key` set (replaced in place, or appended) to `value` of GGUF type `vtype`."""
        fields = [f for f in self.fields if f[0] != key]
        where = next((i for i, f in enumerate(self.fields) if f[0] == key), len(fields))
        fields.insert(where, [key, vtype, encode_value(vtype, value)])
        return replace(self, fields=fields)

    def without_field(self, key: str) -> "GGUFLayout":
        return replace(self, fields=[f for f in self.fields if f[0] != key])

    def build(self, alignment: int | None = None) -> bytes:
        """The file's bytes: header, padding to `alignment` (default: the layout's), data."""
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.fields)))
        for key, vtype, raw in self.fields:
            out += _encode_string(key) + struct.pack("<I", vtype) + raw
        for name, dims, qtype, offset in self.tensors:
            out += _encode_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            out += struct.pack("<IQ", qtype, offset)
        align = alignment or self.alignment
        out += b"\0" * (-len(out) % align)
        return bytes(out) + self.data


def _encode_string(text) -> bytes:
    raw = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<Q", len(raw)) + raw


def encode_value(vtype: int, value) -> bytes:
    """A metadata value's encoding: a scalar, a string (str or bytes), or an array given as (item type, items)."""
    if vtype in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[vtype], value)
    if vtype == STRING:
        return _encode_string(value)
    item, items = value
    return struct.pack("<IQ", item, len(items)) + b"".join(encode_value(item, v) for v in items)


def read_layout(path: Path) -> GGUFLayout:
    """Split a well-formed GGUF file (one gguf's writer made) into a GGUFLayout."""
    raw = Path(path).read_bytes()
    pos, slots = 0, []

    def take(fmt: str, what: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        slots.append((pos, size, what))
        value = struct.unpack_from(fmt, raw, pos)[0]
        pos += size
        return value

    def string(what: str) -> str:
        nonlocal pos
        n = take("<Q", f"length of {what}")
        pos += n
        return raw[pos - n : pos].decode()

    def skip_value(vtype: int, what: str) -> None:
        if vtype in _SCALAR_FORMATS:
            take(_SCALAR_FORMATS[vtype], f"value of {what}")
        elif vtype == STRING:
            string(f"string {what}")
        else:
            item, count = take("<I", f"item type of {what}"), take("<Q", f"count of {what}")
            for i in range(count):
                skip_value(item, f"{what}[{i}]") if i < 2 else skip_value_quiet(item)

    def skip_value_quiet(vtype: int) -> None:  # an array's later items: no slots (a vocabulary has thousands)
        nonlocal pos
        if vtype in _SCALAR_FORMATS:
            pos += struct.calcsize(_SCALAR_FORMATS[vtype])
        elif vtype == STRING:
            pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        else:
            item, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            for _ in range(count):
                skip_value_quiet(item)

    assert raw[:4] == b"GGUF"
    pos = 4
    version = take("<I", "version")
    n_tensors, n_fields = take("<Q", "tensor count"), take("<Q", "metadata count")
    fields = []
    for _ in range(n_fields):
        key = string("a key")
        vtype = take("<I", f"type of {key}")
        start = pos
        skip_value(vtype, key)
        fields.append([key, vtype, raw[start:pos]])
    tensors = []
    for _ in range(n_tensors):
        name = string("a tensor name")
        dims = [take("<Q", f"dim {j} of {name}") for j in range(take("<I", f"dimension count of {name}"))]
        tensors.append([name, dims, take("<I", f"type of {name}"), take("<Q", f"offset of {name}")])
    alignment = next((struct.unpack(_SCALAR_FORMATS[t], v)[0] for k, t, v in fields if k == "general.alignment"), 32)
    start = (pos + alignment - 1) // alignment * alignment
    return GGUFLayout(version, fields, tensors, raw[start:], alignment, pos, start, slots)


def native_models(root: Path, arch: str = "llama", seed: int = 0):
    """A tiny Hugging Face model written under `root` and as a Q8_0 GGUF beside it: a function giving a fresh
    native-runner `LoadedModel` of it under a name, with the model's tokenizer (what `load_model` gives a .gguf)."""
    from tiny_hf import save_tiny_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models.gguf.model import load_gguf
    from verispec.models.loading import LoadedModel

    folder = save_tiny_model_dir(root / "tiny", arch, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    path = gguf_from_hf(AutoModelForCausalLM.from_pretrained(str(folder)), root / "tiny.gguf", T.Q8_0)

    def loaded(name: str) -> LoadedModel:
        return LoadedModel(name, None, tokenizer, str(path), weights="gguf", backend="native",
                           gguf=load_gguf(path, show_progress=False))

    return loaded
