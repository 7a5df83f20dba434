"""The standard wrong verification rules, as drop-in replacements of the engine's verifiers.

Each mutant is `verispec.rejection.verify` (its chain rule and its tree walk) with one rule changed, installed
where the engine looks it up (`verispec.step.verify`) by `installed(name)`. An exactness test
that passes under a mutant has no power against that mistake: `tests/test_exactness_grid_power.py` requires every
mutant to fail the grid of every drafter family on every backend, and `benchmarks/exactness_mutants.py` prints
the table.

    accept q/p            accept x with min(1, q(x)/p(x)) instead of min(1, p(x)/q(x))
    residual p            draw a recovered token from p instead of normalize(max(0, p - q))
    residual |p-q|        normalize(|p - q|): the residual without its max(0, .)
    bonus from q          the bonus token drawn from the last draft's q instead of p_{n+1}
    bonus from p_n        the bonus token drawn from p at the last draft's position instead of the next one
    non-prefix            accept every draft that passes its own test, not only the prefix before the first failure
    tree inverted         a tree child accepted when its test fails (and rejected when it passes)
"""

from __future__ import annotations

import contextlib

import torch

from verispec import step as step_module
from verispec import rejection
from verispec.rejection import Verdict, residual_distribution
from verispec.sampling import sample


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[int(token)] = 1.0
    return q


def _chain(mutant: str):
    """verify() with the mutant's rule."""

    def verify(p, draft_tokens, q, rng, return_uniforms=False):
        n = draft_tokens.numel()
        idx = torch.arange(n)
        p_x = p[idx, draft_tokens]
        q_x = torch.ones_like(p_x) if q is None else q[idx, draft_tokens]
        u = torch.rand(n, generator=rng, device=rng.device)
        accepted = (u * p_x < q_x) if mutant == "accept q/p" else (u * q_x < p_x)
        if mutant == "non-prefix":
            num_accepted = int(accepted.sum()) if n else 0
        else:
            num_accepted = int(accepted.to(torch.int64).cumprod(dim=0).sum()) if n else 0
        if num_accepted == n:
            if mutant == "bonus from q" and n:
                final = q[n - 1] if q is not None else _one_hot(draft_tokens[n - 1], p[n])
            elif mutant == "bonus from p_n" and n:
                final = p[n - 1]
            else:
                final = p[n]
            verdict = Verdict(tuple(range(n)), sample(final, rng), bonus=True)
        else:
            i = num_accepted
            q_i = q[i] if q is not None else _one_hot(draft_tokens[i], p[i])
            verdict = Verdict(tuple(range(i)), sample(_residual(mutant, p[i], q_i), rng), bonus=False)
        return (verdict, u) if return_uniforms else verdict

    return verify


def _residual(mutant: str, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if mutant == "residual p":
        return p
    if mutant == "residual |p-q|":
        excess = (p - q).abs()
        return excess / excess.sum() if float(excess.sum()) > 1e-12 else p
    return residual_distribution(p, q)


def _tree(mutant: str):
    """verify_tree() with the mutant's rule (the walk of `rejection.walk_tree`, one line changed)."""

    def verify_tree(p, tree, tokens, q, siblings, rng, return_uniforms=False):
        u = torch.rand(tree.size, generator=rng, device=rng.device).cpu()
        path, node = [], -1
        while True:
            p_cur, q_cur, accepted = p[node + 1], None, None
            for child in tree.children[node + 1]:
                x = int(tokens[child])
                if q is None or siblings == "deterministic":
                    q_child = _one_hot(x, p_cur)
                elif siblings == "without_replacement":
                    q_child = q[child] if q_cur is None else q_cur
                else:
                    q_child = q[child]
                if mutant == "accept q/p":
                    ok = bool(u[child] * p_cur[x] < q_child[x])
                else:
                    ok = bool(u[child] * q_child[x] < p_cur[x])
                if mutant == "tree inverted":
                    ok = not ok
                if ok:
                    accepted = child
                    break
                p_cur = _residual(mutant, p_cur, q_child)
                if siblings == "without_replacement":
                    q_cur = rejection._without(q_child, x)
            if accepted is None:
                leaf = not tree.children[node + 1]
                if leaf and mutant == "bonus from p_n" and path:
                    parent = tree.parents[path[-1]]
                    p_cur = p[int(parent) + 1]  # the leaf's parent's distribution, not the leaf's
                if leaf and mutant == "bonus from q" and path and q is not None and siblings != "deterministic":
                    p_cur = q[path[-1]]
                elif leaf and mutant == "bonus from q" and path:
                    p_cur = _one_hot(int(tokens[path[-1]]), p_cur)
                verdict = Verdict(tuple(path), sample(p_cur, rng), bonus=leaf)
                return (verdict, u) if return_uniforms else verdict
            path.append(accepted)
            node = accepted

    return verify_tree


MUTANTS = ("accept q/p", "residual p", "residual |p-q|", "bonus from q", "bonus from p_n", "non-prefix",
           "tree inverted")
CHAIN_ONLY = {"non-prefix"}  # a tree's walk has no prefix to break: the rule is the tree's own
TREE_ONLY = {"tree inverted"}


@contextlib.contextmanager
def installed(mutant: str):
    """The engine verifies with this mutant inside the block: `verify` on a chain draft runs the chain rule with
    the mutant's change, on a tree draft the walk with it (a chain-only mutant leaves trees alone, a tree-only
    one chains)."""
    if mutant not in MUTANTS:
        raise ValueError(f"unknown mutant {mutant!r}")
    original = step_module.verify
    chain = _chain(mutant) if mutant not in TREE_ONLY else None
    tree = _tree(mutant) if mutant not in CHAIN_ONLY else None

    def verify(p, draft, rng, return_uniforms=False):
        if draft.is_chain and chain is not None:
            return chain(p, draft.tokens, draft.q, rng, return_uniforms)
        if not draft.is_chain and tree is not None:
            return tree(p, draft.tree, draft.tokens, draft.q, draft.siblings, rng, return_uniforms)
        return original(p, draft, rng, return_uniforms)

    step_module.verify = verify
    try:
        yield
    finally:
        step_module.verify = original
