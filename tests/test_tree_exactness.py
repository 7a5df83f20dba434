"""Tree speculation keeps the target's distribution: seeded chi-square tests.

Layer 1, toy distributions: `verify` on trees whose children are drawn i.i.d., without
replacement, or chosen deterministically, for several shapes; the first two emitted tokens must
follow p(t1) p(t2 | t1). Verifying children drawn without replacement with SpecInfer's fixed-q rule
must fail the same test (negative control).
Layer 2, tiny random models through the engine: static and dynamic draft-model trees and prompt
lookup tries under temperature, top-k, top-p, min-p and repetition penalty, checked like
`test_exactness` (joint of the first two tokens, third token after the most frequent pair).
"""

from functools import lru_cache

import pytest
import torch

from test_exactness import PROMPT, THRESHOLD, V, check_distribution
from verispec import rejection
from verispec.chisquare import chi_square_test
from verispec.config import PromptLookupConfig, SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.tree_growth import TreeGrowth, draw_children
from verispec.engine import SpeculativeEngine
from verispec.models.runners.hf import ModelRunner
from verispec.rejection import Verdict, verify, walk_tree
from verispec.sampling import sample as draw
from verispec.tree import Draft, static_parents, tree_from_parents
from verispec.tuning import KTuner, CostProfile

# --- layer 1: toy distributions -------------------------------------------------------------------
TOY_V = 5


def toy_logits(prefix: tuple[int, ...], seed: int) -> torch.Tensor:
    """Fixed logits over TOY_V tokens for each prefix (a toy language model). -> (V,)"""
    g = torch.Generator().manual_seed(seed * 7919 + sum((t + 1) * 31**i for i, t in enumerate(prefix)))
    return 1.5 * torch.randn(TOY_V, generator=g)


@lru_cache(maxsize=None)
def p_toy(prefix):
    """The target; at the root some tokens get no mass at all."""
    logits = toy_logits(prefix, 1)
    if not prefix:
        logits[logits.argsort()[:2]] = float("-inf")
    return torch.softmax(logits, dim=-1)


@lru_cache(maxsize=None)
def q_toy(prefix):
    """The draft: leans away from the target, so rejections and residuals matter."""
    return torch.softmax(-1.6 * toy_logits(prefix, 1) + 2 * toy_logits(prefix, 2), dim=-1)


def toy_tree_step(shape, mode, rng, verify_as=None):
    """Draw a tree from q_toy (children per `mode`), verify it against p_toy; return the emitted tokens."""
    parents = list(static_parents(shape))
    paths: list[tuple[int, ...]] = []
    tokens, q_rows, tree_parents = [], [], []
    by_parent: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        by_parent.setdefault(parent, []).append(i)
    new_index = {-1: -1}
    for parent, kids in by_parent.items():  # parents come first: breadth first order is kept
        if parent not in new_index:
            continue  # its parent was never drawn (fewer children than the shape allows)
        prefix = () if parent < 0 else paths[new_index[parent]]
        q = q_toy(prefix)
        if mode == "deterministic":
            drawn = q.topk(len(kids)).indices.tolist()
        else:
            drawn = draw_children(q, len(kids), mode, rng)
        for kid, token in zip(kids, drawn):
            new_index[kid] = len(tokens)
            tokens.append(token)
            tree_parents.append(new_index[parent])
            paths.append(prefix + (token,))
            q_rows.append(q)
    tree = tree_from_parents(tuple(tree_parents))
    p = torch.stack([p_toy(())] + [p_toy(path) for path in paths])  # (N + 1, V)
    q = None if mode == "deterministic" else torch.stack(q_rows)  # (N, V)
    verdict = verify(p, Draft(torch.tensor(tokens), q, tree=tree, siblings=verify_as or mode), rng)
    return [tokens[i] for i in verdict.path] + [verdict.token]


