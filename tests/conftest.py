"""Tiny randomly initialised Llama / Qwen2 models built in the tests: offline, CPU, seconds."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
# runners keep the AVX-512 kernel's own tile: no timing at startup, and the tile tests set theirs (test_tiles.py
# tests the measuring and the cache)
os.environ.setdefault("VERISPEC_KERNEL_TUNING", "0")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


# Tiny models gain nothing from threads, and thread hand-offs dominate their small ops.
torch.set_num_threads(1)


def tiny_model(arch: str = "llama", vocab: int = 64, seed: int = 0, layers: int = 2, sharpness: float = 1.0):
    """A tiny causal LM; `sharpness` scales the output head so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model.eval()


def forward_tree(runner, state, chains, nodes, parents):
    """One runner pass over committed tokens chains[b] then draft nodes nodes[b] (parent slots parents[b]): the
    logits after the last committed token (where a row has one) and after each node, row by row."""
    tokens = [list(c) + list(n) for c, n in zip(chains, nodes)]
    return runner.forward(state, tokens, [(1 if c else 0) + len(n) for c, n in zip(chains, nodes)], parents)


def chain(n: int) -> list[int]:
    """The parents of n draft nodes that form a chain."""
    return list(range(-1, n - 1))


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with the target often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))  # noise relative to each tensor's scale
    return draft.eval()


@pytest.fixture(scope="session")
def greedy_pair():
    """(target, draft) with sharp outputs, so greedy acceptance is mixed, neither 0 nor 1."""
    target = tiny_model("llama", vocab=64, seed=0, sharpness=30.0)
    return target, noisy_copy(target, 0.3)


@pytest.fixture(scope="session")
def sampling_pair():
    """(target, draft) over a small vocabulary for chi-square tests."""
    target = tiny_model("qwen2", vocab=8, seed=3, sharpness=4.0)
    return target, noisy_copy(target, 1.5, seed=4)
