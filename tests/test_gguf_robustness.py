"""A GGUF file's configuration is checked before any kernel runs, the reader turns every damage into one
VerispecError line naming the file and the field, and the C kernels return an error code instead of
dividing by zero or writing through a failed allocation (those run in a subprocess, so that a signal, as
before the fix, fails the test instead of killing pytest). The seeded fuzz test is tests/test_gguf_fuzz.py."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_gguf import ARRAY, STRING, T, read_layout, write_tiny_gguf

from verispec.errors import VerispecError
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.native import check

U32, I32, U64, F32 = 4, 5, 10, 6
SRC = str(Path(__file__).resolve().parent.parent / "src")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", types=(T.Q8_0,), hidden=64, heads=4,
                           kv_heads=2, ffn=128, vocab=64, layers=1)


def nested(depth: int) -> bytes:
    raw = struct.pack("<IQ", U32, 0)
    for _ in range(depth):
        raw = struct.pack("<IQ", ARRAY, 1) + raw
    return raw


CASES = [  # (what is changed, field name in metadata, GGUF type, value, what the one line must name)
    ("no key/value heads", "qwen2.attention.head_count_kv", U32, 0, "head_count_kv"),
    ("no query heads", "qwen2.attention.head_count", U32, 0, "head_count"),
    ("query heads not a multiple of key/value heads", "qwen2.attention.head_count_kv", U32, 3, "head_count_kv"),
    ("an odd head size", "qwen2.attention.key_length", U32, 15, "key_length"),
    ("values of another size than keys", "qwen2.attention.value_length", U32, 8, "value_length"),
    ("no layers", "qwen2.block_count", U32, 0, "block_count"),
    ("no context", "qwen2.context_length", U32, 0, "context_length"),
    ("a context past the kernels' int32 columns", "qwen2.context_length", U64, 2**40, "context_length"),
    ("no feed-forward width", "qwen2.feed_forward_length", U32, 0, "feed_forward_length"),
    ("no embedding width", "qwen2.embedding_length", U32, 0, "embedding_length"),
    ("a negative embedding width", "qwen2.embedding_length", I32, -64, "embedding_length"),
    ("a NaN RoPE base", "qwen2.rope.freq_base", F32, math.nan, "rope.freq_base"),
    ("a zero RoPE base", "qwen2.rope.freq_base", F32, 0.0, "rope.freq_base"),
    ("a NaN norm epsilon", "qwen2.attention.layer_norm_rms_epsilon", F32, math.nan, "layer_norm_rms_epsilon"),
    ("a count given as a string", "qwen2.block_count", STRING, "1", "block_count"),
    ("a count given as an array", "qwen2.attention.head_count", ARRAY, (U32, [4]), "head_count"),
    ("alignment 0", "general.alignment", U32, 0, "general.alignment"),
    ("alignment not a power of two", "general.alignment", U32, 48, "general.alignment"),
    ("alignment as a string", "general.alignment", STRING, "32", "general.alignment"),
    ("a name that is not UTF-8", "general.name", STRING, b"\xc3\x28", "general.name"),
]


@pytest.mark.parametrize("what,key,vtype,value,named", CASES, ids=[c[0] for c in CASES])
def test_a_bad_configuration_is_one_line_naming_the_file_and_the_field(tiny, tmp_path, what, key, vtype, value, named):
    path = tmp_path / "bad.gguf"
    path.write_bytes(read_layout(tiny).with_field(key, vtype, value).build())
    with pytest.raises(VerispecError) as caught:
        load_gguf(path, show_progress=False)
    message = str(caught.value)
    assert "\n" not in message and "bad.gguf" in message and named in message, message


@pytest.mark.parametrize("depth", [5, 10_000])
def test_deeply_nested_metadata_arrays_are_one_line(tiny, tmp_path, depth):
    """Before: arrays nested 10,000 deep escaped as a RecursionError traceback."""
    layout = read_layout(tiny)
    layout.fields.append(["test.nested", ARRAY, nested(depth)])
    path = tmp_path / "nested.gguf"
    path.write_bytes(layout.build())
    with pytest.raises(VerispecError, match="nested.gguf.*test.nested.*nested more than"):
        load_gguf(path, show_progress=False)


def test_arrays_nested_a_little_and_vocabularies_still_load(tiny, tmp_path):
    layout = read_layout(tiny).with_field("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "\u00e9", "b"]))
    layout.fields.append(["test.nested", ARRAY, nested(3)])
    path = tmp_path / "fine.gguf"
    path.write_bytes(layout.build())
    assert load_gguf(path, show_progress=False).config.kv_heads == 2


def _tensor_index(layout, name):
    return next(i for i, t in enumerate(layout.tensors) if t[0] == name)


@pytest.mark.parametrize("change,named", [
    ({"dims": [64]}, "token_embd.weight"),  # before: an IndexError traceback
    ({"dims": [64, 64, 1, 1, 1]}, "token_embd.weight"),
    ({"dims": [2**63, 2**63]}, "token_embd.weight"),  # an element count past int64
    ({"qtype": 99}, "token_embd.weight"),
    ({"qtype": 16}, "token_embd.weight"),  # a type the kernels lack (IQ2_XXS)
    ({"offset": 1}, "token_embd.weight"),  # off the alignment
    ({"offset": 2**63}, "token_embd.weight"),
])
def test_a_bad_tensor_entry_is_one_line_naming_the_tensor(tiny, tmp_path, change, named):
    layout = read_layout(tiny)
    entry = layout.tensors[_tensor_index(layout, "token_embd.weight")]
    for field, value in change.items():
        entry[["name", "dims", "qtype", "offset"].index(field)] = value
    path = tmp_path / "bad.gguf"
    path.write_bytes(layout.build())
    with pytest.raises(VerispecError) as caught:
        load_gguf(path, show_progress=False)
    message = str(caught.value)
    assert "\n" not in message and "bad.gguf" in message and named in message, message


@pytest.mark.parametrize("header", [
    struct.pack("<4sIQQ", b"GGUF", 3, 2**62, 0),  # tensor count past what the file holds
    struct.pack("<4sIQQ", b"GGUF", 3, 0, 2**62),  # key count past what the file holds
    struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 2**63),  # a key of 2**63 bytes
    struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", ARRAY, U32, 2**61),
    struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77) + b"\0" * 64,
    b"GGUF",
    b"GGUF\x03\x00",
    b"",
])
def test_absurd_counts_and_lengths_are_one_line(tmp_path, header):
    path = tmp_path / "absurd.gguf"
    path.write_bytes(header + b"\0" * 64)
    with pytest.raises(VerispecError) as caught:
        load_gguf(path, show_progress=False)
    assert "\n" not in str(caught.value) and "absurd.gguf" in str(caught.value)


def test_kernel_status_codes_become_a_memory_error_or_one_line():
    check(0, "ok")
    with pytest.raises(MemoryError, match="layer 3"):
        check(-3, "layer 3")
    with pytest.raises(VerispecError, match="layer 3 failed in the native kernels"):
        check(-1, "layer 3")


# ------------------------------------------------------------------ the C kernels, in a subprocess

KERNEL_CASES = textwrap.dedent("""
    import ctypes, json, resource, sys
    import numpy as np
    sys.path.insert(0, SRC)
    from verispec.models.gguf.native import DimsStruct, LayerStruct, lib, ptr

    def attention(n, hq, hkv, dim, prefix):
        q = np.zeros((n, hq, dim), np.float32)
        out = np.zeros_like(q)
        cache = np.zeros(64 * max(hkv, 1) * dim, np.float32)
        base = np.full(n, cache.ctypes.data, np.int64)
        pre = np.full(n, prefix, np.int32)
        off = np.zeros(n + 1, np.int32)
        extra = np.zeros(1, np.int32)
        head_stride = np.full(n, dim, np.int64)
        return lib().vs_attention(ptr(q), n, hq, hkv, dim, 0.125, ptr(base), ptr(base), max(hkv, 1) * dim,
                                  ptr(head_stride), ptr(pre), ptr(off), ptr(extra), ptr(out))

    def layer(n, kv_heads, head_dim=16, rope_dim=None):
        dims = DimsStruct(64, 4, kv_heads, head_dim, 128, 1, 0, 0, rope_dim or head_dim, 1e-6, 0.25, 1.0)
        zeros = np.zeros(max(n, 1) if n < 1 << 20 else 1, np.int64)
        return lib().vs_layer_forward(ctypes.byref(dims), ctypes.byref(LayerStruct()), ptr(zeros), n, ptr(zeros),
                                      ptr(zeros), ptr(zeros), ptr(zeros), 0, 32, ptr(zeros), ptr(zeros),
                                      ptr(zeros), ptr(zeros), 0)

    def limit_memory():  # malloc past this fails whatever the machine's overcommit policy
        import os
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        new = used + (1 << 30) if hard == resource.RLIM_INFINITY else min(used + (1 << 30), hard)
        resource.setrlimit(resource.RLIMIT_AS, (new, hard))  # the soft limit only: a later case may set it again

    def matmul_float(cols):
        w, x, out = np.zeros(64, np.uint8), np.zeros(64, np.float32), np.zeros(64, np.float32)
        return lib().vs_matmul_float(0, ptr(w), 1, cols, 0, ptr(x), ptr(out))

    def quantize(block):
        x, q = np.zeros(64, np.float32), np.zeros(64, np.int8)
        d, s = np.zeros(64, np.float32), np.zeros(64, np.int32)
        return lib().vs_quantize_rows(ptr(x), 1, 64, block, ptr(q), ptr(d), ptr(s))

    def experts(pick, used=1):
        from verispec.models.gguf.native import WeightStruct
        w = (WeightStruct * 4)()
        x, out = np.zeros(64, np.float32), np.zeros(64, np.float32)
        picks, weights = np.full(used, pick, np.int32), np.ones(used, np.float32)
        return lib().vs_moe_ffn(ctypes.byref(w), ctypes.byref(w), ctypes.byref(w), 4, 32, ptr(x), 1, 64, used,
                                ptr(picks), ptr(weights), ptr(out))

    CASES = {
        "an expert picked out of range": lambda: experts(4),
        "a negative expert picked": lambda: experts(-1),
        "more experts a token than there are": lambda: experts(0, used=5),
        "attention with no key/value heads": lambda: attention(1, 4, 0, 16, 1),
        "attention with heads not a multiple": lambda: attention(1, 4, 3, 16, 1),
        "a layer with no key/value heads": lambda: layer(1, 0),
        "a layer with an odd head size": lambda: layer(1, 2, head_dim=15),
        "a layer rotating more than its heads": lambda: layer(1, 2, head_dim=16, rope_dim=18),
        "quantizing in blocks of 0": lambda: quantize(0),
        "a layer whose scratch cannot be allocated": lambda: (limit_memory(), layer(1 << 40, 2))[1],
        "attention whose scratch cannot be allocated": lambda: (limit_memory(), attention(1, 1, 1, 16, 1 << 30))[1],
        "a float matmul whose row cannot be allocated": lambda: (limit_memory(), matmul_float(1 << 40))[1],
    }
    names = list(CASES)
    for name in names[int(sys.argv[1]):]:
        print(json.dumps({"case": name, "status": CASES[name]()}), flush=True)
