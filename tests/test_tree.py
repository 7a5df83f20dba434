"""Tree speculation: structure, drafters' trees, greedy equality with plain decoding, a single-chain
tree reproducing the chain token for token, cache consistency, and clear errors."""

import pytest
import torch

from conftest import tiny_model
from drafting import drafts_accepted
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.core.drafter import Drafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter, build_trie, lookup, lookup_all
from verispec.drafters.tree_growth import TreeGrowth
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.tree import TreeCosts, breadth_first, static_parents, static_size, tree_from_parents
from verispec.tuning import KTuner, CostProfile

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 1, 5, 9, 10, 11]]


# --- structure ------------------------------------------------------------------------------------
def test_static_tree_structure():
    parents = static_parents((3, 2))
    assert parents == (-1, -1, -1, 0, 0, 1, 1, 2, 2) and static_size((3, 2)) == 9
    tree = tree_from_parents(parents)
    assert tree.depths.tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2] and tree.depth == 2
    assert tree.children[0] == (0, 1, 2) and tree.children[2] == (5, 6) and tree.children[5] == ()
    assert tree.ancestors[6].nonzero().squeeze(1).tolist() == [1, 6]  # itself and its parent
    assert not tree.ancestors[6, 0] and not tree.ancestors[1, 6]
    assert tree.path_to(6) == [1, 6]
    assert tree_from_parents(parents) is tree  # built once per shape


def test_bad_parents_and_breadth_first_order():
    with pytest.raises(ValueError):
        tree_from_parents((0,))
    with pytest.raises(ValueError):
        tree_from_parents((-1, 2, 0))
    # nodes added depth first, siblings keyed by rank: renumbered breadth first, parents first
    order, parents = breadth_first([-1, 0, 0, -1, 3], [0, 1, 0, 1, 0])
    assert order == [0, 3, 2, 1, 4] and parents == (-1, -1, 0, 0, 1)


def test_tree_config_validation():
    assert TreeConfig(shape=[3, 2, 1]).shape == (3, 2, 1) and TreeConfig(shape=(3, 2, 1)).depth(7) == 3
    assert TreeConfig(budget=16).depth(5) == 5
    assert SpecConfig(num_draft_tokens=3).tree_or_chain.shape == (1, 1, 1)
    for bad, message in [(dict(), "shape .* or a budget"), (dict(shape=(2,), budget=4), "not both"),
                         (dict(shape=(3, 0)), "branching factors >= 1"), (dict(shape=()), "branching"),
                         (dict(budget=0), "budget"), (dict(shape=(64, 64)), "at most"),
                         (dict(budget=4, top_k=0), "top_k"), (dict(budget=4, children="random"), "children")]:
        with pytest.raises(VerispecError, match=message):
            TreeConfig(**bad)
    with pytest.raises(VerispecError, match="TreeConfig"):
        SpecConfig(tree={"shape": [3, 2]})


def grow(config, logits, seed, depth=3, sampling=SamplingConfig(temperature=1.0), costs=None):
    """Grow a tree where every node's draft logits are `logits` (V,), whatever its tokens."""
    growth = TreeGrowth(config, depth, sampling, torch.Generator().manual_seed(seed), logits.numel(), costs=costs)
    growth.add_children(-1, logits, None)
    for d in range(1, depth):
        for node in growth.to_expand(d):
            growth.add_children(node, logits, None)
    return growth


@pytest.mark.parametrize("children", ["without_replacement", "iid", "top"])
def test_dynamic_tree_keeps_a_budget_of_prefix_closed_nodes(children):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    shapes = set()
    for seed in range(5):
        growth = grow(TreeConfig(budget=7, top_k=3, children=children), logits, seed)
        kept = growth.select()
        assert len(kept) == 7
        for node in kept:
            parent, rank = growth.parents[node], growth.ranks[node]
            assert parent == -1 or parent in kept
            siblings = [i for i in range(len(growth.parents)) if growth.parents[i] == parent]
            assert all(s in kept for s in siblings[:rank])  # the earlier-drawn siblings are kept too
        draft, _ = growth.finish()
        assert draft.tree.size == 7 and draft.siblings == ("deterministic" if children == "top" else children)
        shapes.add(draft.tree.parents.tolist().__repr__())
    assert len(shapes) == 1  # which nodes are kept never depends on the sampled tokens


