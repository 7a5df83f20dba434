"""Layer 3 and 4 on tiny models: greedy equality with plain decoding for every drafter, ragged
batches equal single prompts, seeded determinism, EOS and length limits, stop strings."""

import pytest
import torch

from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter, lookup
from verispec.config import PromptLookupConfig
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


def hf_greedy(model, prompt, n, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_drafter(kind, draft_model, vocab):
    if kind == "draft-model":
        return DraftModelDrafter(ModelRunner(draft_model), vocab)
    if kind == "ngram":
        return PromptLookupDrafter()
    return None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["none", "draft-model", "ngram"])
@pytest.mark.parametrize("K", [1, 3, 8])
def test_greedy_equals_model_generate(arch, kind, K):
    target = tiny_model(arch, vocab=64, seed=0, sharpness=30.0)
    draft = noisy_copy(target, 0.3)
    engine = SpeculativeEngine(ModelRunner(target), make_drafter(kind, draft, 64), set())
    sequences = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=K, max_new_tokens=24))
    for prompt, seq in zip(PROMPTS, sequences):
        assert seq.generated == hf_greedy(target, prompt, 24)
        assert seq.stats.new_tokens == 24
        if kind != "none":
            assert seq.stats.target_forward_passes <= 24
    if kind != "none":  # "none" checks plain decoding against `generate`; the drafters must have drafted
        drafted, accepted = drafts_accepted(sequences)
        if kind == "draft-model":
            assert accepted < drafted, "both paths should be exercised"


def test_draft_equal_to_target_accepts_everything_and_catches_up(greedy_pair):
    target, _ = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(target), 64), set())
    seq = engine.generate([PROMPTS[1]], GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=25))[0]
    assert seq.generated == hf_greedy(target, PROMPTS[1], 25)
    assert drafts_accepted([seq]) == (20, 20)
    assert seq.stats.target_forward_passes == 5  # 5 tokens per pass: 4 accepted + 1 bonus


def test_a_draft_that_reads_only_the_prompt_tail_stays_greedy_equal_and_reads_less(greedy_pair):
    """`context`: the draft skips all but the last N prompt tokens (its prompt pass is shorter); its
    guesses change, the output does not. Ragged prompts, some shorter than N, and tree steps too."""
    from verispec.config import TreeConfig

    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=20))]
    for tree in (None, TreeConfig(budget=6, top_k=2)):
        drafter = DraftModelDrafter(ModelRunner(draft), 64, context=3)
        engine = SpeculativeEngine(ModelRunner(target), drafter, set())
        seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=20, tree=tree))
        assert [s.generated for s in seqs] == expected
        drafts_accepted(seqs)
    drafter = DraftModelDrafter(ModelRunner(draft), 64, context=3)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    seqs = engine.make_sequences(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=2), 0)
    drafter.start(seqs)
    assert drafter.cached == [len(p) - 3 for p in PROMPTS[:2]] + [0]  # the prompt of one token is read whole
    drafter.propose(seqs, [2, 2, 2])
    held = [n + fed for n, fed in zip(drafter.state.lengths.tolist(), drafter.fed)]  # committed, then draft nodes
    assert held == [3 + 1, 3 + 1, 1 + 1]  # the tail, then the first draft token
    with pytest.raises(VerispecError, match="at least 1 token"):
        DraftModelDrafter(ModelRunner(draft), 64, context=0)


def test_draft_vocab_padding_is_aligned(greedy_pair):
    """A draft whose output layer is padded to a larger vocabulary (as 151936 vs 152064) still works."""
    target, near = greedy_pair
    draft = tiny_model("llama", vocab=80, seed=5)
    with torch.no_grad():  # the greedy pair's draft in its first 64 rows, so its drafts are often accepted
        for name, p in draft.named_parameters():
            p[: near.get_parameter(name).shape[0]] = near.get_parameter(name)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    seq = engine.generate([PROMPTS[0]], SamplingConfig(temperature=1.0), SpecConfig(max_new_tokens=20), seeds=0)[0]
    assert all(t < 64 for t in seq.generated)
    seq = engine.generate([PROMPTS[0]], GREEDY, SpecConfig(max_new_tokens=20))[0]
    assert seq.generated == hf_greedy(target, PROMPTS[0], 20)
    drafts_accepted([seq])


