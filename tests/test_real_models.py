"""Real weights (slow, opt-in: `pytest -m slow`; needs `bash scripts/setup.sh --models`).

Greedy speculative decoding of the default Qwen pair on the torch route (packed target, int8 draft)
equals plain greedy decoding of the target as loaded, token for token, in float32, with both drafters;
and Hugging Face `generate` agrees. On the native runner (the default for GGUF files), greedy speculative
decoding with every drafter equals the runner's own plain decoding, self-speculation and the shipped
Medusa and EAGLE-3 heads included (both routes).
"""

import pytest
import torch

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
]
N = 40


@pytest.fixture(scope="module")
def models():
    """The reference target as loaded, and the default fast path: packed target, int8 draft."""
    return (load_model(DEFAULT_TARGET, "float32", backend="torch"),
            load_model(DEFAULT_TARGET, "float32", "packed", backend="torch"),
            load_model(DEFAULT_DRAFT, "float32", "int8", backend="torch"))


def test_default_pair_greedy_equals_plain_decoding(models):
    target, fast_target, draft = models
    plain = SpeculativeDecoder(target, "none")
    greedy = SamplingConfig(temperature=0)
    for prompt in PROMPTS:
        reference = plain.generate(prompt, greedy, SpecConfig(max_new_tokens=N))
        ids = torch.tensor([reference.prompt_token_ids])
        hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
        assert reference.token_ids == hf[0, ids.shape[1]:].tolist()
        for drafter in (draft, "ngram"):
            out = SpeculativeDecoder(fast_target, drafter).generate(prompt, greedy, SpecConfig(num_draft_tokens=4, max_new_tokens=N))
            assert out.token_ids == reference.token_ids
            assert out.stats.tokens_per_target_pass >= 1.0


def test_default_pair_on_the_native_runner_greedy_equals_its_plain_decoding():
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    assert target.backend == draft.backend == "native"
    plain = SpeculativeDecoder(target, "none")
    greedy = SamplingConfig(temperature=0)
    for prompt in PROMPTS:
        reference = plain.generate(prompt, greedy, SpecConfig(max_new_tokens=N))
        for drafter in (draft, "ngram", "distilled"):
            decoder = SpeculativeDecoder.load(DEFAULT_TARGET, "distilled") if drafter == "distilled" else SpeculativeDecoder(target, drafter)
            out = decoder.generate(prompt, greedy, SpecConfig(num_draft_tokens=4, max_new_tokens=N))
            assert out.token_ids == reference.token_ids


def test_self_speculation_on_the_default_target_greedy_equals_plain_decoding():
    """The shipped searched skip set, an early exit, and the on-the-fly choice, on the native runner; the
    shipped set on the torch route too."""
    from verispec.config import SelfDraftConfig

    greedy = SamplingConfig(temperature=0)
    for backend in ("native", "torch"):
        target = load_model(DEFAULT_TARGET, "float32", "packed", backend=backend)
        plain = SpeculativeDecoder(target, "none")
        drafts = [("self", SelfDraftConfig())] + ([("self:20-", SelfDraftConfig()), ("self", SelfDraftConfig(retune=True))]
                                                 if backend == "native" else [])
        for prompt in PROMPTS:
            reference = plain.generate(prompt, greedy, SpecConfig(max_new_tokens=N))
            for draft, config in drafts:
                decoder = SpeculativeDecoder(target, draft, self_draft=config)
                assert decoder.skip_source != "default"  # the shipped set was found for this target
                out = decoder.generate(prompt, greedy, SpecConfig(num_draft_tokens=3, max_new_tokens=N))
                assert out.token_ids == reference.token_ids, (backend, draft)
                assert out.stats.draft_tokens > 0


def test_the_shipped_heads_on_the_default_target_greedy_equal_plain_decoding():
    """The Medusa and EAGLE-3 heads shipped for the default target (found by their manifests' fingerprints),
    chains and dynamic trees, on both routes; they accept some drafts."""
    from verispec import TreeConfig

    greedy = SamplingConfig(temperature=0)
    for backend in ("native", "torch"):
        target = load_model(DEFAULT_TARGET, "float32", "dense", backend=backend)
        plain = SpeculativeDecoder(target, "none")
        for prompt in PROMPTS:
            reference = plain.generate(prompt, greedy, SpecConfig(max_new_tokens=N))
            for draft in ("medusa", "eagle"):
                decoder = SpeculativeDecoder(target, draft)
                for tree in (None, TreeConfig(budget=8)):
                    out = decoder.generate(prompt, greedy, SpecConfig(num_draft_tokens=3, max_new_tokens=N, tree=tree))
                    assert out.token_ids == reference.token_ids, (backend, draft, tree)
                    assert out.stats.accepted_tokens > 0, (backend, draft, tree)


def test_structured_output_on_the_native_runner_greedy_equals_constrained_plain_decoding():
    """The shipped structured prompts' schemas on the default pair: greedy constrained speculation (the 0.5B draft with
    its q masked too, suffix decoding, prompt lookup) equals greedy constrained plain decoding, every answer valid."""
    import json

    from verispec.config import Constraint
    from verispec.datasets import STRUCTURED_PROMPTS, load_prompts

    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    plain = SpeculativeDecoder(target, "none")
    for p in load_prompts(STRUCTURED_PROMPTS, per_category=1):
        sampling = SamplingConfig(temperature=0, constraint=Constraint("json_schema", p.schema))
        spec = SpecConfig(num_draft_tokens=4, max_new_tokens=200)
        reference = plain.generate(p.text, sampling, spec)
        assert reference.finish_reason == "eos" and isinstance(json.loads(reference.text), dict)
        for drafter in (draft, "suffix", "ngram"):
            out = SpeculativeDecoder(target, drafter).generate(p.text, sampling, spec)
            assert out.token_ids == reference.token_ids, (p.question_id, drafter)
            assert out.stats.forced_tokens > 0


def test_gemma3_270m_runs_natively_agrees_with_llamacpp_and_drafts_for_the_default_target():
    """The shipped Gemma 3 270M (Q4_K_M) on the native runner: its argmax equals llama.cpp's on the same file at every
    position of a prompt (logits part by a few % of the spread where one int8 activation rounds the other way, as for
    every real file), and as the default target's cross-tokenizer draft greedy output equals plain decoding."""
    import importlib.util

    import numpy as np

    from verispec.models.gguf.model import load_gguf
    from verispec.models.gguf.runner import NativeRunner
    from verispec.models.registry import NAMED_MODELS, assemble

    gemma = load_model("gemma-3-270m")
    assert gemma.backend == "native"
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        path = assemble(NAMED_MODELS["gemma-3-270m"])
        llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
        tokens = llm.tokenize(b"Once upon a time, in a small village by the sea, there lived", add_bos=True)
        for t in tokens:
            llm.eval([t])
        theirs = np.array(llm.scores[: len(tokens)], np.float32)
        runner = NativeRunner(load_gguf(path, show_progress=False))
        ours = runner.forward(runner.new_state(1), [tokens], [len(tokens)])[0].numpy()
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    target = load_model(DEFAULT_TARGET)
    greedy = SamplingConfig(temperature=0)
    for prompt in PROMPTS:
        reference = SpeculativeDecoder(target, "none").generate(prompt, greedy, SpecConfig(max_new_tokens=N))
        out = SpeculativeDecoder(target, gemma).generate(prompt, greedy, SpecConfig(num_draft_tokens=4, max_new_tokens=N))
        assert out.token_ids == reference.token_ids
        assert out.stats.tokens_per_target_pass > 1.0
