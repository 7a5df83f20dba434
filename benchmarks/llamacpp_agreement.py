"""How far the native runner's logits are from llama.cpp's on the same GGUF file, weight type by weight type.

    .venv/bin/python benchmarks/llamacpp_agreement.py [--tokens 40] [--file model.gguf ...]

For each architecture (llama, qwen2, qwen3, gemma2 and gemma3 with a sliding window of 12, phi3, smollm3, granite,
olmo2, qwen3moe, mixtral; phi4-mini: phi3 with LongRoPE over a partial RoPE; qwen3-yarn) and weight type, a tiny random-weight file is written with gguf's writer
(as tests/tiny_gguf.py does); both runners read the same token ids, llama.cpp one token a pass (as it decodes) with
its key/value cache in float32. Printed: the largest logit difference over the logits' spread (their standard
deviation) and how many positions' argmax agree; then the same for each --file (real models).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf import GGUFValueType  # noqa: E402
from test_gguf_architectures import GRANITE, llamacpp_logits, native_logits, phi4_mini_file, yarn  # noqa: E402
from tiny_gguf import T, write_tiny_gguf  # noqa: E402

TYPES = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]


def compare(path: Path, tokens: list[int]) -> str:
    ours, theirs = native_logits(path, tokens), llamacpp_logits(path, tokens)
    rel = float(np.abs(ours - theirs).max() / theirs.std())
    same = int((ours.argmax(-1) == theirs.argmax(-1)).sum())
    return f"{rel:9.1e}   argmax {same}/{len(tokens)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--file", nargs="*", default=[], help="real GGUF files to compare too")
    args = ap.parse_args()
    tokens = [int(t) for t in np.random.default_rng(1).integers(4, 300, args.tokens)]
    print(f"{'file':<28} {'difference / spread':>19}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite", "olmo2", "qwen3moe",
                     "mixtral", "phi4-mini", "qwen3-yarn"):
            for qtype in TYPES:
                if arch == "phi4-mini":
                    path = phi4_mini_file(Path(tmp) / "tiny.gguf", 16, qtype)
                    print(f"{arch + ' ' + qtype.name:<28} {compare(path, tokens)}")
                    continue
                shape = dict(hidden=256, heads=8, head_dim=64) if arch in ("qwen3", "gemma3", "qwen3moe", "qwen3-yarn",
                                                                           "mixtral") else dict(hidden=256, heads=4)
                meta = {"gemma2": {"gemma2.attention.sliding_window": (12, GGUFValueType.UINT32)},
                        "gemma3": {"gemma3.attention.sliding_window": (12, GGUFValueType.UINT32)},
                        "granite": GRANITE,
                        "qwen3-yarn": yarn("qwen3", 32)}.get(arch)
                path = write_tiny_gguf(Path(tmp) / "tiny.gguf", arch.removesuffix("-yarn"), (qtype,), seed=4,
                                       kv_heads=2, vocab=300, vocab_tokens=True, metadata=meta,
                                       tied=arch.startswith("gemma"), **shape)
                print(f"{arch + ' ' + qtype.name:<28} {compare(path, tokens)}")
    for name in args.file:
        real = [int(t) for t in np.random.default_rng(2).integers(10, 20000, args.tokens)]
        print(f"{Path(name).name[:28]:<28} {compare(Path(name), real)}")


if __name__ == "__main__":
    main()
