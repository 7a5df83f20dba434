"""Speculative sampling: the verification rule of Leviathan et al. (2023) and Chen et al. (2023).

Notation follows the papers. For one sequence and one step:

    p_i  target distribution at draft position i (after the same sampling processing as q)
    q_i  draft distribution that draft token x_i was sampled from
    x_i  draft token, i = 1..n

Walk the drafts in order. Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)).
At the first rejection, emit a *recovered* token sampled from the residual
normalize(max(0, p_i - q_i)) and discard the remaining drafts. If all n drafts are accepted,
emit a *bonus* token sampled from p_{n+1}. Output tokens = accepted + (recovered or bonus).

Why this is exact: for any token y,
    P(y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * residual(y)
         = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y).

A deterministic drafter (prompt lookup, n-grams) has a one-hot q; it goes through the same
rule with q(x_i) = 1, so acceptance is p_i(x_i) and the residual is p_i without x_i.

At temperature 0 the rule reduces to: accept while x_i equals argmax p_i, then emit argmax.

Trees (`verify` on a tree draft). A node's children are candidates for the token after it. Walk from the root;
at each node try its children one after another, each against the current pair (p, q):

    accept child x with probability min(1, p(x) / q(x)), go down to x and start again with p at x;
    on rejection p <- normalize(max(0, p - q)) (`residual_distribution`) and try the next child;
    when every child is rejected, emit a recovered token sampled from the current p;
    at a leaf reached by accepting, emit a bonus token sampled from p at the leaf.

The q each child is checked against is the distribution it was really drawn from:
  - children drawn i.i.d. from q (with replacement): q stays the same for every child. This is
    SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer: Accelerating Large
    Language Model Serving with Tree-based Speculative Inference and Verification").
  - children drawn without replacement from q: after rejecting x, q <- normalize(q with x removed).
    This is recursive rejection sampling (Jeon et al. 2024, "Recursive Speculative Decoding:
    Accelerating LLM Inference via Sampling Without Replacement"). SpecInfer's fixed q would be wrong
    here: a later child can never repeat x, so it is not a draw from q (a test shows the bias).
    Without replacement no two children are the same token, which makes a wider tree worth more.
  - deterministic candidates (prompt lookup tries, top-k children): q is one-hot at the candidate,
    so x is accepted with probability p(x) and on rejection x is removed from p, as in a chain.
Why it is exact: each round is one exact speculative-sampling step, whose rejection branch must
produce normalize(max(0, p - q)); the rest of the walk is the same procedure with that residual as
its target, so by induction on the children left it samples its target exactly, whatever the next
child's distribution, provided (a) the next child is drawn from the q it is checked against, given
the children before it, and (b) whether a child is tried at all does not depend on its own value or
on anything drawn after it. Drafters that prune trees respect (b); see `verispec.drafters.tree_growth`.
A rejected x had p(x) <= q(x), so no residual gives it mass again.

Randomness: one uniform per node is drawn up front (node i uses u[i] when it is tried) and one
categorical draw at the end. A chain is the tree (1, ..., 1), and `verify` takes a vectorized path for it
(every ratio at once, then a cumulative product) that makes the same draws and the same verdict as the walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling import sample
from verispec.tree import Draft, Tree


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one sequence's draft in one step.

    path: the accepted nodes from the root's child down (node indices, increasing); () if none. For a chain
        these are its first `num_accepted` drafts, (0, 1, ..., num_accepted - 1).
    token: the recovered token (the children of the path's last node were all rejected) or the bonus token
        (the path ends at a leaf: for a chain, every draft was accepted).
    bonus: True when the path ends at a leaf and `token` came from p there.
    """

    path: tuple[int, ...]
    token: int
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for every token x, 0 where q(x) = 0. p, q: (..., V) -> (..., V)."""
    ratio = p / q.clamp_min(torch.finfo(p.dtype).tiny)
    return torch.where(q > 0, ratio.clamp(max=1.0), torch.zeros_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)), the distribution a recovered token is sampled from.

    Where p == q (up to rounding) the residual is empty; rejection then has probability 0 in
    exact arithmetic, and p itself is returned so that a rounding-induced rejection still
    samples from the target.

    p, q: (..., V) -> (..., V)
    """
    excess = (p - q).clamp_min(0.0)  # (..., V)
    mass = excess.sum(dim=-1, keepdim=True)  # (..., 1)
    empty = mass <= 1e-12
    return torch.where(empty, p, excess / torch.where(empty, torch.ones_like(mass), mass))