def test_measured_costs_keep_only_the_nodes_that_pay():
    """A node is kept while it raises (1 + kept scores) / (draft cost + v(kept)); the root's children
    have scores 0.5, 0.3, 0.1 here and v = (1.0, 1.2, 1.4, 2.0) for passes over 1..4 tokens."""
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    costs = (1.0, 1.2, 1.4, 2.0)
    # node 1: (1 + 0.5) * v(0) = 1.5 > 1 * v(1) = 1.2, kept; node 2: 1.8 * 1.2 = 2.16 > 1.5 * 1.4 = 2.1, kept;
    # node 3: 1.9 * 1.4 = 2.66 < 1.8 * 2.0 = 3.6: stop.
    tree = TreeConfig(budget=3, top_k=3)
    growth = grow(tree, logits, seed=0, depth=1, costs=TreeCosts(3, costs))
    assert len(growth.select()) == 2
    assert len(grow(tree, logits, seed=0, depth=1).select()) == 3  # no costs: the budget
    assert len(grow(tree, logits, seed=0, depth=1, costs=TreeCosts(3, (1.0,) * 4)).select()) == 3  # a free node pays
    # A large draft cost makes width relatively cheap: with draft_cost 12, node 3 pays (1.9 * 13.4 > 1.8 * 14.0).
    assert len(grow(tree, logits, 0, depth=1, costs=TreeCosts(3, costs, draft_cost=12.0)).select()) == 3
    steep = TreeCosts(3, (1.0, 2.0, 3.0, 4.0))
    assert grow(tree, logits, seed=0, depth=1, costs=steep).select() == []  # no node pays: the step decodes plainly
    assert len(grow(tree, logits, seed=0, depth=1, costs=TreeCosts(2, (1.0,) * 4)).select()) == 2  # the step's cap
    for bad in [dict(nodes=4, pass_costs=()), dict(nodes=2, pass_costs=(1, -1, 1)), dict(nodes=4, pass_costs=(1.0, 1.1, 1.2)),
                dict(nodes=0, pass_costs=(1.0,)), dict(nodes=2, pass_costs=(1.0,) * 3, draft_cost=-1.0)]:
        with pytest.raises(VerispecError):
            TreeCosts(**bad)


