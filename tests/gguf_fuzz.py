"""Damaged variants of a small valid GGUF file, and a driver that loads them one after another.

`variants(base)` is deterministic (seeded): every truncation inside the header and metadata and a sample
inside the tensor data; every number of the header (counts, lengths, value types, values, dimensions,
tensor types, offsets) set to edge values; the configuration's fields set to what the kernels cannot run
(head counts of 0, odd head sizes, NaN, alignment 0 or not a power of two), removed, retyped, nested,
not UTF-8; and seeded random byte changes.

Run as a script (what tests/test_gguf_fuzz.py does, in a subprocess so that a signal is seen):

    python tests/gguf_fuzz.py BASE.gguf FIRST STRIDE WORKDIR

it loads variants FIRST, FIRST + STRIDE, ... with `load_gguf` (and, when one loads, runs a forward pass on
it) and prints one JSON line per variant: {"i", "name", "outcome": "ok" | "error" | "traceback", "detail"},
then {"done": true}. "error" means one VerispecError line naming the file; anything else is a "traceback".
A variant that kills the process (a signal) prints nothing: the caller sees the exit status and starts a
new driver past it.
"""

from __future__ import annotations

import json
import math
import random
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_gguf import ARRAY, STRING, GGUFLayout, read_layout  # noqa: E402

U32, I32, U64, F32, F64 = 4, 5, 10, 6, 12
EDGE = {  # slot size -> values written there
    1: [0, 1, 0x7F, 0xFF],
    2: [0, 1, 0x8000, 0xFFFF],
    4: [0, 1, 3, 9, 13, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF],
    8: [0, 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1],
}
FLOATS = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30]
CONFIG_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv"]


def nested(depth: int) -> bytes:
    """An array value nested `depth` deep (arrays of one array ... of an empty uint32 array)."""
    raw = struct.pack("<IQ", U32, 0)
    for _ in range(depth):
        raw = struct.pack("<IQ", ARRAY, 1) + raw
    return raw


def with_raw(layout: GGUFLayout, key: str, vtype: int, raw: bytes) -> GGUFLayout:
    fields = [f for f in layout.fields if f[0] != key] + [[key, vtype, raw]]
    return GGUFLayout(layout.version, fields, layout.tensors, layout.data, layout.alignment, 0, 0)


def with_tensor(layout: GGUFLayout, index: int, **change) -> GGUFLayout:
    tensors = [list(t) for t in layout.tensors]
    for what, value in change.items():
        tensors[index][["name", "dims", "qtype", "offset"].index(what)] = value
    return GGUFLayout(layout.version, layout.fields, tensors, layout.data, layout.alignment, 0, 0)


def with_kv_heads(layout: GGUFLayout, kv_heads: int) -> GGUFLayout:
    """`kv_heads` key/value heads, and key and value weights and biases of the rows that many heads have."""
    hidden = layout.field_value("qwen2.embedding_length")
    head_dim = hidden // layout.field_value("qwen2.attention.head_count")
    changed = layout.with_field("qwen2.attention.head_count_kv", U32, kv_heads)
    for i, (name, dims, _, _) in enumerate(changed.tensors):
        if name.endswith(("attn_k.weight", "attn_v.weight")):
            changed = with_tensor(changed, i, dims=[hidden, kv_heads * head_dim])
        elif name.endswith(("attn_k.bias", "attn_v.bias")):
            changed = with_tensor(changed, i, dims=[kv_heads * head_dim])
    return changed


def base_layout(tiny: Path) -> GGUFLayout:
    """The tiny model with the kinds of metadata a real file has besides its numbers: strings, arrays of strings
    and floats (a vocabulary), a nested array."""
    layout = read_layout(tiny)
    layout = layout.with_field("general.name", STRING, "tiny fuzz base")
    layout = layout.with_field("tokenizer.ggml.tokens", ARRAY, (STRING, [f"t{i}" for i in range(6)]))
    layout = layout.with_field("tokenizer.ggml.scores", ARRAY, (F32, [0.5] * 6))
    layout = with_raw(layout, "test.nested", ARRAY, nested(2))
    return layout


