"""Dynamic draft length (verispec.core.stopping): thresholds from costs, the online calibration,
chains that stop early staying exact (chi-square, greedy equality) and the draft's cache staying
consistent with what it was fed."""

import copy

import pytest
import torch

from conftest import tiny_model
from drafting import drafts_accepted
from test_exactness import THRESHOLD, V, check_distribution, sample_tokens
from verispec.config import PromptLookupConfig, SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import MAX_MATCH, PromptLookupDrafter, lookup_match
from verispec.core.stopping import COPY_PRIOR, AcceptanceCalibration, DraftStop, chain_length
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.tuning import KTuner, CostProfile

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


def test_thresholds_from_costs_are_the_marginal_costs_of_each_token():
    # A target pass over 1, 2, 3, 4 tokens costs 1, 1.5, 1.7, 2.5 one-token passes; a draft token 0.1.
    stop = DraftStop.from_costs(0.1, (1.0, 1.5, 1.7, 2.5))
    assert stop.keep == pytest.approx((0.5, 0.2, 0.8))  # widening the pass for x_1, x_2, x_3
    assert stop.go_on == pytest.approx((0.3, 0.9, 0.9))  # a draft pass plus the next token's widening
    assert stop.keep_at(1) == pytest.approx(0.5) and stop.keep_at(7) == pytest.approx(0.8)  # past the end: the last
    assert stop.go_on_at(9) == pytest.approx(0.9)
    assert DraftStop.fixed(0.4).keep_at(3) == DraftStop.fixed(0.4).go_on_at(1) == 0.4


def test_the_calibration_starts_at_its_prior_and_learns_only_from_tested_tokens():
    cal = AcceptanceCalibration(prior_weight=4.0)
    sure, unsure, copied = cal.model_key(0.97, True), cal.model_key(0.12, True), cal.copy_key(2, True)
    assert cal.estimate(sure) == pytest.approx(0.95) and cal.estimate(unsure) == pytest.approx(0.15)
    assert cal.estimate(copied) == pytest.approx(COPY_PRIOR)
    assert cal.model_key(1.0, True) == sure  # q = 1 falls in the top bin
    assert cal.model_key(0.5, False) != cal.model_key(0.5, True)  # greedy and sampled counts apart
    # x_1 accepted, x_2 rejected: x_3 (drafted after it) was never tested and must not count.
    cal.observe([unsure, copied, sure], num_accepted=1)
    assert cal.counts[unsure] == [1.0, 1.0] and cal.counts[copied] == [0.0, 1.0] and sure not in cal.counts
    for _ in range(40):
        cal.observe([sure], num_accepted=0)
    assert cal.estimate(sure) < 0.1  # the draft was sure and wrong every time


def test_draft_stop_is_a_probability():
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(VerispecError, match="draft_stop"):
            SpecConfig(draft_stop=bad)


class CheckedDrafter(DraftModelDrafter):
    """Checks at every step that a stopped chain is a prefix of the chain the same draft proposes from
    a fresh cache (a stale or short cache would change the draft's tokens), and that the cache holds
    exactly the tokens the drafter counts."""

    def __init__(self, runner, vocab, **kwargs):
        super().__init__(runner, vocab, **kwargs)
        self.steps = self.stopped = 0

    def propose(self, sequences, max_tokens, trees=None):
        drafts = super().propose(sequences, max_tokens, trees)
        reference = DraftModelDrafter(self.runner, self.target_vocab_size, lookup=self.lookup)
        plain = [copy.copy(s) for s in sequences]
        for s in plain:
            s.draft_stop = None
        reference.start(plain)
        full = reference.propose(plain, max_tokens)
        for d, f, n in zip(drafts, full, max_tokens):
            assert d.tokens.tolist() == f.tokens[: len(d)].tolist()
            self.steps += 1
            self.stopped += int(len(d) < n)
        # the cache holds the committed tokens, then the drafts fed back to it (uncommitted nodes until `commit`)
        assert [n + fed for n, fed in zip(self.state.lengths.tolist(), self.fed)] == self.cached
        return drafts

    def commit(self, sequences, drafts, paths):
        super().commit(sequences, drafts, paths)
        assert self.state.lengths.tolist() == self.cached
        assert all(c < len(s.tokens) for c, s in zip(self.cached, sequences))  # behind by what it reads next


@pytest.mark.parametrize("lookup", [None, PromptLookupConfig(max_ngram=3, min_ngram=1)])
@pytest.mark.parametrize("threshold", [0.3, 0.7])
def test_stopped_chains_stay_greedy_equal_and_keep_the_cache_consistent(greedy_pair, lookup, threshold):
    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24))]
    drafter = CheckedDrafter(ModelRunner(draft), 64, lookup=lookup)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=24, draft_stop=threshold))
    assert [s.generated for s in seqs] == expected
    assert 0 < drafter.stopped < drafter.steps  # some chains stopped early, some ran their K
    drafts_accepted(seqs)


