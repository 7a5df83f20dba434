"""Growing one sequence's draft tree from a draft model's distributions, depth by depth.

The draft model evaluates the tree one depth per pass (`DraftModelDrafter.propose`); this module
decides, from each evaluated node's draft distribution, which children the node gets, and at the end
which nodes the tree keeps.

Children of a node (`children` of `TreeConfig`; greedy decoding always takes the top tokens):
  - "top": the k most probable tokens, deterministic (the verifier treats q as one-hot);
  - "without_replacement": k distinct samples from q, in draw order (recursive rejection sampling);
  - "iid": k independent samples from q (SpecInfer's multi-step speculative sampling).
One sample is drawn exactly as a chain draft is, so a tree of shape (1, ..., 1) drafts the chain.

Static trees take shape[d] children at depth d + 1 for every node. Dynamic trees (EAGLE-2, Li et al.
2024) expand the top_k most confident nodes of each depth, top_k children each, then keep the `budget`
nodes with the highest score, best first. A node's score is its parent's score times the j-th largest
probability of the parent's distribution, j its rank among its siblings: for top-k children that is
the draft probability of the path (EAGLE-2's confidence); for sampled children it is the same number
for the slot, *not* the drawn token's own probability. This matters for exactness (see
`verispec.rejection`): whether a sampled child is kept must not depend on its value or on later
draws, and best-first selection makes a node eligible only after its parent and its previous
sibling are kept, so kept siblings are always the first ones drawn.

With measured costs (`tree.TreeCosts`, one step's), selection stops at the first node, in best-first
order, that does not raise the expected tokens per cost (the scores standing in for acceptance
probabilities, as in EAGLE-2): whether a node is kept then depends only on nodes popped before it
and on its own slot score, never on its drawn token or on later draws, so the argument above holds.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from verispec.config import SamplingConfig, TreeConfig
from verispec.drafters.drawing import allow_only
from verispec.sampling import logits_to_probs, penalise, sample
from verispec.tree import Draft, TreeCosts, breadth_first, tree_from_parents


def draw_children(probs: torch.Tensor, k: int, mode: str, rng: torch.Generator) -> list[int]:
    """k children from probs: (V,): "top" (deterministic), "without_replacement" or "iid" samples."""
    available = int((probs > 0).sum())
    if mode == "top":
        return probs.topk(min(k, available)).indices.tolist()
    if mode == "without_replacement":
        k = min(k, available)
    if mode == "iid" or k == 1:
        # One sample is the chain drafter's own call, so single-child trees draw what chains draw.
        return [sample(probs, rng) for _ in range(k)]
    # Without replacement: each draw from what is left, in proportion to its weight (what
    # torch.multinomial(replacement=False) draws, at a fraction of its cost over a large vocabulary).
    left = probs.clone()  # (V,)
    children = []
    for _ in range(k):
        children.append(sample(left, rng))
        left[children[-1]] = 0.0
    return children


class TreeGrowth:
    """One sequence's tree while the draft model grows it.

    Args:
        config: the tree's shape or budget and how children are drawn.
        depth: the deepest level to grow (<= config's depth, cut to the tokens left).
        sampling: the sequence's sampling settings (greedy takes top-k children).
        rng: the sequence's generator (sampled children draw from it).
        vocab_size: the target's vocabulary size; q rows are padded to it.
        constraint: the sequence's structured-output state (`constraints.ConstraintState`) or None: each node's
            children are drawn from the draft's q restricted to what the constraint allows after the node's path (any
            q is exact; a masked one is accepted more often).
    """

    def __init__(self, config: TreeConfig, depth: int, sampling: SamplingConfig, rng: torch.Generator,
                 vocab_size: int, constraint=None, costs: TreeCosts | None = None) -> None:
        self.config, self.max_depth, self.sampling, self.rng = config, depth, sampling, rng
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.mode = "top" if sampling.greedy else config.children
        # a dynamic tree's most nodes: its budget, or this step's (cut to the widest pass measured)
        self.budget = config.budget if costs is None else min(config.budget, costs.nodes)
        # with measured costs: the step's cost with n nodes, draft + target pass over n + 1 tokens, never
        # taken cheaper than a narrower pass (measurements are noisy); computed once per tree
        self.step_costs = (None if costs is None
                           else [costs.draft_cost + c for c in itertools.accumulate(costs.pass_costs, max)])
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.ranks: list[int] = []
        self.q_rows: list[torch.Tensor | None] = []  # (V,) the distribution each node was drawn from

    def width(self, parent: int) -> int:
        """How many children `parent` (-1: the root) gets."""
        depth = 0 if parent < 0 else self.depths[parent]
        return self.config.shape[depth] if self.config.shape is not None else self.config.top_k

    def path(self, node: int) -> list[int]:
        """Tokens from the root's child down to `node` (empty for the root)."""
        tokens = []
        while node >= 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def add_children(self, parent: int, logits: torch.Tensor, seen: torch.Tensor | None, copied: int | None = None) -> None:
        """Draw `parent`'s children from the draft's logits after it.

        logits: (V',) draft logits over target token ids; seen: what the penalties read there (`sampling.Seen`) or None.
        copied: the token that lookup first copies after `parent` (see `DraftModelDrafter`), or None. It
            becomes the first child with a one-hot q; with sampled children it is the only one (a node's
            sampled children all come from one q), with top-token children the draft's others follow it.
        """
        k = self.width(parent)
        if self.constraint is not None:  # children only where the constraint allows them, q restricted likewise
            allowed = self.constraint.allowed_after(self.path(parent))  # (V,) or None: the parent is forbidden
            if allowed is None:
                return
            allowed = allowed[: logits.shape[-1]].to(logits.device)  # (V',)
            masked = allow_only(logits, allowed)  # (V',) or None: nothing allowed that the draft can write
            if masked is None:
                return
            if copied is not None and (copied >= allowed.numel() or not bool(allowed[copied])):
                copied = None
            logits = masked
        if self.sampling.greedy:
            logits = penalise(logits[None], self.sampling, seen)  # (1, V')
            probs = torch.softmax(logits[0], dim=-1)  # (V',) only ranks the children
            tokens = probs.topk(min(k, probs.numel())).indices.tolist()
            best = int(logits[0].argmax())  # the chain's greedy token comes first, whatever the tie-break
            tokens = [best] + [t for t in tokens if t != best and probs[t] > 0][: k - 1]  # (> 0: what a mask allows)
        else:
            probs = logits_to_probs(logits[None], self.sampling, seen)[0]  # (V',)
            # with a copied token, sampled children make way for it; top-token children follow it
            tokens = draw_children(probs, k, self.mode, self.rng) if copied is None or self.mode == "top" else []
        if copied is not None:
            tokens = [copied] + [t for t in tokens if t != copied][: k - 1]
        sampled = not self.sampling.greedy and self.mode != "top"
        q_rows = [None] * len(tokens)  # (V,) each, what the child was drawn from; None: deterministic
        if sampled and copied is None:
            q_rows = [self._pad(probs)] * len(tokens)
        elif sampled:
            q_rows = [torch.nn.functional.one_hot(torch.tensor(copied), max(self.vocab_size, probs.numel())).to(probs)]
        top = probs.topk(len(tokens)).values.tolist()  # slot scores: by rank, never by the drawn token
        base = 1.0 if parent < 0 else self.scores[parent]
        depth = 1 if parent < 0 else self.depths[parent] + 1
        for rank, (token, q_row) in enumerate(zip(tokens, q_rows)):
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(base * top[rank])
            self.ranks.append(rank)
            self.q_rows.append(q_row)

    def to_expand(self, depth: int) -> list[int]:
        """Nodes of this depth whose children the draft evaluates next (none at the last depth)."""
        if depth >= self.max_depth:
            return []
        level = [i for i, d in enumerate(self.depths) if d == depth]
        if self.config.shape is None:
            level = sorted(level, key=lambda i: -self.scores[i])[: self.config.top_k]
            level = sorted(i for i in level if self._children_could_pay(i))
        return level

    def select(self) -> list[int]:
        """The nodes the tree keeps: all of a static tree; a dynamic tree's best `budget`, best first."""
        if self.config.shape is not None:
            return list(range(len(self.tokens)))
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(i)  # in rank order
        heap = [(-self.scores[c], c) for c in children.get(-1, [])[:1]]  # the root's first child
        kept: list[int] = []
        gain = 1.0  # expected tokens of the step: the recovered or bonus token, plus each kept node's score
        while heap and len(kept) < self.budget:
            _, node = heapq.heappop(heap)
            if not self._pays(node, gain, len(kept)):
                break
            gain += self.scores[node]
            kept.append(node)
            siblings = children[self.parents[node]]
            rank = self.ranks[node]
            for nxt in (siblings[rank + 1] if rank + 1 < len(siblings) else None, (children.get(node) or [None])[0]):
                if nxt is not None:
                    heapq.heappush(heap, (-self.scores[nxt], nxt))
        return sorted(kept)

    def _cost(self, n: int) -> float:
        """The step's cost with n tree nodes (`step_costs`; the costs cover `budget`)."""
        return self.step_costs[min(n, len(self.step_costs) - 1)]

    def _pays(self, node: int, gain: float, kept: int) -> bool:
        """With measured costs: does keeping `node` (the kept + 1-th) raise expected tokens per cost?
        That is (gain + s) * cost(kept) > gain * cost(kept + 1), s the node's score."""
        if self.step_costs is None:
            return True
        return (gain + self.scores[node]) * self._cost(kept) > gain * self._cost(kept + 1)

    def _children_could_pay(self, node: int) -> bool:
        """With measured costs: could any child of `node` ever be kept? Its score is at most the node's, and
        before it selection keeps (or stops at) every node scored above the node and the node itself: at
        least that many nodes and that much gain, so `_pays` needs a score above a bound known now.
        Not expanding such a node saves the draft the rows; the kept tree is the same."""
        if self.step_costs is None:
            return True
        score = self.scores[node]
        above = [s for i, s in enumerate(self.scores) if s > score or i == node]
        least_kept, least_gain = len(above), 1.0 + sum(above)
        if least_kept >= self.budget:
            return False
        need = min((self._cost(n + 1) - self._cost(n)) / self._cost(n) for n in range(least_kept, self.budget))
        return score > least_gain * need

    def finish(self) -> tuple[Draft, list[int]]:
        """The draft tree (breadth first, siblings in draw order) and, per new node, its index here."""
        kept = self.select()
        index = {old: new for new, old in enumerate(kept)}
        parents = [-1 if self.parents[i] < 0 else index[self.parents[i]] for i in kept]
        order, new_parents = breadth_first(parents, [self.ranks[i] for i in kept])
        nodes = [kept[i] for i in order]
        tokens = torch.tensor([self.tokens[i] for i in nodes], dtype=torch.long)  # (N,)
        siblings = "deterministic" if self.mode == "top" else self.mode
        q = torch.stack([self.q_rows[i] for i in nodes]) if siblings != "deterministic" and nodes else None  # (N, V)
        return Draft(tokens, q, tree=tree_from_parents(new_parents), siblings=siblings if nodes else "deterministic"), nodes

    def _pad(self, q: torch.Tensor) -> torch.Tensor:
        missing = self.vocab_size - q.shape[-1]
        return torch.nn.functional.pad(q, (0, missing)) if missing > 0 else q