def verify(
    p,
    draft: Draft,
    rng: torch.Generator,
    return_uniforms: bool = False,
) -> Verdict | tuple[Verdict, torch.Tensor]:
    """Speculative sampling for one sequence's draft, a chain or a tree (rules: module docstring).

    Args:
        p: (N + 1, V) target probabilities: p[0] at the root, p[i + 1] after node i, or anything whose p[i] gives
            that (V,) row and whose `device` is where they are (the engine makes only the rows the walk reaches: a
            chain's then takes the walk too).
        draft: the N nodes' tokens, the tree (children tried in the order of `tree.children`), the q each token was
            drawn from (None: deterministic, one-hot) and how siblings were drawn.
        rng: this sequence's generator; N uniforms and one categorical draw are taken from it.
        return_uniforms: also return the N uniforms (node i was accepted iff it was tried and
            u[i] < p(x)/q(x); `walk_tree` with them gives the same path), for tracing; the draws and
            the verdict are the same either way. Default False.
    Returns:
        The Verdict, or (Verdict, u) with u: (N,) when return_uniforms is True.
    """
    if draft.is_chain and isinstance(p, torch.Tensor):
        return _verify_chain(p, draft.tokens, draft.q, rng, return_uniforms)
    # a tree, or a chain whose rows are made on demand: the walk (the same draws as the chain's path, and on the
    # same p the same verdict) reads the root and each accepted node's row only
    tree, q = draft.tree, draft.q
    u = torch.rand(tree.size, generator=rng, device=rng.device).cpu()  # (N,) read one by one on the host
    if q is not None:
        q = q.to(p.device)  # a draft made on the host, verified where p is (a GPU)
    path, final, leaf = walk_tree(p, tree, draft.tokens, q, draft.siblings, u)
    verdict = Verdict(path, sample(final, rng), bonus=leaf)
    return (verdict, u) if return_uniforms else verdict


def _verify_chain(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    rng: torch.Generator,
    return_uniforms: bool,
) -> Verdict | tuple[Verdict, torch.Tensor]:
    """`verify` for a chain x_1..x_n, every ratio at once.

    Args:
        p: (n + 1, V) target probabilities at each draft position, plus the bonus position.
        draft_tokens: (n,) draft tokens x_1..x_n.
        q: (n, V) draft probabilities, or None for a deterministic (one-hot) drafter.
    """
    n = draft_tokens.numel()
    draft_tokens = draft_tokens.to(p.device)  # a draft made on the host, verified where p is (a GPU)
    q = q.to(p.device) if q is not None else None
    idx = torch.arange(n, device=p.device)
    p_x = p[idx, draft_tokens]  # (n,)
    q_x = torch.ones_like(p_x) if q is None else q[idx, draft_tokens]  # (n,)
    u = torch.rand(n, generator=rng, device=rng.device).to(p.device)  # (n,)
    accepted = u * q_x < p_x  # (n,)  <=>  u < p/q, without dividing
    num_accepted = int(accepted.to(torch.int64).cumprod(dim=0).sum()) if n else 0
    path = tuple(range(num_accepted))
    if num_accepted == n:
        verdict = Verdict(path, sample(p[n], rng), bonus=True)
    else:
        i = num_accepted
        if q is None:
            q_i = torch.zeros_like(p[i])
            q_i[draft_tokens[i]] = 1.0  # (V,) one-hot
        else:
            q_i = q[i]
        recovered = sample(residual_distribution(p[i], q_i), rng)
        verdict = Verdict(path, recovered, bonus=False)
    return (verdict, u) if return_uniforms else verdict