def test_an_auto_tuner_stops_chains_from_its_cost_profile(greedy_pair):
    """With costs where a second verified token is dear, the tuned chains stop early; output unchanged."""
    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24))]
    profile = CostProfile({1: 1.0, 2: 1.3, 3: 1.9, 4: 2.6, 5: 3.4}, draft_token=0.05)
    results = {}
    for stop in (False, True):
        drafter = CheckedDrafter(ModelRunner(draft), 64)
        drafter.calibration = AcceptanceCalibration(min_observations=0)  # 72 tokens are too few to leave exploring
        engine = SpeculativeEngine(ModelRunner(target), drafter, set())
        tuner = KTuner(profile, prior=0.9, stop_drafts=stop, learn_costs=False)  # these costs, not this CPU's
        # one row at a time: the profile is a single row's (a batch's pass over rows x (K + 1) tokens costs more)
        seqs = [engine.generate([p], GREEDY, SpecConfig(max_new_tokens=24), tuner=tuner)[0] for p in PROMPTS]
        assert [s.generated for s in seqs] == expected
        results[stop] = (drafter.stopped, drafts_accepted(seqs)[0])
    assert results[False][0] == 0 < results[True][0]
    assert results[True][1] < results[False][1]


@pytest.fixture(scope="module")
def chi_target():
    return tiny_model("qwen2", vocab=V, seed=3, sharpness=4.0)


@pytest.mark.parametrize("threshold", [0.2, 0.6])
@pytest.mark.parametrize("lookup", [None, PromptLookupConfig(max_ngram=2, min_ngram=1)])
def test_stopped_chains_keep_the_target_distribution(chi_target, sampling_pair, threshold, lookup):
    """Seeded chi-square: chains that stop where the calibrated confidence falls (their length depends on the
    draft's samples and on earlier steps' outcomes, never on this step's verification) sample from p."""
    sampling = SamplingConfig(temperature=1.0, top_k=6)
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V, lookup=lookup)
    engine = SpeculativeEngine(ModelRunner(chi_target), drafter, set())
    samples, seqs = _sample_with_stop(engine, sampling, 3, threshold)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    passes = sum(s.stats.target_forward_passes for s in seqs)
    assert 0 < drafted < 3 * passes  # chains stop early (without the rule each is K = 3 long), yet still draft
    assert 0 < sum(s.stats.accepted_tokens for s in seqs) < drafted
    assert drafter.calibration.counts  # the estimates learned from outcomes while sampling
    for fit in check_distribution(chi_target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def _sample_with_stop(engine, sampling, K, threshold, n=3000):
    spec = SpecConfig(num_draft_tokens=K, max_new_tokens=K + 1, stop_at_eos=False, draft_stop=threshold)
    seqs = engine.generate([[1, 5, 2, 6, 1, 5, 2]] * n, sampling, spec, seeds=0)
    return [tuple(s.generated[:3]) for s in seqs], seqs


def test_a_stop_rule_that_peeks_at_the_target_is_caught(chi_target, sampling_pair, monkeypatch):
    """Negative control: a chain cut where the target would reject (a rule that reads this step's verification,
    which the real one never does) biases the output, and the same chi-square check catches it."""
    sampling = SamplingConfig(temperature=1.0, top_k=6)
    target_runner = ModelRunner(chi_target)
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V)
    engine = SpeculativeEngine(target_runner, drafter, set())
    propose = drafter.propose

    def peeking(sequences, max_tokens, trees=None):
        drafts = propose(sequences, max_tokens, trees)
        out = []
        for seq, d in zip(sequences, drafts):
            if len(d):
                with torch.no_grad():
                    logits = chi_target(torch.tensor([seq.tokens + d.tokens.tolist()])).logits[0, len(seq.tokens) - 1]
                p = torch.softmax(logits.float(), -1)
                if d.q is not None and float(p[d.tokens[0]]) < float(d.q[0, d.tokens[0]]):  # x_1 might be rejected
                    d = type(d)(d.tokens[:0], None)  # ... so propose nothing: the target samples x_1 from p alone
            out.append(d)
        return out

    monkeypatch.setattr(drafter, "propose", peeking)
    monkeypatch.setattr(drafter, "commit", lambda *a: drafter.start(a[0]))  # read each step's context afresh
    samples, _ = sample_tokens(engine, sampling, 1)
    assert min(fit.p_value for fit in check_distribution(chi_target, samples, sampling)) < THRESHOLD


