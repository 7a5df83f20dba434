"""The composite drafter (`verispec.drafters.composite`): lookups and one costly drafter chosen per row and step.
Greedy output equal to plain decoding with every member drafting, the choice rule on its own, chi-square through the
engine with the choice switching between members, and bad specs as one clear line."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from verispec.config import PromptLookupConfig, SamplingConfig, SpecConfig, SuffixConfig, TreeConfig
from verispec.core.drafter import Draft
from verispec.drafters.composite import CompositeDrafter, MemberRecord, matched
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.tuning import KTuner, CostProfile

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8], [3, 3, 3, 3], [5, 9, 2, 11, 4]]
# a one-token target pass costs 1; a draft token 0.3 of it: the 0.5B draft's share on this machine
PROFILE = CostProfile({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}, 0.3)


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama", vocab=16, seed=1, layers=2, sharpness=30.0)
    return ModelRunner(model), ModelRunner(noisy_copy(model, 0.3, seed=2))


def composite(draft_runner, lookup="suffix", learn_costs=False) -> CompositeDrafter:
    free = SuffixDrafter(SuffixConfig(min_match=1)) if lookup == "suffix" else \
        PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=2))
    return CompositeDrafter([free, DraftModelDrafter(draft_runner, draft_runner.vocab_size)], learn_costs=learn_costs)


@pytest.mark.parametrize("tree", [None, TreeConfig(budget=6)], ids=["chain", "tree"])
@pytest.mark.parametrize("tuned", [False, True], ids=["fixed-k", "auto-k"])
def test_greedy_output_equals_plain_decoding_with_every_member_drafting(pair, tree, tuned):
    target, draft = pair
    plain = [s.generated for s in SpeculativeEngine(target, None, set()).generate(PROMPTS, GREEDY,
                                                                                  SpecConfig(max_new_tokens=40))]
    drafter = composite(draft)
    if tuned:  # the model costs nothing here, so it competes with the lookup on acceptance alone
        tuner = KTuner(CostProfile(PROFILE.target_pass, 0.0), learn_costs=False)
    else:
        tuner = None
    out = SpeculativeEngine(target, drafter, set()).generate(
        PROMPTS, GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=40, tree=tree), tuner=tuner)
    assert [s.generated for s in out] == plain
    drafts_accepted(out)
    assert all(drafter.shares().values()), drafter.shares()  # both the lookup and the model drafted rows


def test_a_lookup_chain_is_scored_against_what_was_committed():
    assert matched([4, 5, 6], [4, 5, 9]) == (2, True)  # two accepted, then a different token: a rejection
    assert matched([4, 5], [4, 5, 9]) == (2, False)  # all accepted
    assert matched([4, 5, 6], [4]) == (1, False)  # the committed tokens end first: cut short, no rejection seen
    record = MemberRecord(prior=0.5, weight=2.0, decay=1.0)
    record.observe(3, True)  # the first position accepted; two later ones accepted, then one rejected
    assert record.first_alpha == pytest.approx(2 / 3) and record.alpha == pytest.approx(3 / 5)


def rate(record: MemberRecord, alpha: float, weight: float = 10.0) -> None:
    """Set a member's acceptance: both rates (first position and later ones) alpha, worth `weight` trials."""
    for r in (record.first, record.later):
        r.accepted, r.rejections = alpha * weight, (1 - alpha) * weight


class Fixed(PromptLookupDrafter):
    """A lookup whose chain is given by the test (row b gets chains[b])."""

    def __init__(self, chains):
        super().__init__(PromptLookupConfig())
        self.chains = chains

    def propose(self, sequences, depths, trees=None):
        return [Draft(torch.tensor(c[:d], dtype=torch.long)) for c, d in zip(self.chains, depths)]


def choose(drafter: CompositeDrafter, rows: int, depth: int = 4) -> list[int]:
    from verispec.core.sequence import Sequence

    seqs = [Sequence(b, [1, 2, 3], 3, GREEDY, torch.Generator(), 64) for b in range(rows)]
    drafter.start(seqs)
    drafts = drafter.propose(seqs, [depth] * rows)
    chosen, lengths = list(drafter.chosen), [len(d) for d in drafts]
    drafter.commit(seqs, drafts, [()] * rows)
    return [c if n else -1 for c, n in zip(chosen, lengths)]