@pytest.mark.parametrize("children", ["top", "without_replacement"])
def test_costs_skip_expanding_nodes_whose_children_cannot_pay_and_keep_the_same_tree(children, monkeypatch):
    logits = torch.tensor([3.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    costs = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7, 1.9, 2.1, 2.3, 2.5, 2.7, 2.9)
    config, measured = TreeConfig(budget=12, top_k=3, children=children), TreeCosts(12, costs, draft_cost=0.3)
    pruned = grow(config, logits, seed=3, depth=4, costs=measured)
    with monkeypatch.context() as m:
        m.setattr(TreeGrowth, "_children_could_pay", lambda self, node: True)
        full = grow(config, logits, seed=3, depth=4, costs=measured)
    assert len(pruned.tokens) < len(full.tokens)  # fewer nodes were evaluated by the draft

    def slots(g, node):  # a node's place in the tree: its rank among siblings at every depth
        return () if node < 0 else slots(g, g.parents[node]) + (g.ranks[node],)

    kept = lambda g: sorted(slots(g, i) for i in g.select())  # noqa: E731
    assert kept(pruned) == kept(full) and len(kept(full)) > 1  # the same tree shape is kept
    if children == "top":  # deterministic children: the same tokens too (sampled ones use fewer draws)
        assert sorted(tuple(pruned.path(i)) for i in pruned.select()) == sorted(tuple(full.path(i)) for i in full.select())


@pytest.mark.parametrize("sampling,children", [(GREEDY, "without_replacement"), (SamplingConfig(), "top"),
                                               (SamplingConfig(), "without_replacement"), (SamplingConfig(), "iid")])
def test_a_copied_token_is_the_first_child_with_a_one_hot_q(sampling, children):
    """Lookup first in trees: the copied token leads; top-token children follow it, sampled ones make way
    for it (a node's sampled children share one q, and the copied token was not drawn from it)."""
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.0])  # the draft's top tokens: 1, 2, 3
    growth = TreeGrowth(TreeConfig(shape=(3,), children=children), 1, sampling, torch.Generator().manual_seed(0), 8)
    growth.add_children(-1, logits, None, copied=6)
    sampled = not sampling.greedy and children != "top"
    assert growth.tokens == ([6] if sampled else [6, 1, 2])
    draft, _ = growth.finish()
    if sampled:
        assert torch.equal(draft.q[0], torch.nn.functional.one_hot(torch.tensor(6), 8).float())
    else:
        assert draft.q is None and draft.siblings == "deterministic"


def test_without_replacement_children_are_distinct_and_static_shapes_are_full():
    logits = torch.zeros(8)
    growth = grow(TreeConfig(shape=(4, 2, 1)), logits, seed=0)
    draft, _ = growth.finish()
    assert draft.tree.size == static_size((4, 2, 1)) and draft.q.shape == (draft.tree.size, 8)
    for kids in draft.tree.children:
        tokens = [int(draft.tokens[k]) for k in kids]
        assert len(set(tokens)) == len(tokens)


def test_prompt_lookup_trie():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 4, 1, 2, 3, 9, 9, 1, 2]
    found = lookup_all(tokens, 3, PromptLookupDrafter().config)
    assert found[0] == lookup(tokens, 3, PromptLookupDrafter().config)
    assert found[:3] == [[3, 7, 8], [3, 9, 9], [4, 1, 2]]
    trie, parents = build_trie(found, TreeConfig(shape=(3, 2, 1)), 3)
    assert trie == [3, 4, 7, 9, 1, 8, 9, 2] and parents == (-1, -1, 0, 0, 1, 2, 3, 4)  # shared prefix 3 merged
    trie, parents = build_trie(found, TreeConfig(budget=4), 3)
    assert len(trie) == 4
    trie, _ = build_trie(found, TreeConfig(shape=(1, 1, 1)), 3)
    assert trie == found[0]


# --- decoding -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(greedy_pair):
    return greedy_pair


def plain_tokens(target, prompts, max_new_tokens=24, eos=()):
    engine = SpeculativeEngine(ModelRunner(target), None, set(eos))
    return [s.generated for s in engine.generate(prompts, GREEDY, SpecConfig(max_new_tokens=max_new_tokens))]


TREES = [TreeConfig(shape=(3, 2, 1)), TreeConfig(shape=(2, 2, 2, 1)), TreeConfig(budget=10, top_k=3),
         TreeConfig(budget=1)]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"shape{t.shape}" if t.shape else f"budget{t.budget}")
def test_greedy_draft_model_trees_equal_plain_decoding(pair, tree):
    target, draft = pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), {7})
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24, tree=tree))
    assert [s.generated for s in seqs] == plain_tokens(target, PROMPTS, eos={7})
    drafts_accepted(seqs)
    for s in seqs:
        stats = s.stats
        assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
        assert stats.new_tokens <= stats.accepted_tokens + stats.target_forward_passes