@pytest.mark.parametrize("kind", ["draft-model", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ragged_batch_equals_each_prompt_alone(greedy_pair, kind, temperature):
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), make_drafter(kind, draft, 64), set())
    sampling = SamplingConfig(temperature=temperature, top_k=20)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=20)
    batch = engine.generate(PROMPTS, sampling, spec, seeds=[11, 12, 13])
    for prompt, seed, seq in zip(PROMPTS, [11, 12, 13], batch):
        alone = engine.generate([prompt], sampling, spec, seeds=[seed])[0]
        assert seq.generated == alone.generated


def test_seeded_sampling_is_deterministic_and_seeds_matter(greedy_pair):
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    sampling = SamplingConfig(temperature=1.0)
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=30)
    a = engine.generate([PROMPTS[0]], sampling, spec, seeds=5)[0].generated
    b = engine.generate([PROMPTS[0]], sampling, spec, seeds=5)[0].generated
    c = engine.generate([PROMPTS[0]], sampling, spec, seeds=6)[0].generated
    assert a == b and a != c


@pytest.mark.parametrize("K", [2, 5])
def test_eos_inside_a_draft_stops_exactly_there(greedy_pair, K):
    target, _ = greedy_pair
    reference = hf_greedy(target, PROMPTS[1], 30)
    eos = reference[6]
    first = reference.index(eos)
    # With the target as its own draft every draft is accepted, so EOS arrives mid-draft.
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(target), 64), {eos})
    seq = engine.generate([PROMPTS[1]], GREEDY, SpecConfig(num_draft_tokens=K, max_new_tokens=30))[0]
    assert seq.generated == reference[: first + 1] and seq.finish_reason == "eos"
    drafts_accepted([seq])
    assert seq.generated == hf_greedy(target, PROMPTS[1], 30, eos=eos)


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_is_never_exceeded(greedy_pair, max_new):
    target, _ = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(target), 64), set())
    for seq in engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=max_new)):
        assert seq.num_generated == max_new and seq.finish_reason == "length"


def test_stop_strings_end_the_text_before_the_match(greedy_pair):
    target, _ = greedy_pair
    decode = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    reference = hf_greedy(target, PROMPTS[0], 30)
    stop = decode(reference)[20:22]  # after the output starts repeating itself, so prompt lookup drafts
    engine = SpeculativeEngine(ModelRunner(target), PromptLookupDrafter(), set(), decode=decode)
    seq = engine.generate([PROMPTS[0]], GREEDY, SpecConfig(max_new_tokens=30, stop=(stop,)))[0]
    drafts_accepted([seq])
    text = decode(seq.generated)[: seq.text_end]
    assert seq.finish_reason == "stop"
    assert text == decode(reference)[: decode(reference).find(stop)]
    assert seq.generated == reference[: len(seq.generated)]
    assert stop in decode(seq.generated) and stop not in decode(seq.generated[:-1])


def test_context_window_limits(greedy_pair):
    target, _ = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), PromptLookupDrafter(), set())
    with pytest.raises(VerispecError, match="context window"):
        engine.generate([list(range(1, 60)) * 3], GREEDY, SpecConfig())
    with pytest.raises(VerispecError, match="empty"):
        engine.generate([[]], GREEDY, SpecConfig())
    with pytest.raises(VerispecError, match="outside the vocabulary"):
        engine.generate([[1, 999]], GREEDY, SpecConfig())
    seq = engine.generate([list(range(1, 61)) * 2], GREEDY, SpecConfig(max_new_tokens=50))[0]
    assert seq.num_generated == 128 - 120 and seq.finish_reason == "length"


def test_prompt_lookup_finds_the_latest_longest_match():
    cfg = PromptLookupConfig(max_ngram=3, min_ngram=1)
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2, cfg) == [8, 7]
    assert lookup([5, 6, 7], 3, cfg) == []
    assert lookup([4, 4, 4], 3, cfg) == [4]
    assert lookup([1, 2, 3, 4, 2, 3], 5, cfg) == [4, 2, 3]
