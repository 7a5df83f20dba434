"""Costs measured while decoding (`verispec.tuning.PassClock`, `KTuner.costs`): a busy moment at start or a
busy second later does not stick, and a batch's speculation shrinks as its plain pass fills the machine. No timing
here: the seconds are given."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runners.hf import ModelRunner
from verispec.tuning import Acceptance, KTuner, CostProfile, PassClock, expected_tokens, measure_costs

FLAT = CostProfile({w: 1.0 + 0.05 * (w - 1) for w in range(1, 10)}, 0.1)  # a GPU-like v(k), a cheap draft


def test_the_clock_learns_each_width_and_scales_the_rest_by_the_median_ratio():
    clock = PassClock(FLAT)
    assert clock.cost(3) == FLAT.target_pass[3] and clock.cost(18) == FLAT.target_pass[9] * 2  # beyond: per token
    for _ in range(3):
        clock.observe(1, 2.0)  # the machine is twice as slow as at start
    assert clock.cost(1) == 2.0
    assert clock.cost(2) == FLAT.target_pass[2] * 2.0  # not observed: the start figure times the median ratio
    for _ in range(8):
        clock.observe(2, 1.0)
    clock.observe(2, 50.0)  # one busy moment among nine passes
    assert clock.cost(2) == 1.0


def test_a_draft_measured_slow_at_start_is_switched_back_on_by_what_decoding_measures():
    busy = CostProfile(FLAT.target_pass, 2.0)  # the draft's cost measured in a busy moment: twice a target pass
    tuner = KTuner(busy, prior=0.8, prior_weight=100.0)
    assert tuner.k() == 0  # speculation does not pay at that cost
    for _ in range(3):
        tuner.observe_draft(4, 0.4)  # what it really costs: 0.1 s a position
    assert tuner.k() > 0 and abs(tuner.costs().c - 0.1) < 1e-9
    fixed = KTuner(busy, prior=0.8, prior_weight=100.0, learn_costs=False)
    fixed.observe_draft(4, 0.4)
    assert fixed.k() == 0  # a profile given to keep is kept


def test_a_batch_speculates_less_as_its_plain_pass_fills_the_machine():
    tuner = KTuner(CostProfile({w: 1.0 + 0.05 * (w - 1) for w in range(1, 6)}, 0.0), prior=0.6,
                      prior_weight=100.0)
    assert tuner.k(rows=1) == 4
    for tokens in range(8, 41):  # eight rows: a pass costs its tokens (the machine is compute bound at 8)
        for _ in range(3):
            tuner.observe_pass(tokens, tokens / 8)
    assert tuner.costs(rows=8).v(1) == 2.0  # two tokens a row cost twice one
    assert tuner.k(rows=8) == 0 and tuner.k(rows=1) == 4  # one row alone still has the cheap wide pass


def test_decoding_with_the_tuner_feeds_it_and_keeps_plain_decodings_tokens():
    model = tiny_model("llama", vocab=32, seed=2, layers=2, sharpness=20.0)
    runner = ModelRunner(model)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 6]]
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
    greedy = SamplingConfig(temperature=0)
    plain = [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, greedy, spec)]
    tuner = KTuner(measure_costs(runner, None, k_max=3, context=8, repeats=1))
    out = SpeculativeEngine(runner, PromptLookupDrafter(), set()).generate(prompts, greedy, spec, tuner=tuner)
    assert [s.generated for s in out] == plain
    assert sum(len(v) for v in tuner.clock.samples.values()) >= 8  # every decoding pass was timed
    assert max(tuner.clock.samples) >= 2  # a pass of both rows counts the tokens of both


def test_a_sequence_that_names_its_k_keeps_it_beside_tuned_ones():
    from verispec.batch import DecodeBatch

    model = tiny_model("llama", vocab=32, seed=2, layers=2, sharpness=20.0)
    runner = ModelRunner(model)
    engine = SpeculativeEngine(runner, PromptLookupDrafter(), set())
    never = KTuner(CostProfile({w: float(w) for w in range(1, 5)}, 0.0), prior=0.5, prior_weight=1000.0,
                      probe_every=1000, probe_max=1000, learn_costs=False)  # each token costs a pass: K = 0
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
    seqs = engine.make_sequences([[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2]], SamplingConfig(temperature=0),
                                 spec, [0, 1])
    seqs[1].tuned = False  # its request named K = 3
    batch = DecodeBatch(engine, never)
    batch.add(seqs)
    while len(batch):
        engine.step(batch)
    assert seqs[0].stats.draft_tokens == 0 < seqs[1].stats.draft_tokens
    assert seqs[0].generated == seqs[1].generated  # the same prompt: the same tokens either way


def test_cost_profiles_are_measured_once_per_key_and_kept(tmp_path):
    from verispec.tuning import CostProfile, cached_costs

    calls = []

    def measure():
        calls.append(1)
        return CostProfile({1: 0.05, 2: 0.06, 3: 0.08}, 0.01)

    first = cached_costs("target|threads=2|cpu=x", measure, tmp_path)
    again = cached_costs("target|threads=2|cpu=x", measure, tmp_path)
    assert again == first and len(calls) == 1  # read back, not measured again
    cached_costs("target|threads=4|cpu=x", measure, tmp_path)
    assert len(calls) == 2  # another key: measured
    for path in tmp_path.iterdir():
        path.write_text("{not json")
    assert cached_costs("target|threads=2|cpu=x", measure, tmp_path) == first and len(calls) == 3  # unreadable


def test_generate_tunes_k_by_default_unless_k_a_static_tree_or_a_seeded_sample_is_asked_for():
    import argparse

    from verispec.cli.generate import default_auto_k
    from verispec.config import SamplingConfig, TreeConfig

    args = lambda **kw: argparse.Namespace(**{"num_draft_tokens": None, "seed": None, **kw})  # noqa: E731
    greedy, sampled = SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7)
    assert default_auto_k(args(), sampled, None) and default_auto_k(args(seed=3), greedy, None)
    assert default_auto_k(args(), greedy, TreeConfig(budget=8))
    assert not default_auto_k(args(num_draft_tokens=4), greedy, None)
    assert not default_auto_k(args(), greedy, TreeConfig(shape=(2, 1)))
    assert not default_auto_k(args(seed=3), sampled, None)


def test_a_draft_model_reads_the_prompt_in_the_first_step_even_when_the_tuner_drafts_nothing():
    """Otherwise the first probe would read the whole prompt after the first output (measured: 0.57x plain decoding
    on long retrieval prompts with the 0.5B draft and --auto-k)."""
    from conftest import noisy_copy
    from verispec.drafters.draft_model import DraftModelDrafter

    model = tiny_model("llama", vocab=16, seed=1, layers=2)
    drafter = DraftModelDrafter(ModelRunner(noisy_copy(model, 0.3, seed=2)), 16)
    engine = SpeculativeEngine(ModelRunner(model), drafter, set())
    off = KTuner(CostProfile({1: 1.0, 2: 2.0, 3: 3.0}, 5.0), learn_costs=False)  # drafting never pays
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    read = []
    original = drafter.propose

    def propose(sequences, depths, trees=None):
        out = original(sequences, depths, trees)
        read.append((list(depths), list(drafter.cached)))
        return out

    drafter.propose = propose
    engine.generate([prompt], SamplingConfig(temperature=0), SpecConfig(max_new_tokens=4), tuner=off)
    assert read and read[0] == ([0], [len(prompt)])  # the first step: nothing drafted, the prompt read
    assert len(read) == 1  # and no further calls while the tuner keeps drafting off


class Scripted(KTuner):
    """A tuner whose K follows a script (one entry per call), recording the steps whose draft seconds it was given."""

    def __init__(self, script):
        super().__init__(CostProfile({w: 1.0 for w in range(1, 6)}, 0.1), learn_costs=False)
        self.script, self.calls, self.timed = list(script), 0, []

    def k(self, stops_chains=False, rows=1):
        self.calls += 1
        return self.script[min(self.calls, len(self.script)) - 1]

    def observe_draft(self, positions, seconds):
        self.timed.append(self.calls)


def test_a_drafting_step_is_timed_only_after_a_drafting_step():
    """After a step with speculation off (or in a row's first step) a draft model first reads every token it skipped:
    charged to the step's few positions, that one-off made a cross-tokenizer draft token look 8x its cost and kept
    speculation off for good (measured: 0.99x plain decoding where a fixed K = 4 made 1.16x)."""
    from conftest import noisy_copy
    from verispec.drafters.draft_model import DraftModelDrafter

    model = tiny_model("llama", vocab=16, seed=1, layers=2)
    drafter = DraftModelDrafter(ModelRunner(noisy_copy(model, 0.3, seed=2)), 16)
    engine = SpeculativeEngine(ModelRunner(model), drafter, set())
    tuner = Scripted([2, 2, 0, 0, 1, 2, 2, 0, 1, 0, 1, 1])  # step n drafts script[n - 1] tokens
    spec = SpecConfig(max_new_tokens=40, stop_at_eos=False)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingConfig(temperature=0), spec, tuner=tuner)
    script = tuner.script + [1] * (tuner.calls - len(tuner.script))
    steady = [n for n in range(2, tuner.calls + 1) if script[n - 1] and script[n - 2]]
    assert tuner.timed == steady[: len(tuner.timed)] and len(tuner.timed) >= len(steady) - 1  # (the last may be cut)
    assert 1 not in tuner.timed and 5 not in tuner.timed and 9 not in tuner.timed  # the first step, after off steps


def test_a_draft_that_holds_tokens_back_is_charged_for_them():
    """A cross-tokenizer string draft writes until its text holds K + 1 target tokens: a step costs (K + 1) draft
    positions, so its per-position cost is measured over K + 1 and K = 1 is dearer per token than K = 4."""
    from verispec.tuning import expected_speedup, expected_tokens

    held = CostProfile(FLAT.target_pass, 0.1, draft_extra=1.0)
    assert expected_speedup(0.7, 2, held) == expected_tokens(0.7, 2) / (3 * held.c + held.v(2))
    tuner = KTuner(held)
    for _ in range(3):
        tuner.observe_draft(1, 0.4)  # two draft passes for one position: 0.2 s each
    assert tuner.costs().c == 0.2 and tuner.costs().draft_extra == 1.0
    assert expected_speedup(0.5, 1, tuner.costs()) < expected_speedup(0.5, 1, CostProfile(FLAT.target_pass, 0.2))


def test_a_new_request_starts_from_the_drafters_average_not_the_last_requests_ending():
    tuner = KTuner(FLAT, prior=0.6, prior_weight=4.0)
    for _ in range(60):
        tuner.observe(4, 4)  # a request the draft follows well
    for _ in range(100):
        tuner.observe(4, 0)  # and one whose ending it cannot follow: speculation goes off
    for _ in range(200):
        tuner.k()  # probes are spaced out while it stays off
        if tuner.probing:
            tuner.observe(1, 0)
    assert tuner.acceptance.best_k(tuner.costs()) == 0 and tuner.probe_gap == tuner.probe_max
    probes = tuner.acceptance.first.total_rejections - 100  # each rejected
    tuner.restart()
    assert tuner.first_alpha == pytest.approx((0.6 * 4 + 60) / (4 + 60 + 100 + probes))
    assert tuner.alpha == pytest.approx((0.6 * 4 + 180) / (4 + 180))  # after an accepted first, always accepted
    assert tuner.k() > 0 and tuner.probe_gap == tuner.probe_every
    bad = KTuner(FLAT, prior=0.6, prior_weight=4.0)
    for _ in range(200):
        bad.observe(4, 0)
    bad.restart()
    assert bad.first_alpha < 0.05 and bad.k() == 0  # a draft that is never right stays off


def test_each_fresh_batch_restarts_the_tuner():
    model = tiny_model("llama", vocab=32, seed=2, layers=2, sharpness=20.0)
    runner = ModelRunner(model)
    tuner = KTuner(measure_costs(runner, None, k_max=3, context=8, repeats=1))
    restarts = []
    tuner.restart = lambda: restarts.append(1)
    engine = SpeculativeEngine(runner, PromptLookupDrafter(), set())
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=4, stop_at_eos=False)
    for prompt in ([1, 2, 3, 1, 2, 3], [5, 6, 5, 6]):
        engine.generate([prompt], SamplingConfig(temperature=0), spec, tuner=tuner)
    assert len(restarts) == 2


def test_two_rates_give_the_mean_tokens_of_chains_and_are_recovered_from_them():
    """A chain's first draft accepted at rate alpha_1, each later one at alpha given the one before: the mean tokens a
    step yields is expected_tokens(alpha, K, alpha_1), and `Acceptance` recovers both rates from the chains."""
    assert expected_tokens(0.7, 3) == pytest.approx((1 - 0.7 ** 4) / (1 - 0.7))  # one rate: Leviathan et al.
    assert expected_tokens(0.7, 3, 0.7) == expected_tokens(0.7, 3) and expected_tokens(1.0, 3, 0.5) == 2.5
    first, later, k, n = 0.55, 0.75, 4, 20000
    u = torch.rand(n, k, generator=torch.Generator().manual_seed(0))
    ok = torch.cat([u[:, :1] < first, u[:, 1:] < later], 1).int()
    accepted = ok.cumprod(1).sum(1)  # (n,) drafts accepted in a row
    assert (accepted + 1).double().mean().item() == pytest.approx(expected_tokens(later, k, first), abs=0.04)
    acceptance = Acceptance(prior=0.5, weight=2.0, decay=1.0)
    for a in accepted.tolist():
        acceptance.observe(a, a < k)
    assert acceptance.first_alpha == pytest.approx(first, abs=0.015)
    assert acceptance.alpha == pytest.approx(later, abs=0.015)


def test_one_token_probes_feed_the_first_positions_rate_alone():
    """While speculation is off, probes draft one token: what they say is the first position's rate; the later
    positions keep what longer chains showed, and K comes back longer than one once probes are accepted."""
    steep = CostProfile({w: 1.0 + 0.3 * (w - 1) for w in range(1, 6)}, 0.1)  # a CPU-like v(k)
    tuner = KTuner(steep, learn_costs=False)
    for _ in range(40):
        tuner.observe(4, 4)
    for _ in range(60):
        tuner.observe(4, 0)  # the first draft rejected every step: off
    later = tuner.alpha
    assert tuner.k() == 0 and later > 0.95
    ks = []
    for _ in range(400):
        ks.append(tuner.k())
        if tuner.probing:
            tuner.observe(1, 1)  # every probe accepted
        if ks[-1] > 1:
            break
    assert ks[-1] > 1 and tuner.alpha == later


def test_a_dynamic_trees_depth_is_tuned_from_the_trees_own_accepted_paths():
    """A costly draft (c = 0.3 of a pass; v flat as the native runner's) whose trees are rarely accepted past their
    first depth is asked for shallow trees, one that keeps being accepted for deep ones; chains' K is not moved by
    what trees did, nor trees' depth by chains."""
    from verispec.core.sequence import RowOutcome, StepClock, StepReport

    costs = CostProfile({w: 1.0 + 0.01 * (w - 1) for w in range(1, 9)}, 0.3)
    tuner = KTuner(costs, learn_costs=False)
    start_k = tuner.k()
    clock = StepClock(0.0, 0.0, 0, 0, False, False, False)  # nothing timed: the costs stay the profile's

    def tree_step(depth: int, accepted: int) -> None:
        tuner.observe_report(StepReport(clock, (RowOutcome(None, 6, depth, accepted, accepted == depth),), True))

    for _ in range(40):
        tree_step(4, 1)  # the first depth's best candidate accepted, its child never
    shallow = tuner.k(tree=True)
    assert shallow == 1 and tuner.k() == start_k  # chains keep their own rate
    for _ in range(60):
        tree_step(4, 4)
    assert tuner.k(tree=True) > 3 and tuner.k() == start_k
    for _ in range(60):
        tuner.observe(4, 0)  # chains rejected at once: no chain pays, trees still do
    assert tuner.k() == 0 and tuner.k(tree=True) > 3


def test_a_tuned_dynamic_tree_drafts_no_deeper_than_the_tuner_asks():
    """With `--auto-k` a draft model's dynamic tree runs only the draft passes the tuner's depth pays for (was: every
    depth of the configured K, each step); a tree a request asked for without tuning keeps its depth (here its six
    best nodes reach below the first)."""
    from conftest import noisy_copy

    from verispec.batch import DecodeBatch
    from verispec.config import TreeConfig
    from verispec.drafters.draft_model import DraftModelDrafter

    model = tiny_model("llama", vocab=16, seed=1, layers=2)
    drafter = DraftModelDrafter(ModelRunner(noisy_copy(model, 0.3, seed=2)), 16)
    engine = SpeculativeEngine(ModelRunner(model), drafter, set())
    one_deep = KTuner(CostProfile({w: 1.0 + 0.01 * (w - 1) for w in range(1, 9)}, 0.3), prior=0.35,
                      prior_weight=1e6, learn_costs=False)  # at this rate and cost, depth 1 pays best
    assert one_deep.k(tree=True) == 1
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=12, stop_at_eos=False, tree=TreeConfig(budget=6, top_k=2))
    greedy = SamplingConfig(temperature=0)
    plain = SpeculativeEngine(ModelRunner(model), None, set()).generate(
        [[1, 2, 3, 4, 5]], greedy, SpecConfig(max_new_tokens=12, stop_at_eos=False))[0].generated
    for tuned in (True, False):
        seqs = engine.make_sequences([[1, 2, 3, 4, 5]], greedy, spec, [0])
        seqs[0].tuned = tuned
        batch = DecodeBatch(engine, one_deep)
        depths: list[int] = []
        batch.observers.append(lambda report, seen=depths: seen.extend(r.depth for r in report.rows if r.drafted))
        batch.add(seqs)
        while len(batch):
            engine.step(batch)
        assert seqs[0].generated == plain
        assert depths and (max(depths) == 1) == tuned  # the kept trees' depths
