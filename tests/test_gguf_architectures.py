"""GGUF files as llama.cpp users bring them, on the native runner: read whole or refused, and where read, the same
model llama.cpp runs from the same file.

Agreement with llama.cpp is checked on tiny random-weight files written here with gguf's writer (real tensor names
and metadata): float32 weights and llama.cpp's key/value cache in float32 (the precision the native runner keeps),
so the two differ only by the order of float sums (1e-4 of the logits' spread at most), and greedy continuations
agree token for token.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from gguf import GGUFValueType

from tiny_gguf import T, write_tiny_gguf
from verispec.errors import VerispecError
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner

HEADS, HIDDEN = 4, 256  # head size 64: 32 RoPE pairs
needs_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                    reason="llama-cpp-python is an optional extra")


def llama3_factors(dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                   original: int = 64) -> np.ndarray:
    """Llama 3's per-pair RoPE frequency factors, as llama.cpp's converter writes them into rope_freqs.weight (an
    original context of 64 here, so that the tiny model's positions reach every regime of the formula)."""
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelength = 2 * np.pi / freqs
    smooth = (original / wavelength - low) / (high - low)
    scaled = np.where(wavelength > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    return np.where(wavelength < original / high, 1.0, scaled).astype(np.float32)


def native_logits(path, tokens: list[int]) -> np.ndarray:
    runner = NativeRunner(load_gguf(path, show_progress=False))
    return runner.forward(runner.new_state(1), [tokens], [len(tokens)])[0].numpy()  # (T, V)


def llamacpp_logits(path, tokens: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1, type_k=0, type_v=0)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)  # (T, V)


def greedy(logits_of, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(logits_of(tokens)[-1])))
    return tokens[len(prompt):]


@needs_llamacpp
def test_llama3_rope_scaling_is_read_and_agrees_with_llamacpp(tmp_path):
    factors = llama3_factors(HIDDEN // HEADS, 10000.0)
    assert len(set(factors.round(3).tolist())) > 3  # every regime: 1, the factor, and between
    path = write_tiny_gguf(tmp_path / "llama3.gguf", "llama", (T.F32,), seed=3, hidden=HIDDEN, heads=HEADS,
                           vocab=300, rope_factors=factors, vocab_tokens=True)
    plain = write_tiny_gguf(tmp_path / "llama2.gguf", "llama", (T.F32,), seed=3, hidden=HIDDEN, heads=HEADS,
                            vocab=300, vocab_tokens=True)  # the same weights without the factors
    tokens = [int(t) for t in np.random.default_rng(0).integers(4, 300, 48)]
    ours, theirs = native_logits(path, tokens), llamacpp_logits(path, tokens)
    spread = float(theirs.std())
    assert np.abs(ours - theirs).max() < 1e-4 * spread + 1e-5
    without = native_logits(plain, tokens)  # the factors change the model: a runner ignoring them is caught
    assert np.abs(without - theirs).max() > 100 * np.abs(ours - theirs).max()
    assert greedy(lambda t: native_logits(path, t), tokens[:8], 24) == \
        greedy(lambda t: llamacpp_logits(path, t), tokens[:8], 24)


def test_a_tensor_the_runner_does_not_read_is_refused(tmp_path):
    extra = {"blk.0.attn_q_norm.weight": np.ones(HIDDEN // HEADS, np.float32)}  # a Qwen3-style norm in a llama file
    path = write_tiny_gguf(tmp_path / "extra.gguf", "llama", (T.F32,), hidden=HIDDEN, heads=HEADS, extra=extra)
    with pytest.raises(VerispecError, match=r"tensor 'blk.0.attn_q_norm.weight' is not read by verispec's CPU "
                                            r"runner for 'llama'.*--backend llama.cpp"):
        load_gguf(path, show_progress=False)


@pytest.mark.parametrize("metadata, message", [
    ({"llama.rope.dimension_count": (32, GGUFValueType.UINT32)}, r"rope.dimension_count' \(32\) rotates part"),
    ({"llama.rope.scaling.type": ("yarn", GGUFValueType.STRING)}, r"RoPE scaling 'yarn' is not supported"),
])
def test_rope_the_runner_cannot_run_is_refused(tmp_path, metadata, message):
    path = write_tiny_gguf(tmp_path / "rope.gguf", "llama", (T.F32,), hidden=HIDDEN, heads=HEADS, metadata=metadata)
    with pytest.raises(VerispecError, match=message):
        load_gguf(path, show_progress=False)


def test_rope_factors_that_are_not_positive_are_refused(tmp_path):
    factors = np.ones(HIDDEN // HEADS // 2, np.float32)
    factors[3] = 0.0
    path = write_tiny_gguf(tmp_path / "zero.gguf", "llama", (T.F32,), hidden=HIDDEN, heads=HEADS, rope_factors=factors)
    with pytest.raises(VerispecError, match="rope_freqs.weight' holds factors that are not finite and positive"):
        load_gguf(path, show_progress=False)


def test_a_hugging_face_llama3_converted_for_the_native_runner_keeps_its_rope_scaling():
    """A draft converted from a Hugging Face Llama with rope_scaling 'llama3' gets the same factors: its native logits
    equal the torch model's to float tolerance (and differ without them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.models.gguf.convert import model_from_torch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    model = LlamaForCausalLM(config).eval()
    gguf = model_from_torch(model, qtype=0)
    assert gguf.rope_factors is not None and gguf.rope_factors.max() > 1
    tokens = list(range(3, 60))
    runner = NativeRunner(gguf)
    ours = runner.forward(runner.new_state(1), [tokens], [len(tokens)])[0]
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    model.config.rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                 "rope_theta": 10000.0}
    with pytest.raises(VerispecError, match="RoPE scaling 'yarn' is not supported"):
        model_from_torch(model, qtype=0)