def test_the_choice_follows_acceptance_and_cost(pair):
    _, draft = pair
    drafter = CompositeDrafter([Fixed([[5, 6, 7, 8], []]), DraftModelDrafter(draft, 16)], learn_costs=False)
    assert choose(drafter, 2) == [0, 1]  # no costs measured: the lookup where it has a chain, else the model
    drafter.size_drafts(PROFILE)
    rate(drafter.records[0], 0.9)  # the lookup is right 90% of the time
    rate(drafter.records[1], 0.6)
    assert choose(drafter, 2)[0] == 0  # free and better: the lookup
    rate(drafter.records[0], 0.1)
    rate(drafter.records[1], 0.9)
    assert choose(drafter, 2) == [1, 1]  # a poor lookup loses to a good model
    rate(drafter.records[0], 0.01)
    rate(drafter.records[1], 0.01)
    assert choose(drafter, 2) == [-1, -1]  # nothing pays: no drafting


def test_a_costly_member_that_is_off_is_probed(pair):
    _, draft = pair
    drafter = CompositeDrafter([Fixed([[]]), DraftModelDrafter(draft, 16)], learn_costs=False)
    drafter.size_drafts(PROFILE)
    rate(drafter.records[1], 0.01)
    chosen = [choose(drafter, 1)[0] for _ in range(60)]
    probes = [i for i, c in enumerate(chosen) if c == 1]
    assert probes == [15, 47]  # after 16 steps off; the probe was rejected, so the next after 32


class FixedCosts(KTuner):
    """A tuner whose costs are its profile at any batch size (the grid's 3,000 rows would otherwise make a wide pass
    cost as much as its tokens, and nothing would draft)."""

    def costs(self, rows: int = 1) -> CostProfile:
        return self.profile


def composite_family(target, backend):
    """The grid's lookup and draft model behind one composite (the choice switches per row as lookups find matches)."""
    import exactness_harness as grid

    return CompositeDrafter([grid.prompt_lookup(target, backend), grid.draft_model(target, backend)], learn_costs=False)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("tuned", [False, True], ids=["fixed-k", "auto-k"])
