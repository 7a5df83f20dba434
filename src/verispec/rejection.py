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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one sequence's drafts in one step.

    num_accepted: how many leading drafts were accepted (0..n).
    token: the recovered token (if a draft was rejected) or the bonus token (if none was).
    bonus: True when all drafts were accepted and `token` came from p_{n+1}.
    """

    num_accepted: int
    token: int
    bonus: bool


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
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    rng: torch.Generator,
    return_uniforms: bool = False,
) -> Verdict | tuple[Verdict, torch.Tensor]:
    """Speculative sampling for one sequence.

    Args:
        p: (n + 1, V) target probabilities at each draft position, plus the bonus position.
        draft_tokens: (n,) draft tokens x_1..x_n.
        q: (n, V) draft probabilities, or None for a deterministic (one-hot) drafter.
        rng: this sequence's generator; n uniforms and one categorical draw are taken from it.
        return_uniforms: also return the n uniforms u_i (x_i was accepted iff u_i < p_i/q_i), for
            tracing; the draws and the verdict are the same either way. Default False.
    Returns:
        The Verdict, or (Verdict, u) with u: (n,) when return_uniforms is True.
    """
    n = draft_tokens.numel()
    idx = torch.arange(n)
    p_x = p[idx, draft_tokens]  # (n,)
    q_x = torch.ones_like(p_x) if q is None else q[idx, draft_tokens]  # (n,)
    u = torch.rand(n, generator=rng)  # (n,)
    accepted = u * q_x < p_x  # (n,)  <=>  u < p/q, without dividing
    num_accepted = int(accepted.to(torch.int64).cumprod(dim=0).sum()) if n else 0
    if num_accepted == n:
        verdict = Verdict(n, int(torch.multinomial(p[n], 1, generator=rng)), bonus=True)
    else:
        i = num_accepted
        if q is None:
            q_i = torch.zeros_like(p[i])
            q_i[draft_tokens[i]] = 1.0  # (V,) one-hot
        else:
            q_i = q[i]
        recovered = int(torch.multinomial(residual_distribution(p[i], q_i), 1, generator=rng))
        verdict = Verdict(num_accepted, recovered, bonus=False)
    return (verdict, u) if return_uniforms else verdict


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Temperature 0: accept while x_i == argmax p_i, then emit argmax p at the stop position.

    Args:
        target_argmax: (n + 1,) argmax of the target's logits at each position.
        draft_tokens: (n,).
    """
    n = draft_tokens.numel()
    matches = (draft_tokens == target_argmax[:n]).to(torch.int64)  # (n,)
    num_accepted = int(matches.cumprod(dim=0).sum()) if n else 0
    return Verdict(num_accepted, int(target_argmax[num_accepted]), bonus=num_accepted == n)
