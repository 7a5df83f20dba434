"""Drafts: trees of candidate continuations of one sequence, verified in one target pass.

Every draft is a tree (`Draft`); a chain of n tokens is the tree of shape (1, ..., 1), made by default, so the
engine, the verifier, the drafters and the runners speak one type and take one path. Where a chain can be
handled faster (the verifier's vectorized walk, a runner's causal pass), that is decided inside them.

A tree's root is the sequence's last committed token (it is not a node). Nodes 0..N-1 are candidate
tokens; node i continues the text of its parent (`parents[i]`, -1 for the root). Nodes are numbered in
topological order (a parent's index is smaller than its children's), so a root-to-leaf path is
increasing in index, and siblings are numbered in the order the verifier tries them.

The target reads a tree in one pass: node i sits at position (committed length + depth_i - 1) and
attends to the committed prefix, to its ancestors and to itself (`Tree.ancestors`), so its logits
equal those of the chain root -> ... -> i. A `Tree` depends only on `parents` and is built once per
shape (`tree_from_parents` is cached).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from verispec.errors import VerispecError

SIBLINGS = ("iid", "without_replacement", "deterministic")


@dataclass(frozen=True)
class TreeCosts:
    """One step's measured costs for a row's dynamic tree (from an auto-tuner's `tuning.CostProfile`), given to the
    drafter with the row's `TreeConfig`, never written into it: the configuration is the user's, these change
    every step.

    Nodes are kept best first only while each raises the expected tokens per step cost,
    (1 + sum of kept scores) / (draft_cost + pass_costs[n]) (`drafters.tree_growth`).

    Attributes:
        nodes: the most nodes this step: the tree's budget, cut to the widest pass that was measured.
        pass_costs: pass_costs[n], the cost of a target pass over n + 1 tokens relative to one token (n = 0..nodes).
        draft_cost: the step's draft cost in the same unit. Default 0.
    """

    nodes: int
    pass_costs: tuple[float, ...]
    draft_cost: float = 0.0

    def __post_init__(self) -> None:
        costs = tuple(float(c) for c in self.pass_costs)
        if not all(math.isfinite(c) and c > 0 for c in costs) or self.nodes < 1 or len(costs) <= self.nodes:
            raise VerispecError("tree costs need positive relative costs of target passes over 1, 2, ..., nodes + 1 "
                                f"tokens (nodes >= 1), got {self.nodes} nodes and {len(costs)} costs")
        if not (math.isfinite(self.draft_cost) and self.draft_cost >= 0):
            raise VerispecError(f"draft_cost must be >= 0, got {self.draft_cost}")
        object.__setattr__(self, "pass_costs", costs)


@dataclass(frozen=True, eq=False)
class Tree:
    """The structure of a draft tree (no tokens).

    parents: (N,) long, parent node of each node, -1 for the root's children.
    depths: (N,) long, 1 for the root's children; position offset of node i = depths[i] - 1.
    ancestors: (N, N) bool, ancestors[i, j] is True when node j is node i or one of its ancestors
        (what node i attends to among the nodes).
    children: N + 1 tuples: children[0] are the root's children, children[i + 1] node i's, in order.
    """

    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    children: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return int(self.parents.numel())

    @cached_property
    def is_chain(self) -> bool:
        """Whether every node is the only child of the node before it: the tree of shape (1, ..., 1)."""
        return tuple(self.parents.tolist()) == chain_parents(self.size)

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path (0 for an empty tree)."""
        return int(self.depths.max()) if self.size else 0

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


@lru_cache(maxsize=512)
def tree_from_parents(parents: tuple[int, ...]) -> Tree:
    """The Tree for these parent indices (-1: the root). Raises ValueError unless parents[i] < i."""
    n = len(parents)
    depths = [0] * n
    ancestors = torch.zeros(n, n, dtype=torch.bool)  # (N, N)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must come before their children")
        depths[i] = 1 if parent < 0 else depths[parent] + 1
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True
        children[parent + 1].append(i)
    return Tree(
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        ancestors=ancestors,
        children=tuple(tuple(c) for c in children),
    )


def static_parents(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of the full tree with branching factor shape[d] at depth d + 1, breadth first.

    (3, 2) gives 3 children of the root, then 2 children of each: 9 nodes.
    """
    parents: list[int] = []
    level = [-1]
    for width in shape:
        next_level = []
        for node in level:
            for _ in range(width):
                next_level.append(len(parents))
                parents.append(node)
        level = next_level
    return tuple(parents)


def static_size(shape: tuple[int, ...]) -> int:
    """Number of nodes of the full tree of this shape: b1 + b1 b2 + b1 b2 b3 + ..."""
    total, width = 0, 1
    for b in shape:
        width *= b
        total += width
    return total


def breadth_first(parents: list[int], order_keys: list) -> tuple[list[int], tuple[int, ...]]:
    """Renumber a tree breadth first, siblings by `order_keys`.

    Args:
        parents: parent of each node in any order where parents come first (-1: the root).
        order_keys: a sort key per node; siblings are tried in increasing key order.
    Returns:
        (order, new_parents): order[k] is the old index of new node k; new_parents in new indices.
    """
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    order: list[int] = []
    new_index = {-1: -1}
    frontier = [-1]
    while frontier:
        next_frontier = []
        for node in frontier:
            for child in sorted(children[node + 1], key=lambda c: order_keys[c]):
                new_index[child] = len(order)
                order.append(child)
                next_frontier.append(child)
        frontier = next_frontier
    return order, tuple(new_index[parents[i]] for i in order)


def chain_parents(n: int) -> tuple[int, ...]:
    """The parents of a chain of n nodes, the tree of shape (1, ..., 1): (-1, 0, 1, ..., n - 2)."""
    return tuple(range(-1, n - 1))


@lru_cache(maxsize=64)
def chain_tree(n: int) -> Tree:
    """The Tree of a chain of n nodes."""
    return tree_from_parents(chain_parents(n))


@dataclass(frozen=True)
class Draft:
    """One sequence's draft for one step: a tree of candidate tokens, a chain being its degenerate case.

    tokens: (N,) long candidate tokens, node i's token (N may be 0).
    q: (N, V) float32: row i is the draft distribution node i's token was drawn from (its parent's
       distribution, so siblings share it), or None for deterministic candidates (one-hot q) and greedy.
    tree: the structure (parents, depths, ancestor mask, children in try order); None (the default) makes
       the chain x_1 -> ... -> x_N (`chain_tree`).
    siblings: how a node's children were drawn from q: "iid" (independently, with replacement),
       "without_replacement" (one after another, each excluding the earlier ones), or "deterministic";
       None (the default) is "deterministic" when q is None and "iid" otherwise (a chain's nodes have one
       child each, so "iid" and "without_replacement" are the same rule there).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    tree: Tree | None = None
    siblings: str | None = None

    def __post_init__(self) -> None:
        if self.tree is None:
            object.__setattr__(self, "tree", chain_tree(int(self.tokens.numel())))
        if self.siblings is None:
            object.__setattr__(self, "siblings", "deterministic" if self.q is None else "iid")
        if self.siblings not in SIBLINGS:
            raise ValueError(f"siblings must be one of {SIBLINGS}, got {self.siblings!r}")
        if self.tokens.numel() != self.tree.size:
            raise ValueError("a draft needs one token per node")
        if (self.q is None) != (self.siblings == "deterministic") and self.tree.size:
            raise ValueError("q is None exactly when the candidates are deterministic")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        """Whether the nodes form one chain (then verification takes the chain's vectorized path)."""
        return self.tree.is_chain

    def path_tokens(self, path: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(self.tokens[i]) for i in path)


EMPTY_DRAFT = Draft(torch.zeros(0, dtype=torch.long))