""")
EXPECTED = {"an expert picked out of range": -2, "a negative expert picked": -2,
            "more experts a token than there are": -1,"attention with no key/value heads": -1, "attention with heads not a multiple": -1,
            "a layer with no key/value heads": -1, "a layer with an odd head size": -1,
            "a layer rotating more than its heads": -1, "quantizing in blocks of 0": -1,
            "a layer whose scratch cannot be allocated": -3, "attention whose scratch cannot be allocated": -3,
            "a float matmul whose row cannot be allocated": -3}


def run_until_done(script: str, total: int) -> tuple[dict, list[str]]:
    """Run `script FIRST` from case 0; after a crash, start again past the case that crashed. Returns
    {case: status} and one line per crash (the signal or exit status)."""
    results, crashes, first = {}, [], 0
    while first < total:
        done = subprocess.run([sys.executable, "-c", script, str(first)], capture_output=True, text=True, timeout=120)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        results.update({line["case"]: line["status"] for line in lines})
        first += len(lines)
        if done.returncode != 0:
            crashes.append(f"case {first} ended the process with status {done.returncode}: {done.stderr[-300:]}")
            first += 1
    return results, crashes


def test_the_kernels_return_an_error_code_instead_of_crashing():
    """Before: SIGFPE (a division by zero key/value heads, or by a block of 0) and SIGSEGV (a failed malloc
    written through). Now each returns VS_EINVAL (-1) or VS_ENOMEM (-3), which native.check turns into a
    VerispecError or a MemoryError."""
    results, crashes = run_until_done(KERNEL_CASES.replace("SRC", repr(SRC)), len(EXPECTED))
    assert not crashes, crashes
    assert results == EXPECTED


def test_a_file_whose_shapes_match_zero_key_value_heads_is_refused_before_any_kernel(tmp_path):
    """head_count_kv = 0 with key and value tensors of 0 rows passes every shape check; before, the first
    forward pass died of SIGFPE in the attention kernel. Now the load refuses it in one line."""
    path = write_tiny_gguf(tmp_path / "kv0.gguf", types=(T.F32,), hidden=64, heads=4, kv_heads=0, ffn=128,
                           vocab=64, layers=1)
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {SRC!r})
        from verispec.errors import VerispecError
        from verispec.models.gguf.model import load_gguf
        from verispec.models.gguf.runner import NativeRunner
        try:
            runner = NativeRunner(load_gguf(Path({str(path)!r}), show_progress=False), threads=1)
            runner.forward(runner.new_state(1), [[1, 2]], [1])
            print("ran")
        except VerispecError as err:
            print("refused:", err)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the process ended with status {done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.startswith("refused: kv0.gguf: metadata 'qwen2.attention.head_count_kv' is 0"), done.stdout
