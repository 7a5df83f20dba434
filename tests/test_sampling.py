"""The sampling processors match Hugging Face's and validate their settings."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verispec.config import SamplingConfig, SpecConfig
from verispec.errors import VerispecError
from verispec.sampling import (Processors, Seen, greedy_tokens, logits_to_probs, penalise, sample, seen_masks,
                               tree_seen_masks)


def hf_probs(logits, context, cfg):
    procs = LogitsProcessorList()
    if cfg.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    procs.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        procs.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1:
        procs.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p:
        procs.append(MinPLogitsWarper(cfg.min_p))
    return torch.softmax(procs(context[None], logits[None].clone())[0], dim=-1)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=10),
        SamplingConfig(temperature=1.3, top_p=0.8),
        SamplingConfig(temperature=0.9, min_p=0.05),
        SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    ],
)
def test_processing_matches_hugging_face(cfg):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(100, generator=gen) * 3
        context = torch.randint(0, 100, (15,), generator=gen)
        seen = seen_masks(context, torch.zeros(0, dtype=torch.long), 100) if cfg.repetition_penalty != 1 else None
        ours = logits_to_probs(logits[None], cfg, seen)[0]
        torch.testing.assert_close(ours, hf_probs(logits, context, cfg), atol=1e-6, rtol=1e-5)


def test_seen_masks_grow_with_the_continuation():
    masks = seen_masks(torch.tensor([1, 2]), torch.tensor([5, 6]), 8)
    assert masks.shape == (3, 8)
    assert masks[0].nonzero().flatten().tolist() == [1, 2]
    assert masks[1].nonzero().flatten().tolist() == [1, 2, 5]
    assert masks[2].nonzero().flatten().tolist() == [1, 2, 5, 6]


def test_temperature_zero_is_argmax_not_a_small_temperature():
    cfg = SamplingConfig(temperature=0)
    assert cfg.greedy
    logits = torch.tensor([[0.1, 3.0, 2.9999]])
    assert greedy_tokens(logits, cfg).tolist() == [1]
    with pytest.raises(ValueError):
        logits_to_probs(logits, cfg)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_bad_sampling_settings_are_rejected(kwargs, fragment):
    with pytest.raises(VerispecError, match=fragment):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [(dict(num_draft_tokens=0), "K"), (dict(max_new_tokens=0), "max_new_tokens"),
                                              (dict(stop=("",)), "stop")])
def test_bad_spec_settings_are_rejected(kwargs, fragment):
    with pytest.raises(VerispecError, match=fragment):
        SpecConfig(**kwargs)


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1e-40), SamplingConfig(temperature=5e-324),
                                 SamplingConfig(temperature=1e-30, top_p=0.5, min_p=0.5),
                                 SamplingConfig(temperature=1e300, top_k=3),
                                 SamplingConfig(repetition_penalty=1e-300), SamplingConfig(repetition_penalty=1e300)],
                         ids=["T1e-40", "T5e-324", "T1e-30-top-p", "T1e300", "penalty1e-300", "penalty1e300"])
def test_extreme_settings_give_a_distribution_never_nan(cfg):
    """Settings at the edge of float range used to become inf / inf = NaN, and the server's shared step raised for
    every request batched with them; a tiny temperature now gives the argmax, a huge one the uniform."""
    logits = torch.tensor([[2.0, 7.5, -3.0, 7.4, 0.5]])
    seen = torch.tensor([[True, False, True, True, False]])
    probs = logits_to_probs(logits, cfg, seen if cfg.repetition_penalty != 1 else None)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
    if cfg.temperature < 1e-20:
        assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    if cfg.repetition_penalty == 1e-300:  # the seen positive logits dominate: 2.0 and 7.4 both reach float's max
        assert probs[0, [0, 3]].sum() == pytest.approx(1.0)
    assert greedy_tokens(logits, SamplingConfig(temperature=0, repetition_penalty=cfg.repetition_penalty),
                         seen).numel() == 1


def test_nan_logits_are_refused_not_sampled():
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(torch.tensor([[0.0, float("nan")]]), SamplingConfig())
    with pytest.raises(ValueError, match="NaN"):
        greedy_tokens(torch.tensor([[0.0, float("nan")]]), SamplingConfig(temperature=0))


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0), SamplingConfig(temperature=0, repetition_penalty=1.3),
                                    SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.2),
                                    SamplingConfig(temperature=1.0, min_p=0.05),
                                    SamplingConfig(temperature=0.9, presence_penalty=0.8, frequency_penalty=-0.5,
                                                   logit_bias=((3, 2.0), (4, -100.0))),
                                    SamplingConfig(temperature=0, frequency_penalty=1.5)])
def test_a_sequences_processor_chain_is_the_functions_it_is_built_from(config):
    """`Processors` (the chain the verifier and the drafters call) gives what the functions give: the seen-masks and
    the answer's counts, the target's argmax or p, and a draft's argmax or its q and the draw from it with the same
    generator."""
    chain, vocab = Processors(config, prompt_len=2), 32
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen)  # (N + 1, V)
    context, drafts = [1, 2, 5, 2], torch.tensor([7, 1, 9])
    seen = chain.seen_rows(context, drafts, None, vocab)
    if config.repetition_penalty == 1.0 and not (config.presence_penalty or config.frequency_penalty):
        assert seen is None and chain.seen(context, vocab) is None
    else:
        tree = chain.seen_rows(context, drafts, torch.tensor([-1, 0, 0]), vocab)
        if config.repetition_penalty != 1.0:
            assert torch.equal(seen.mask, seen_masks(torch.tensor(context), drafts, vocab))
            assert torch.equal(chain.seen(context + [7], vocab).mask[0], seen.mask[1])
            assert torch.equal(tree.mask, tree_seen_masks(torch.tensor(context), drafts, torch.tensor([-1, 0, 0]), vocab))
        else:  # the answer is context[2:] = [5, 2], then the drafts on the row's path
            assert seen.counts[0, 2] == 1 and seen.counts[0, 1] == 0 and seen.counts[3, 1] == 1 and seen.counts[3, 7] == 1
            assert torch.equal(chain.seen(context + [7], vocab).counts[0], seen.counts[1])
            assert tree.counts[3, 1] == 0 and tree.counts[3, 7] == 1  # node 2's path is 7, 9: not 1
    expected = greedy_tokens(logits, config, seen) if config.greedy else logits_to_probs(logits, config, seen)
    expected = greedy_tokens(logits, config, seen) if config.greedy else logits_to_probs(logits, config, seen)
    assert torch.equal(chain.target(logits, seen), expected)
    row_seen = None if seen is None else seen[:1]
    token, q = chain.draw(logits[:1], row_seen, torch.Generator().manual_seed(11))
    if config.greedy:
        assert q is None and token == int(greedy_tokens(logits[:1], config, row_seen)[0]) == chain.propose(logits[:1], row_seen)[0]
    else:
        assert torch.equal(q, logits_to_probs(logits[:1], config, row_seen)[0])
        assert token == sample(q, torch.Generator().manual_seed(11))


def test_presence_frequency_and_bias_change_the_logits_as_openai_defines_them():
    config = SamplingConfig(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 1.0})
    logits = torch.zeros(1, 6)
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    out = penalise(logits, config, Seen(counts=counts))
    assert out.tolist() == [[0.0, -1.0, -0.75, 1.0, 0.0, 0.0]]  # - 0.25 * count - 0.5 * present, + bias
    assert penalise(torch.zeros(1, 3), config, None).tolist() == [[0.0, 0.0, 0.0]]  # a bias past a draft's vocabulary
    with pytest.raises(VerispecError, match="presence_penalty"):
        SamplingConfig(presence_penalty=2.5)
    with pytest.raises(VerispecError, match="logit_bias"):
        SamplingConfig(logit_bias={1: 101})


def _nucleus_cases():
    """Rows of probabilities over a large vocabulary: peaked, moderate, nearly flat (sorted whole), ties straddling
    the cut, a one-hot row, a row of two, zeros, and subnormal tails."""
    gen = torch.Generator().manual_seed(5)
    vocab = 20_000
    rows = []
    for temperature in (0.3, 0.7, 1.0, 4.0):
        logits = torch.randn(3, vocab, generator=gen) * 3
        logits[:, :40] += 8  # a few likely tokens, a long tail
        logits[1, 100:300] = logits[1, 60]  # 200 tokens tied at one value
        rows.append(torch.softmax(logits / temperature, -1))
    ties = torch.softmax(torch.randn(2, vocab, generator=gen).round() * 4, -1)  # many ties everywhere
    flat = torch.full((1, vocab), 1.0 / vocab)
    few = torch.zeros(2, vocab)
    few[0, 5] = 1.0
    few[1, [7, 9]] = 0.5
    tiny = torch.softmax(torch.randn(1, vocab, generator=gen) * 40, -1)  # most of the vocabulary subnormal or 0
    return torch.cat([*rows, ties, flat, few, tiny])


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 0.9999999])
def test_nucleus_filter_gives_the_whole_sorts_bits(top_p):
    from verispec.sampling import top_p_filter, top_p_sorted
    probs = _nucleus_cases()  # (N, V)
    fast, whole = top_p_filter(probs, top_p), top_p_sorted(probs, top_p)
    assert torch.equal(fast, whole)
    assert (fast[:, :1] >= 0).all() and ((fast > 0).sum(1) >= 1).all()  # the most likely token always stays


def test_nucleus_filter_lowers_its_floor_where_the_bins_sums_fall_short(monkeypatch):
    """The bins' sums are only a first guess at where the cut lies; a guess too high (here: every bin's mass made
    to look larger) is corrected by taking more candidates, to the same bits."""
    from verispec import sampling
    probs = _nucleus_cases()
    real = torch.bincount
    monkeypatch.setattr(sampling.torch, "bincount",
                        lambda x, weights=None, minlength=0: real(x, weights, minlength) * (64.0 if weights is not None else 1))
    assert torch.equal(sampling.top_p_filter(probs, 0.9), sampling.top_p_sorted(probs, 0.9))


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9),
                                 SamplingConfig(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05)])
def test_a_rows_probabilities_are_the_same_bits_alone_among_others_and_on_any_thread_count(cfg):
    """Verification makes p one row at a time and checks it against the whole pass's; torch's sum of one row splits
    it between threads (its last bit moved with two), which `row_sums` does not."""
    from verispec.sampling import row_sums
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 151_936, generator=gen) * 4  # (N, V) Qwen's vocabulary: 148 blocks and a tail
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = logits_to_probs(logits, cfg)  # (N, V)
            for i in range(logits.shape[0]):
                assert torch.equal(logits_to_probs(logits[i : i + 1], cfg)[0], together[i])
            if n == 1:
                one_thread = together
        assert torch.equal(together, one_thread)
        probs = torch.softmax(logits[:1], -1)
        torch.set_num_threads(2)
        assert torch.equal(row_sums(probs), row_sums(torch.cat([probs, probs]))[:1])
    finally:
        torch.set_num_threads(threads)