def test_prompt_lookup_chains_stop_by_match_length_and_stay_greedy_equal(greedy_pair):
    target, _ = greedy_pair
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8], [3]]
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(prompts, GREEDY, SpecConfig(max_new_tokens=24))]
    drafted = {}
    for stop in (0.0, 0.3):
        drafter = PromptLookupDrafter()
        drafter.calibration = AcceptanceCalibration(min_observations=0)
        engine = SpeculativeEngine(ModelRunner(target), drafter, set())
        seqs = engine.generate(prompts, GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=24, draft_stop=stop))
        assert [s.generated for s in seqs] == expected
        drafted[stop] = drafts_accepted(seqs)[0]
        assert bool(drafter.calibration.counts) == (stop > 0)
    # At the prior (0.35 a copy) a chain's second token has P_2 = 0.12 < 0.3: copies stop after one token
    # until a match length has shown it is accepted more often.
    assert 0 < drafted[0.3] < drafted[0.0]
    keys = [AcceptanceCalibration.copy_key(n, True) for n in (1, 2, 3)]
    assert chain_length(keys, DraftStop.fixed(0.3), AcceptanceCalibration(min_observations=0)) == 1
    assert chain_length(keys, DraftStop.fixed(0.4), AcceptanceCalibration(min_observations=0)) == 0
    assert chain_length(keys, DraftStop.fixed(0.4), AcceptanceCalibration()) == 1  # explored: then P_1 < 0.4 stops


@pytest.mark.parametrize("threshold", [0.1, 0.3])
def test_stopped_prompt_lookup_chains_keep_the_target_distribution(chi_target, threshold):
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    engine = SpeculativeEngine(ModelRunner(chi_target), PromptLookupDrafter(), set())
    samples, seqs = _sample_with_stop(engine, sampling, 3, threshold)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    assert 0 < drafted < 3 * sum(s.stats.target_forward_passes for s in seqs)
    for fit in check_distribution(chi_target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_a_fixed_threshold_applies_under_an_auto_tuner_without_cost_thresholds(greedy_pair):
    """--auto-k --draft-stop P: the tuner picks K, the chains stop at P; output unchanged."""
    target, draft = greedy_pair
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24))]
    drafter = CheckedDrafter(ModelRunner(draft), 64)
    drafter.calibration = AcceptanceCalibration(min_observations=0)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    tuner = KTuner(CostProfile({w: 1.0 for w in range(1, 6)}, draft_token=0.01), prior=0.9, learn_costs=False)
    assert tuner.draft_stop() is None  # cost thresholds are opt-in
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24, draft_stop=0.5), tuner=tuner)
    assert [s.generated for s in seqs] == expected
    assert 0 < drafter.stopped < drafter.steps
    drafts_accepted(seqs)


def test_a_copy_is_keyed_by_the_length_of_its_verbatim_match():
    """lookup_match counts the match past the n-gram that found it (up to MAX_MATCH), and the copy keys
    bin that length: a copy after a long verbatim quote is calibrated apart from one after a repeated bigram."""
    config = PromptLookupConfig(max_ngram=3, min_ngram=1)
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6]
    assert lookup_match(tokens, 2, config) == ([7, 8], 6)  # found by (4, 5, 6), matched back to the 1
    assert lookup_match([5, 1, 2, 7, 1, 2], 3, config) == ([7, 1, 2], 2)
    assert lookup_match([1, 2, 3], 2, config) == ([], 0)
    quote = list(range(10, 60))
    assert lookup_match(quote + [0] + quote, 1, config)[1] == MAX_MATCH == 32
    key = AcceptanceCalibration.copy_key
    assert key(1, True) != key(2, True) != key(3, True) and key(4, True) == key(5, True) != key(6, True)
    assert key(32, True) == key(100, True) != key(24, True) and key(12, False) != key(12, True)


def test_a_free_drafter_under_cost_thresholds_is_gated_by_its_own_calibration(greedy_pair):
    """KTuner(stop_drafts=True) with prompt lookup: where the average copy does not pay (K would be 0),
    copies after matches whose calibrated acceptance pays are still proposed; output unchanged."""
    steep = CostProfile({1: 1.0, 2: 1.8, 3: 2.6, 4: 3.4, 5: 4.2}, draft_token=0.0)
    tuner = KTuner(steep, prior=0.3, stop_drafts=True, learn_costs=False)
    assert tuner.k(stops_chains=True) == 4 and tuner.k() == 0  # a drafter that ignores the rule stays gated
    assert KTuner(CostProfile(steep.target_pass, draft_token=0.1), prior=0.3, stop_drafts=True).k(True) == 0
    target, _ = greedy_pair
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [20, 21, 22, 23, 24, 25] * 4]
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(prompts, GREEDY, SpecConfig(max_new_tokens=24))]
    drafted = {}
    for stop in (False, True):
        drafter = PromptLookupDrafter()
        engine = SpeculativeEngine(ModelRunner(target), drafter, set())
        seqs = engine.generate(prompts, GREEDY, SpecConfig(max_new_tokens=24),
                               tuner=KTuner(steep, prior=0.3, stop_drafts=stop, learn_costs=False))
        assert [s.generated for s in seqs] == expected
        drafted[stop] = drafts_accepted(seqs)[0]
        assert bool(drafter.calibration.counts) == stop
    assert drafted[True] > drafted[False]