def verify_greedy(target_argmax: torch.Tensor, draft: Draft) -> Verdict:
    """Temperature 0: from the root, follow the child equal to the target's argmax; emit the argmax where none is.
    For a chain: accept while x_i == argmax p_i, then emit argmax p at the stop position.

    Args:
        target_argmax: (N + 1,) argmax of the target at the root and after each node.
        draft: N nodes (q is not read).
    """
    tokens = draft.tokens.tolist()  # N ints, on the host
    best_of = target_argmax.tolist()  # N + 1 ints: one read of the device, the pass's only sync here
    if draft.is_chain:
        n = len(tokens)
        num_accepted = next((i for i in range(n) if tokens[i] != best_of[i]), n)
        return Verdict(tuple(range(num_accepted)), best_of[num_accepted], bonus=num_accepted == n)
    tree = draft.tree
    path: list[int] = []
    node = -1
    while True:
        best = best_of[node + 1]
        nxt = next((c for c in tree.children[node + 1] if tokens[c] == best), None)
        if nxt is None:
            return Verdict(tuple(path), best, bonus=not tree.children[node + 1])
        path.append(nxt)
        node = nxt


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)  # (V,)
    q[token] = 1.0
    return q


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """q with `token` removed, renormalized: the distribution of the next draw without replacement. (V,) -> (V,)"""
    rest = q.clone()  # (V,)
    rest[token] = 0.0
    mass = rest.sum()
    return rest / mass if mass > 0 else rest


@dataclass(frozen=True)
class TreeTry:
    """One child tried by the tree walk (for tracing): its token was checked against this pair.

    node: the child's node index.
    p: (V,) the target at its parent, or the residual left there by the siblings rejected before it.
    q: (V,) the distribution the child is checked against (one-hot for deterministic candidates).
    accepted: whether u[node] * q(x) < p(x).
    """

    node: int
    p: torch.Tensor
    q: torch.Tensor
    accepted: bool


def walk_tree(
    p: torch.Tensor,
    tree: Tree,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    siblings: str,
    u: torch.Tensor,
    tries: list[TreeTry] | None = None,
) -> tuple[tuple[int, ...], torch.Tensor, bool]:
    """The deterministic part of `verify` on a tree: the walk from the root given the uniforms.

    Args: as `verify` (its draft's tree, tokens, q and siblings), with u: (N,) the uniforms (node i reads u[i]
        only if it is tried).
        tries: if a list, every tried child is appended to it as a TreeTry, in the order tried.
    Returns:
        (path, final, leaf): the accepted path, the (V,) distribution the last token is drawn from
        (the residual after the children of the path's end were all rejected, or p at a leaf), and
        whether the path ends at a leaf (then that token is the bonus token).
    """
    path: list[int] = []
    node = -1
    while True:
        p_cur = p[node + 1]  # (V,) the target at this node, then its residuals
        q_cur: torch.Tensor | None = None  # (V,) without replacement: what the next child is drawn from
        accepted = None
        for child in tree.children[node + 1]:
            x = int(tokens[child])
            if q is None or siblings == "deterministic":
                q_child = _one_hot(x, p_cur)  # (V,)
            elif siblings == "without_replacement":
                q_child = q[child] if q_cur is None else q_cur
            else:
                q_child = q[child]
            ok = bool(u[child] * q_child[x] < p_cur[x])  # u < p(x)/q(x), without dividing
            if tries is not None:
                tries.append(TreeTry(child, p_cur, q_child, ok))
            if ok:
                accepted = child
                break
            p_cur = residual_distribution(p_cur, q_child)
            if siblings == "without_replacement":
                q_cur = _without(q_child, x)
        if accepted is None:
            return tuple(path), p_cur, not tree.children[node + 1]
        path.append(accepted)
        node = accepted
