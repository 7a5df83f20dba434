"""Drawing a draft token the way the target's would be drawn: shared by the drafters that sample from logits."""

from __future__ import annotations

import torch

from verispec.core.sequence import Sequence
from verispec.sampling import Seen


def penalty_seen(seq: Sequence, drafted: list[int], vocab: int) -> Seen | None:
    """What the penalties read after the context and these drafts (one row, `sampling.Seen`); None without one."""
    return seq.processors.seen(seq.tokens + drafted, vocab)


def constrained_logits(logits: torch.Tensor, seq: Sequence, drafted: list[int]) -> torch.Tensor | None:
    """A draft's (1, V') logits (V' <= the target's V) restricted like the target's p to what the row's structured-output
    constraint allows after its answer and `drafted` (no constraint: as they are); None where nothing the draft can
    write is allowed there (its chain ends). Masking q is not needed for exactness (any q is exact); it makes the
    drafts the target accepts more likely."""
    if seq.constraint is None:
        return logits
    allowed = seq.constraint.allowed_after(drafted)  # (V,)
    return None if allowed is None else allow_only(logits, allowed)


def allow_only(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor | None:
    """(..., V') draft logits at -inf wherever `allowed` (V,) forbids; None where no token the draft can write is left:
    none allowed, or none of the allowed with a finite logit (a draft whose head keeps only some ids, a cut head or
    an EAGLE head's vocabulary, gives the others -inf; drawing from that row would fail)."""
    allowed = allowed[: logits.shape[-1]].to(logits.device)  # (V',)
    if not bool(allowed.any()):
        return None
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    return masked if bool((masked > float("-inf")).any()) else None


def draw_token(logits: torch.Tensor, seq: Sequence, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
    """A chain's next draft token from a head's (1, V) logits after `drafted`, processed like the target's
    (temperature, top-k, top-p, repetition penalty): the argmax when greedy (q None), else a sample and its q (V,).
    Callers restrict the logits to a constraint first (`constrained_logits`)."""
    return seq.processors.draw(logits, penalty_seen(seq, drafted, logits.shape[-1]), seq.rng)