def test_sampled_composite_decoding_follows_the_targets_distribution(backend, tuned, monkeypatch):
    """Chi-square cells through the engine with both members drafting rows of the same steps, and a wrong residual
    (the target's p instead of max(0, p - q) after a rejected model draft) that the same cells catch."""
    import exactness_harness as grid
    from verifier_mutants import installed

    monkeypatch.setitem(grid.FAMILIES, "composite", composite_family)
    grid._engines.pop(("composite", backend), None)
    cell = grid.Cell("composite", backend, "chain", "T1")
    tuner = FixedCosts(CostProfile({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.02), learn_costs=False) if tuned else None
    outcome = grid.run_cell(cell, tuner=tuner)
    grid.check(outcome, cell)
    drafter = grid.engine_for("composite", backend)[0].drafter
    assert all(drafter.shares().values()), drafter.shares()
    with installed("residual p"):
        assert grid.run_cell(cell, tuner=tuner).p_value <= grid.THRESHOLD
    grid._engines.pop(("composite", backend), None)


def test_the_draft_flag_builds_it_and_bad_specs_are_one_clear_line(pair, tmp_path, capsys):
    from tiny_hf import save_tiny_model_dir
    from verispec.cli import main
    from verispec.drafters.registry import build_drafter, parse_draft

    spec = parse_draft("suffix+ngram")
    assert spec.kind == "composite" and [p.kind for p in spec.parts] == ["suffix", "ngram"] and not spec.loads_model
    assert parse_draft("suffix+qwen2.5-coder-0.5b-instruct").loads_model
    assert parse_draft("my+model.gguf").kind == "model"  # a path with a '+' is still a model
    built = build_drafter("suffix+ngram", None, None)
    assert isinstance(built.drafter, CompositeDrafter) and built.name == "suffix+ngram"
    _, draft = pair
    with pytest.raises(VerispecError, match="one drafter with a cost of its own"):
        CompositeDrafter([DraftModelDrafter(draft, 16), DraftModelDrafter(draft, 16)])
    target = str(save_tiny_model_dir(tmp_path / "target", "llama", seed=0))
    draft_dir = str(save_tiny_model_dir(tmp_path / "draft", "llama", seed=1))
    common = ["generate", "--json", "--prompt", "abcabcabc", "--temperature", "0", "--max-new-tokens", "12",
              "--target", target]
    assert main([*common, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*common, "--draft", f"suffix+{draft_dir}"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    for bad, says in (("suffix+none", "got 'none'"), ("suffix+", "got ''"), ("ngram+nosuchmodel", "unknown model spec")):
        assert main([*common, "--draft", bad]) == 2
        err = capsys.readouterr().err
        assert says in err and f"--draft {bad}" in err and len(err.strip().splitlines()) == 1, err


def test_a_draft_models_unread_prompt_is_charged_to_the_steps_it_may_draft(pair):
    from verispec.core.sequence import Sequence

    _, draft = pair
    drafter = CompositeDrafter([Fixed([[], []]), DraftModelDrafter(draft, 16)])
    drafter.size_drafts(CostProfile({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}, 0.05))
    assert drafter.read_token > 0  # timed on the draft's own runner
    drafter.read_token = 0.05  # a twentieth of a target pass per token read
    rate(drafter.records[1], 0.8)
    short, long = [1, 2, 3], [(i * 5) % 16 for i in range(600)]
    seqs = [Sequence(b, list(p), len(p), GREEDY, torch.Generator(), 32) for b, p in enumerate((short, long))]
    drafter.start(seqs)
    drafts = drafter.propose(seqs, [4, 4])
    # 600 unread tokens cost 30 passes, more than the model saves over this answer's 32 tokens; 3 cost nothing much
    assert drafter.chosen == [1, -1] and len(drafts[0]) and not len(drafts[1])
    cached = drafter.members[1].cached  # the draft's pass read the short row (and its drafts) and caught the long one up
    assert cached[0] > len(short) and cached[1] == len(long)


def test_the_costly_member_is_timed_but_not_where_it_reads_a_prompt_or_probes(pair):
    """Its first step on a row reads the whole prompt, and a probe after steps off first reads what it skipped: one-offs
    that, charged to a step's few positions, kept it off for good. Its catch-up after a lookup's steps is timed (rows
    switching members pay it again and again)."""
    from verispec.core.sequence import Sequence

    _, draft = pair

    def run(drafter, chains):
        lookup, timed, chosen = drafter.members[0], [], []
        drafter._timed = lambda seconds, positions: timed.append(step)
        seq = Sequence(0, [1, 2, 3], 3, GREEDY, torch.Generator(), 64)
        drafter.start([seq])
        for step, chain in enumerate(chains):
            lookup.chains = [chain]
            drafts = drafter.propose([seq], [3])
            chosen.append(drafter.chosen[0] if len(drafts[0]) else -1)
            accepted = drafts[0].tokens[:1].tolist()
            seq.tokens += accepted + [9]  # one draft accepted, then a recovered token
            drafter.commit([seq], drafts, [tuple(range(len(accepted)))])
        return timed, chosen

    timed, chosen = run(CompositeDrafter([Fixed([[]]), DraftModelDrafter(draft, 16)]),
                        [[], [], [], [5, 6, 7], [5, 6], [], [], []])
    assert chosen == [1, 1, 1, 0, 0, 1, 1, 1] and timed == [1, 2, 5, 6, 7]  # all but the row's first step
    off = CompositeDrafter([Fixed([[]]), DraftModelDrafter(draft, 16)])
    off.size_drafts(PROFILE)
    rate(off.records[1], 0.01)
    timed, chosen = run(off, [[]] * 20)
    assert chosen.count(1) == 1 and timed == []  # one probe, not timed


def test_a_fresh_batch_restarts_each_members_estimate_from_its_average(pair):
    target, draft = pair
    drafter = composite(draft)
    record = drafter.records[1]
    for _ in range(30):
        record.observe(4, False)  # a request the model follows
    for _ in range(100):
        record.observe(0, True)  # one whose ending it cannot: off, its probes spaced out
    record.probe_gap = 128
    assert record.first_alpha < 0.05
    SpeculativeEngine(target, drafter, set()).generate([PROMPTS[0]], GREEDY, SpecConfig(max_new_tokens=1))
    assert record.first_alpha == pytest.approx((0.6 * 4 + 30) / (4 + 30 + 100)) and record.probe_gap == 16
    assert record.alpha == pytest.approx((0.6 * 4 + 90) / (4 + 90))  # later positions were only ever accepted
