"""Every fast path gives the reference path's results: packed target weights, int8 drafts."""

import copy

import pytest
import torch

from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from test_engine import GREEDY, PROMPTS, hf_greedy
from test_exactness import V, check_distribution, sample_tokens
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder, VerispecError
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.models import LoadedModel, ModelRunner
from verispec.models.runners.packed import pack_linear_layers, packing_supported
from verispec.models.runners.quantized import int8_supported, quantize_linear_layers

needs_packing = pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN weight packing unavailable")
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="int8 weight-only kernel unavailable")


def packed(model):
    model = copy.deepcopy(model)
    assert pack_linear_layers(model) > 0
    return model


def quantized(model):
    model = copy.deepcopy(model)
    assert quantize_linear_layers(model) > 0
    return model


@needs_packing
def test_packed_logits_equal_dense_logits_up_to_rounding():
    model = tiny_model("qwen2", vocab=64, seed=0)
    ids = torch.tensor([[3, 9, 27, 17, 51, 25]])
    with torch.no_grad():
        torch.testing.assert_close(packed(model)(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@needs_packing
@needs_int8
@pytest.mark.parametrize("K", [1, 4])
def test_packed_target_with_int8_draft_is_greedy_equal(K):
    target = tiny_model("llama", vocab=64, seed=0, sharpness=30.0)
    draft = noisy_copy(target, 0.3)
    engine = SpeculativeEngine(ModelRunner(packed(target)), DraftModelDrafter(ModelRunner(quantized(draft)), 64), set())
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=K, max_new_tokens=24))
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.generated == hf_greedy(target, prompt, 24)
    drafts_accepted(seqs)


@needs_packing
@needs_int8
def test_packed_target_with_int8_draft_samples_the_target_distribution(sampling_pair):
    target, draft = sampling_pair
    sampling = SamplingConfig(temperature=0.9, top_k=6)
    engine = SpeculativeEngine(ModelRunner(packed(target)), DraftModelDrafter(ModelRunner(quantized(draft)), V), set())
    samples, seqs = sample_tokens(engine, sampling, 3)
    assert 0 < sum(s.stats.accepted_tokens for s in seqs) < sum(s.stats.draft_tokens for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > 1e-4, fit


def test_int8_target_is_refused():
    model = tiny_model("llama")
    with pytest.raises(VerispecError, match="int8"):
        SpeculativeDecoder(LoadedModel("t", model, None, "mem", weights="int8"), "ngram")