@pytest.mark.parametrize("tree", [TreeConfig(shape=(3, 2, 1)), TreeConfig(budget=8)], ids=["shape", "budget"])
def test_greedy_prompt_lookup_tries_equal_plain_decoding_qwen(tree):
    target = tiny_model("qwen2", vocab=64, seed=2, sharpness=30.0)
    engine = SpeculativeEngine(ModelRunner(target), PromptLookupDrafter(), set())
    seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=30, tree=tree))
    assert [s.generated for s in seqs] == plain_tokens(target, PROMPTS, 30)
    drafts_accepted(seqs)


def test_mixed_batch_of_trees_chains_and_plain_rows_equals_plain_decoding(pair):
    target, draft = pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    specs = [SpecConfig(max_new_tokens=20, tree=TreeConfig(shape=(2, 2))), SpecConfig(max_new_tokens=20),
             SpecConfig(max_new_tokens=20, tree=TreeConfig(budget=6))]
    sequences = [engine.make_sequences([p], GREEDY, spec, 0)[0] for p, spec in zip(PROMPTS, specs)]
    sequences[1].index, sequences[2].index = 1, 2
    sequences[2].drafting = False  # decodes plainly among drafting rows
    batch = DecodeBatch(engine)
    batch.add(sequences[:2])
    engine.step(batch)
    batch.add(sequences[2:])  # joins a running batch between tree steps
    while batch:
        engine.step(batch)
    assert [s.generated for s in sequences] == plain_tokens(target, PROMPTS, 20)
    assert sequences[2].stats.draft_tokens == 0
    for row in sequences[:2]:  # the tree row and the chain row
        drafts_accepted([row])


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=20),
                                      SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.3), GREEDY],
                         ids=["T1", "topk", "topp-rep", "greedy"])
@pytest.mark.parametrize("children", ["without_replacement", "iid"])
def test_a_tree_of_one_chain_gives_the_chain_output_for_the_same_seed(sampling, children):
    target = tiny_model("llama", vocab=64, seed=0, sharpness=3.0)
    draft = tiny_model("llama", vocab=64, seed=0, sharpness=2.0)
    outputs = []
    for tree in (None, TreeConfig(shape=(1, 1, 1, 1), children=children)):
        engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
        seqs = engine.generate(PROMPTS, sampling, SpecConfig(num_draft_tokens=4, max_new_tokens=25, tree=tree), seeds=11)
        outputs.append([(s.generated, s.stats.accepted_tokens, s.stats.target_forward_passes) for s in seqs])
    assert outputs[0] == outputs[1]
    assert sum(o[1] for o in outputs[0]) > 0


def test_seeded_tree_sampling_is_reproducible(pair):
    target, draft = pair
    runs = []
    for _ in range(2):
        engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
        seqs = engine.generate(PROMPTS, SamplingConfig(temperature=1.0), SpecConfig(max_new_tokens=20,
                               tree=TreeConfig(budget=8)), seeds=5)
        runs.append([s.generated for s in seqs])
    assert runs[0] == runs[1]


def test_draft_cache_holds_the_committed_tokens_after_tree_steps(pair):
    """After compaction the draft's cache answers like a fresh decoding of what it holds."""
    target, draft = pair
    drafter = DraftModelDrafter(ModelRunner(draft), 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, SamplingConfig(temperature=1.0),
                                    SpecConfig(max_new_tokens=40, tree=TreeConfig(shape=(3, 2, 1))), 3))
    for _ in range(4):
        engine.step(batch)
    seqs = batch.sequences
    assert drafter.state.lengths.tolist() == drafter.cached and not drafter.state.speculative
    assert batch.state.lengths.tolist() == [s.target_cached for s in seqs]
    pending = [s.tokens[c:] for s, c in zip(seqs, drafter.cached)]
    out = drafter.runner.forward(drafter.state, pending, [1] * len(seqs))[:, 0]
    for b, s in enumerate(seqs):
        with torch.no_grad():
            full = draft(torch.tensor([s.tokens])).logits[0, -1].float()
        torch.testing.assert_close(out[b], full, atol=1e-4, rtol=1e-4)