def toy_fit(shape, mode, n=3000, seed=0, verify_as=None):
    rng = torch.Generator().manual_seed(seed)
    counts = torch.zeros(TOY_V * TOY_V)
    for _ in range(n):
        out = toy_tree_step(shape, mode, rng, verify_as)
        if len(out) < 2:  # the next step would sample it from the target
            out.append(int(torch.multinomial(p_toy((out[0],)), 1, generator=rng)))
        counts[out[0] * TOY_V + out[1]] += 1
    joint = p_toy(())[:, None] * torch.stack([p_toy((t,)) for t in range(TOY_V)])  # (V, V)
    return chi_square_test(counts, joint.flatten())


@pytest.mark.parametrize("shape", [(3,), (2, 2), (4, 1), (1, 3)])
@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_verify_tree_matches_the_target_on_toy_distributions(shape, mode):
    fit = toy_fit(shape, mode)
    assert fit.p_value > THRESHOLD, fit


def test_toy_check_catches_specinfer_rule_on_children_drawn_without_replacement():
    """Negative control: q must lose each rejected child when siblings are drawn without replacement."""
    fit = toy_fit((4, 1), "without_replacement", verify_as="iid")
    assert fit.p_value < THRESHOLD, fit


def test_single_chain_tree_draws_exactly_what_verify_draws():
    """`verify` takes a vectorized path for chains: it draws what the tree walk draws and reaches its verdict."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, vocab = trial % 5, 6
        p = torch.softmax(2 * torch.randn(n + 1, vocab, generator=g), dim=-1)
        q = None if trial % 3 == 0 else torch.softmax(2 * torch.randn(n, vocab, generator=g), dim=-1)
        tokens = torch.randint(vocab, (n,), generator=g)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        chain = verify(p, Draft(tokens, q), a)
        u = torch.rand(n, generator=b)  # the walk's uniforms, drawn as `verify` draws them for a tree
        path, final, leaf = walk_tree(p, tree_from_parents(tuple(range(-1, n - 1))), tokens, q,
                                      "deterministic" if q is None else "iid", u)
        tree = Verdict(path, draw(final, b), bonus=leaf)
        assert (tree.path, tree.token, tree.bonus) == (chain.path, chain.token, chain.bonus)
        assert torch.equal(a.get_state(), b.get_state())


# --- layer 2: tiny models through the engine -------------------------------------------------------
N = 2000


@pytest.fixture(scope="module")
def target(sampling_pair):
    return sampling_pair[0]


@pytest.fixture(scope="module")
def draft(sampling_pair):
    return sampling_pair[1]


def sample(engine, sampling, tree, k=3, n=N, seed=0, tuner=None):
    spec = SpecConfig(num_draft_tokens=k, max_new_tokens=3, stop_at_eos=False, tree=tree)
    seqs = engine.generate([PROMPT] * n, sampling, spec, seeds=seed, tuner=tuner)
    return [tuple(s.generated[:3]) for s in seqs], seqs


SIZED = TreeConfig(budget=6, top_k=3)  # the one case decoded with measured costs (`sized_by`)


class FixedCosts(KTuner):
    """A tuner whose costs are its profile whatever the batch's rows (these tests decode N rows at once, which a real
    tuner prices as one pass over all of them)."""

    def costs(self, rows: int = 1) -> CostProfile:
        return self.profile


def sized_by(tree):
    """A tuner with fixed pass costs for the SIZED case (its trees keep only the nodes that pay), else None."""
    if tree is not SIZED:
        return None
    costs = CostProfile(dict(enumerate((1.0, 1.02, 1.05, 1.1, 1.14, 1.18, 1.22), start=1)), draft_token=0.03)
    return FixedCosts(costs, learn_costs=False)


CASES = [
    (TreeConfig(shape=(2, 2)), SamplingConfig(temperature=1.0)),
    (TreeConfig(shape=(2, 2)), SamplingConfig(temperature=0.7, top_k=4)),
    (TreeConfig(shape=(3, 1), children="iid"), SamplingConfig(temperature=1.2, top_p=0.7)),
    (TreeConfig(budget=6, top_k=3), SamplingConfig(temperature=1.0, min_p=0.15)),
    (TreeConfig(budget=6, top_k=3, children="top"), SamplingConfig(temperature=1.2, top_p=0.7)),
    # sized from costs (a tuner's fixed profile): which nodes are kept changes from step to step with the draft's scores
    (SIZED, SamplingConfig(temperature=1.0)),
    (TreeConfig(budget=5, top_k=2, children="iid"),
     SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.5)),
]


@pytest.mark.parametrize("tree,sampling", CASES, ids=lambda x: str(x.shape or x.budget) + x.children
                         if isinstance(x, TreeConfig) else f"T{x.temperature}-k{x.top_k}-p{x.top_p}-r{x.repetition_penalty}")
def test_draft_model_trees_match_the_target_distribution(target, draft, tree, sampling, monkeypatch):
    sizes = []
    select = TreeGrowth.select
    monkeypatch.setattr(TreeGrowth, "select", lambda self: sizes.append(len(kept := select(self))) or kept)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), V), set())
    samples, seqs = sample(engine, sampling, tree, tuner=sized_by(tree))
    if tree is SIZED:  # the cost rule really chose different trees from step to step
        assert len(set(sizes)) > 2, __import__("collections").Counter(sizes)
    accepted = sum(s.stats.accepted_tokens for s in seqs)
    assert 0 < accepted < sum(s.stats.draft_tokens for s in seqs)
    assert sum(s.stats.recovered_tokens for s in seqs) > 0  # rejections happened
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_q_equal_to_p_accepts_a_whole_path_and_stays_exact(target):
    sampling = SamplingConfig(temperature=1.0, top_k=5)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(target), V), set())
    samples, seqs = sample(engine, sampling, TreeConfig(shape=(2, 2)), n=1500)
    assert all(s.stats.accepted_per_position[:2] == s.stats.drafted_per_position[:2] for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_prompt_lookup_tries_stay_exact(target):
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    engine = SpeculativeEngine(ModelRunner(target), PromptLookupDrafter(), set())
    samples, seqs = sample(engine, sampling, TreeConfig(budget=6))
    assert sum(s.stats.accepted_tokens for s in seqs) > 0
    assert max(len(s.stats.drafted_per_position) for s in seqs) >= 2
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


@pytest.mark.parametrize("tree", [TreeConfig(shape=(2, 2)), TreeConfig(budget=6, top_k=3),
                                  TreeConfig(shape=(3, 1), children="iid"), TreeConfig(budget=6, top_k=3, children="top")],
                         ids=["static", "dynamic", "iid", "top"])
def test_lookup_first_draft_trees_stay_exact(target, draft, tree, monkeypatch):
    """Lookup first in a tree: a node whose path ends in an n-gram seen earlier gets the copied token as its
    first child (one-hot q; the only child when children are sampled), the others the draft's children."""
    copied = []
    found = DraftModelDrafter._copied
    monkeypatch.setattr(DraftModelDrafter, "_copied", lambda self, *args: copied.append(t := found(self, *args)) or t)
    sampling = SamplingConfig(temperature=1.0)
    drafter = DraftModelDrafter(ModelRunner(draft), V, lookup=PromptLookupConfig(max_ngram=2, min_ngram=1))
    samples, seqs = sample(SpeculativeEngine(ModelRunner(target), drafter, set()), sampling, tree)
    assert any(c is not None for c in copied) and any(c is None for c in copied)  # both kinds of nodes
    assert sum(s.stats.recovered_tokens for s in seqs) > 0 and sum(s.stats.accepted_tokens for s in seqs) > 0
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_engine_check_catches_a_without_replacement_tree_verified_with_a_fixed_q(target, draft, monkeypatch):
    """Negative control through the engine: not updating q after a rejection must fail."""
    monkeypatch.setattr(rejection, "_without", lambda q, token: q)
    sampling = SamplingConfig(temperature=1.0)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), V), set())
    samples, _ = sample(engine, sampling, TreeConfig(shape=(4, 1)))
    assert min(fit.p_value for fit in check_distribution(target, samples, sampling)) < THRESHOLD
