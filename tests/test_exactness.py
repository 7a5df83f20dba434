"""Layer 2 on tiny models: seeded chi-square tests that speculative sampling's output has the
target's distribution, for chains with K in {1, 3, 8}, under temperature, top-k, top-p, min-p and
repetition penalty, with q == p, q disjoint from p, and a deterministic (one-hot) drafter.

Each test samples N sequences of K + 1 new tokens in one ragged batch, then compares
  - the joint distribution of the first two tokens with the exact p(t1) p(t2 | t1), and
  - the third token's distribution after the most frequent (t1, t2), with p(t3 | t1, t2).
The last test shows the same check catches a wrong verification rule.
"""

from collections import Counter

import pytest
import torch

from conftest import tiny_model
from verispec import rejection
from verispec.chisquare import chi_square_test
from verispec.config import SamplingConfig, SpecConfig
from verispec.core.drafter import Draft, Drafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runners.hf import ModelRunner
from verispec.sampling import Processors, logits_to_probs

V = 8
PROMPT = [1, 5, 2, 6, 1, 5, 2]
N = 3000
THRESHOLD = 1e-4


def exact_next(model, context, sampling):
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1:].float()  # (1, V)
    seen = Processors(sampling, len(PROMPT)).seen(context, V)  # every context here starts with PROMPT
    return logits_to_probs(logits, sampling, seen)[0].double()  # (V,)


class DisjointDrafter(Drafter):
    """Proposes from q uniform on the tokens the target's processed p gives zero mass: p, q disjoint."""

    def __init__(self, target, sampling):
        self.target, self.sampling = target, sampling

    def propose(self, sequences, depths, trees=None):
        drafts = []
        for seq, n in zip(sequences, depths):
            tokens, qs = [], []
            for _ in range(n):
                p = exact_next(self.target, seq.tokens + tokens, self.sampling)
                q = (p == 0).float()
                q = q / q.sum()
                tokens.append(int(torch.multinomial(q, 1, generator=seq.rng)))
                qs.append(q)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs) if qs else None))
        return drafts


def sample_tokens(engine, sampling, K, n=N, seed=0):
    spec = SpecConfig(num_draft_tokens=K, max_new_tokens=max(3, K + 1), stop_at_eos=False)
    seqs = engine.generate([PROMPT] * n, sampling, spec, seeds=seed)
    return [tuple(s.generated[:3]) for s in seqs], seqs


def check_distribution(target, samples, sampling):
    p1 = exact_next(target, PROMPT, sampling)
    p2 = torch.stack([exact_next(target, PROMPT + [t], sampling) for t in range(V)])  # (V, V)
    joint = (p1[:, None] * p2).flatten()  # (V*V,)
    counts = torch.zeros(V * V)
    for t1, t2, _ in samples:
        counts[t1 * V + t2] += 1
    fits = [chi_square_test(counts, joint)]
    (t1, t2), _ = Counter((a, b) for a, b, _ in samples).most_common(1)[0]
    third = torch.zeros(V)
    for a, b, c in samples:
        if (a, b) == (t1, t2):
            third[c] += 1
    fits.append(chi_square_test(third, exact_next(target, PROMPT + [t1, t2], sampling)))
    return fits


SETTINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=4),
    SamplingConfig(temperature=1.2, top_p=0.7),
    SamplingConfig(temperature=1.0, min_p=0.15),
    SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.5),
    SamplingConfig(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, logit_bias=((3, 1.5), (6, -2.0))),
]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", vocab=V, seed=3, sharpness=4.0)


@pytest.fixture(scope="module")
def draft(sampling_pair):
    return sampling_pair[1]


@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}-r{s.repetition_penalty}"
                         f"-pres{s.presence_penalty}-freq{s.frequency_penalty}-bias{len(s.logit_bias)}")
def test_draft_model_chain_matches_target_distribution(target, draft, K, sampling):
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), V), set())
    samples, seqs = sample_tokens(engine, sampling, K)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    accepted = sum(s.stats.accepted_tokens for s in seqs)
    assert 0 < accepted < drafted  # both the accept and the recover paths ran
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_a_draft_reading_only_the_prompt_tail_stays_exact(target, draft):
    """A draft that skips most of the prompt (`context`) proposes differently; the output does not change."""
    sampling = SamplingConfig(temperature=1.0)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), V, context=2), set())
    samples, seqs = sample_tokens(engine, sampling, 3)
    assert 0 < sum(s.stats.accepted_tokens for s in seqs) < sum(s.stats.draft_tokens for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


@pytest.mark.parametrize("K", [1, 3, 8])
def test_q_equal_to_p_accepts_everything_and_stays_exact(target, K):
    sampling = SamplingConfig(temperature=1.0, top_k=5)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(target), V), set())
    samples, seqs = sample_tokens(engine, sampling, K)
    assert all(s.stats.accepted_tokens == s.stats.draft_tokens for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


@pytest.mark.parametrize("K", [1, 3])
def test_q_disjoint_from_p_rejects_everything_and_stays_exact(target, K):
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    engine = SpeculativeEngine(ModelRunner(target), DisjointDrafter(target, sampling), set())
    samples, seqs = sample_tokens(engine, sampling, K, n=2000)
    assert sum(s.stats.accepted_tokens for s in seqs) == 0
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


@pytest.mark.parametrize("K", [1, 3, 8])
def test_one_hot_prompt_lookup_drafts_stay_exact(target, K):
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    engine = SpeculativeEngine(ModelRunner(target), PromptLookupDrafter(), set())
    samples, seqs = sample_tokens(engine, sampling, K)
    assert sum(s.stats.accepted_tokens for s in seqs) > 0
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_the_check_catches_a_wrong_residual(target, draft, monkeypatch):
    """Negative control: recovering from p instead of normalize(max(0, p - q)) must fail the test."""
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    sampling = SamplingConfig(temperature=1.0)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), V), set())
    samples, _ = sample_tokens(engine, sampling, 3)
    assert min(fit.p_value for fit in check_distribution(target, samples, sampling)) < THRESHOLD