# --- errors ---------------------------------------------------------------------------------------
class ChainOnly(Drafter):
    name = "chain-only"

    def propose(self, sequences, depths, trees=None):
        raise AssertionError("not reached")


def test_trees_need_a_tree_capable_drafter_and_backend(pair):
    target, draft = pair
    spec = SpecConfig(tree=TreeConfig(shape=(2, 1)))
    with pytest.raises(VerispecError, match="needs a drafter"):
        SpeculativeEngine(ModelRunner(target), None, set()).make_sequences([[1, 2]], GREEDY, spec, 0)
    with pytest.raises(VerispecError, match="'chain-only' drafter cannot draft trees"):
        SpeculativeEngine(ModelRunner(target), ChainOnly(), set()).make_sequences([[1, 2]], GREEDY, spec, 0)

    class ChainRunner:  # a runner without tree passes
        def __init__(self, runner):
            self.vocab_size, self.context_window, self.device = runner.vocab_size, runner.context_window, runner.device

    with pytest.raises(VerispecError, match="tree passes"):
        SpeculativeEngine(ChainRunner(ModelRunner(target)), PromptLookupDrafter(), set()).make_sequences(
            [[1, 2]], GREEDY, spec, 0)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    tuner = KTuner(CostProfile({1: 1.0, 2: 1.0}, 0.1), learn_costs=False)
    with pytest.raises(VerispecError, match="not a static tree shape"):
        engine.generate([[1, 2]], GREEDY, spec, tuner=tuner)


def test_auto_tuned_dynamic_trees_equal_plain_decoding_and_shrink_with_steep_costs(pair):
    """With a tuner, dynamic trees are sized from its costs (fixed profiles here): still exact (greedy = plain), and
    a steep cost curve keeps fewer nodes per step than a flat one."""
    target, draft = pair
    spec = SpecConfig(max_new_tokens=24, tree=TreeConfig(budget=10, top_k=3))
    drafted = {}
    for name, costs in [("flat", {w: 1.0 for w in range(1, 12)}), ("steep", {w: float(w) ** 0.7 for w in range(1, 12)})]:
        engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), {7})
        seqs = engine.generate(PROMPTS, GREEDY, spec, tuner=KTuner(CostProfile(costs, 0.05), learn_costs=False))
        assert [s.generated for s in seqs] == plain_tokens(target, PROMPTS, eos={7})
        drafted[name] = drafts_accepted(seqs)[0] / sum(s.stats.target_forward_passes for s in seqs)
    assert drafted["steep"] < drafted["flat"]


def test_a_huge_top_k_is_capped_at_the_budget_and_bounds_the_draft_work(pair):
    """{"budget": 8, "top_k": 1000000000} gave every node up to V children and expanded every node of a depth in one
    draft pass (2,209 nodes at K = 3 on a 47-token vocabulary, against 4 with top_k = 4): one ~100-byte request
    made a step's work explode. top_k is now at most the budget, so a depth's pass reads at most budget nodes."""
    assert TreeConfig(budget=8, top_k=10**9).top_k == 8 and TreeConfig(budget=8, top_k=3).top_k == 3
    target, draft = pair
    draft_runner = ModelRunner(draft)
    widths = []
    forward = draft_runner.forward
    draft_runner.forward = lambda state, tokens, n, parents=None: (widths.append(max(map(len, tokens)))
                                                                   or forward(state, tokens, n, parents))
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(draft_runner, 64), set())
    for sampling in (GREEDY, SamplingConfig(temperature=1.0)):
        widths.clear()
        seqs = engine.generate([PROMPTS[0]], sampling, SpecConfig(num_draft_tokens=3, max_new_tokens=12,
                                                                 tree=TreeConfig(budget=8, top_k=10**9)), seeds=0)
        assert len(seqs[0].generated) == 12
        assert max(widths[1:]) <= 8  # after the prompt: at most `budget` nodes expanded per depth