def variants(base: Path, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(name, file bytes) of every variant, always in the same order; `base` is a file `base_layout` wrote."""
    for group in _variant_groups(base, seed):
        yield from group


def _variant_groups(base: Path, seed: int) -> Iterator[list[tuple[str, bytes]]]:
    raw = base.read_bytes()
    layout = read_layout(base)
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = [("the base file", raw)]
    # 1. truncation at every offset of the header and metadata, and a sample inside the tensor data
    out += [(f"truncated at {n}", raw[:n]) for n in range(layout.data_start + 1)]
    out += [(f"truncated at {n}", raw[:n]) for n in sorted(rng.sample(range(layout.data_start + 1, len(raw)), 48))]
    yield out
    out = []
    # 2. every number of the header set to edge values
    for offset, size, what in layout.slots:
        original = int.from_bytes(raw[offset : offset + size], "little")
        values = EDGE[size] + [original + 1, max(0, original - 1)]
        if what.startswith("value of") and size in (4, 8):
            values += [int.from_bytes(struct.pack("<f" if size == 4 else "<d", v), "little") for v in FLOATS]
        for value in dict.fromkeys(v % (1 << 8 * size) for v in values):
            if value != original:
                out.append((f"{what} = {value}", raw[:offset] + value.to_bytes(size, "little") + raw[offset + size :]))
    yield out
    out = []
    # 3. the configuration: values the kernels cannot run, wrong types, missing fields
    arch = "qwen2"
    for key in CONFIG_KEYS:
        name = f"{arch}.{key}"
        for value in (0, 1, 3, 2**31, 2**32 - 1):
            out.append((f"{name} = {value}", layout.with_field(name, U32, value).build()))
        out.append((f"{name} = 2**63 (uint64)", layout.with_field(name, U64, 2**63).build()))
        out.append((f"{name} = -8 (int32)", layout.with_field(name, I32, -8).build()))
        out.append((f"{name} as a string", layout.with_field(name, STRING, "8").build()))
        out.append((f"{name} as a float", layout.with_field(name, F32, 8.0).build()))
        out.append((f"{name} as an array", layout.with_field(name, ARRAY, (U32, [8])).build()))
        out.append((f"{name} missing", layout.without_field(name).build()))
    for kv_heads in (0, 3):  # and tensors whose shapes agree: nothing but the configuration check stops them
        out.append((f"{arch}.attention.head_count_kv = {kv_heads}, k and v shaped to match",
                    with_kv_heads(layout, kv_heads).build()))
    for value in (15, 0, 2, 2**31):
        out.append((f"key_length = {value}", layout.with_field(f"{arch}.attention.key_length", U32, value).build()))
    out.append(("value_length differs", layout.with_field(f"{arch}.attention.value_length", U32, 8).build()))
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        for value in FLOATS:
            out.append((f"{arch}.{key} = {value}", layout.with_field(f"{arch}.{key}", F32, value).build()))
        out.append((f"{arch}.{key} as a string", layout.with_field(f"{arch}.{key}", STRING, "1").build()))
    for value in (0, 1, 3, 16, 48, 64, 2**31):
        out.append((f"general.alignment = {value}", layout.with_field("general.alignment", U32, value).build()))
    out.append(("general.alignment as a string", layout.with_field("general.alignment", STRING, "32").build()))
    out.append(("general.alignment = -32 (int32)", layout.with_field("general.alignment", I32, -32).build()))
    for value in ("llama", "gpt2", ""):
        out.append((f"architecture '{value}'", layout.with_field("general.architecture", STRING, value).build()))
    out.append(("architecture as a number", layout.with_field("general.architecture", U32, 2).build()))
    out.append(("RoPE scaling", layout.with_field(f"{arch}.rope.scaling.type", STRING, "linear").build()))
    for depth in (3, 4, 5, 64, 10_000):
        out.append((f"arrays nested {depth} deep", with_raw(layout, "test.deep", ARRAY, nested(depth)).build()))
    out.append(("array of 2**60 items", with_raw(layout, "test.huge", ARRAY, struct.pack("<IQ", U32, 2**60)).build()))
    out.append(("array of 2**40 strings", with_raw(layout, "test.huge", ARRAY, struct.pack("<IQ", STRING, 2**40)).build()))
    out.append(("array of unknown items", with_raw(layout, "test.odd", ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8).build()))
    out.append(("unknown value type", with_raw(layout, "test.odd", 13, b"\0" * 8).build()))
    out.append(("string of 2**63 bytes", with_raw(layout, "test.odd", STRING, struct.pack("<Q", 2**63)).build()))
    out.append(("value not UTF-8", layout.with_field("general.name", STRING, b"\xc3\x28\xff").build()))
    out.append(("key not UTF-8", with_raw(layout, b"\xff\xfe\xfd", U32, struct.pack("<I", 1)).build()))
    out.append(("a key twice", GGUFLayout(layout.version, layout.fields + layout.fields[:1], layout.tensors,
                                          layout.data, layout.alignment, 0, 0).build()))
    out.append(("a tensor twice", GGUFLayout(layout.version, layout.fields, layout.tensors + layout.tensors[-1:],
                                             layout.data, layout.alignment, 0, 0).build()))
    embed = next(i for i, t in enumerate(layout.tensors) if t[0] == "token_embd.weight")
    for change in ({"dims": [64]}, {"dims": [64, 64, 1, 1, 1]}, {"dims": [2**63, 2**63]}, {"dims": [0, 64]},
                   {"dims": [32, 128]}, {"qtype": 99}, {"qtype": 10}, {"qtype": 0}, {"offset": 1},
                   {"offset": 2**63}, {"name": "token_embd.weight\x00"}):
        out.append((f"token_embd.weight {change}", with_tensor(layout, embed, **change).build()))
    for index in range(len(layout.tensors)):
        out.append((f"tensor {index} type F16", with_tensor(layout, index, qtype=1).build()))
    # 4. seeded random byte changes: in the header, and anywhere
    for trial in range(200):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(layout.data_start)] = rng.randrange(256)
        out.append((f"random header bytes #{trial}", bytes(data)))
    for trial in range(40):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        out.append((f"random bytes #{trial}", bytes(data)))
    yield out


def load_one(path: Path) -> tuple[str, str]:
    """('ok' | 'error' | 'traceback', detail) of loading `path` and running a forward pass on it."""
    import traceback

    from verispec.errors import VerispecError
    from verispec.models.gguf.model import load_gguf
    from verispec.models.gguf.runner import NativeRunner

    try:
        model = load_gguf(path, show_progress=False)
        runner = NativeRunner(model, threads=1)
        tokens = [0, model.config.vocab - 1][: model.config.context]  # what fits the context window
        logits = runner.forward(runner.new_state(1), [tokens], [1])
        return "ok", f"logits {tuple(logits.shape)}"
    except VerispecError as err:
        text = str(err)
        if "\n" in text or "\r" in text or path.name not in text:
            return "traceback", f"a VerispecError that is not one line naming the file: {text!r}"
        return "error", text
    except BaseException as err:  # noqa: BLE001 - anything else is what the test looks for
        return "traceback", f"{type(err).__name__}: {err} | " + " / ".join(traceback.format_exc().splitlines()[-4:])


def main() -> None:
    import faulthandler

    import torch

    faulthandler.enable()  # a signal prints where it struck, to stderr
    torch.set_num_threads(1)
    base, first, stride, work = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    path = work / f"variant-{first % stride}-of-{stride}.gguf"
    for i, (name, data) in enumerate(variants(base)):
        if i < first or (i - first) % stride:
            continue
        path.write_bytes(data)
        outcome, detail = load_one(path)
        print(json.dumps({"i": i, "name": name, "outcome": outcome, "detail": detail[:300]}), flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
