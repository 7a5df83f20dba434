"""From logits to the distribution a token is sampled from.

One function, `logits_to_probs`, turns logits into probabilities under a `SamplingConfig`, and
one, `sample`, draws a token from them (every recovered, bonus and sampled draft token).
The engine calls `logits_to_probs` on the target's logits (giving p) and on the draft's logits (giving q),
so both sides of verification see the same processing: repetition penalty, temperature,
top-k, top-p, min-p, in that order (the order Hugging Face applies them).

Temperature 0 is greedy: `greedy_tokens` takes the argmax of the (penalised) logits.
Everything is computed in float32 whatever the model's dtype.

No setting overflows into NaN: a penalised logit past float32's range is held at its largest finite value,
and temperature divides the logits after their maximum is subtracted, so a tiny temperature (1e-40, or
5e-324 which is 0 in float32) makes the distribution one-hot at the argmax instead of inf / inf. Logits that
are NaN or +inf (a broken model) are refused with a ValueError rather than sampled from.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingConfig


def seen_masks(context: torch.Tensor, continuation: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which tokens the repetition penalty applies to, at each position of a continuation.

    Position i sees the context plus continuation[:i], exactly what autoregressive decoding
    would have seen when it produced the token at that position.

    Args:
        context: (T,) token ids already committed.
        continuation: (n,) draft token ids.
        vocab_size: V.
    Returns:
        (n + 1, V) bool mask.
    """
    base = torch.zeros(vocab_size, dtype=torch.bool, device=context.device)  # (V,)
    base[context] = True
    masks = base.expand(continuation.numel() + 1, vocab_size).clone()  # (n+1, V)
    for i in range(continuation.numel()):
        masks[i + 1 :, continuation[i]] = True
    return masks


def tree_seen_masks(context: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`seen_masks` for a draft tree: the root sees the context, node i the context and its path.

    Args:
        context: (T,) token ids already committed.
        tokens: (N,) node tokens; parents: (N,) parent node (-1: the root), parents first.
    Returns:
        (N + 1, V) bool mask: row 0 at the root, row i + 1 after node i.
    """
    masks = torch.zeros(tokens.numel() + 1, vocab_size, dtype=torch.bool, device=context.device)  # (N+1, V)
    masks[0, context] = True
    for i in range(tokens.numel()):
        masks[i + 1] = masks[int(parents[i]) + 1]
        masks[i + 1, tokens[i]] = True
    return masks


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL repetition penalty: seen tokens' logits are divided (if > 0) or multiplied (if < 0).

    Args:
        logits: (N, V).
        seen: (N, V) bool.
    Returns:
        (N, V) penalised logits.
    """
    if penalty == 1.0:
        return logits
    seen = seen.to(logits.device)  # masks are built on the host; the logits may be on a GPU
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # (N, V)
    penalised = penalised.clamp(max=torch.finfo(penalised.dtype).max)  # a tiny penalty: largest finite, not inf
    return torch.where(seen, penalised, logits)


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) -> (N, 1) each row's largest logit, refusing logits no distribution can be made from: NaN anywhere
    (the maximum propagates it), +inf (a model that overflowed), or a row that is -inf everywhere."""
    top = logits.amax(dim=-1, keepdim=True)  # (N, 1)
    if not bool(torch.isfinite(top).all()):
        if bool(torch.isnan(top).any()):
            raise ValueError("the model's logits hold NaN: no distribution can be made from them")
        if bool((top == float("inf")).any()):
            raise ValueError("the model's logits hold +inf: no distribution can be made from them")
        raise ValueError("a row of logits is -inf everywhere: no token is possible")
    return top


def greedy_tokens(logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax tokens (temperature 0). logits: (N, V) -> (N,) long."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    _row_max(logits)
    return logits.argmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed probabilities for sampling (temperature > 0).

    Args:
        logits: (N, V) raw model logits, any float dtype.
        config: the sampling settings; must not be greedy.
        seen: (N, V) bool, tokens the repetition penalty applies to (None: no penalty).
    Returns:
        (N, V) float32 probabilities, each row summing to 1.
    """
    if config.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; use greedy_tokens for temperature 0")
    logits = logits.float()  # (N, V)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    # (l - max) / T <= 0: never overflows, however small T; entries below the max go to -inf as T -> 0
    temperature = max(config.temperature, torch.finfo(logits.dtype).tiny)  # 5e-324 is 0 in float32: 0 / 0
    logits = (logits - _row_max(logits)) / temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (N, V)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (N, V)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (N, V)
        drop_sorted = mass_before >= config.top_p  # the top token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if config.min_p > 0.0:
        floor = config.min_p * probs.max(dim=-1, keepdim=True).values  # (N, 1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


SAMPLE_BLOCK = 1024  # ids per block of the two-level inverse CDF in `sample`


def sample(probs: torch.Tensor, rng: torch.Generator) -> int:
    """One token id drawn from probs: (V,) nonnegative weights (normalised or not, total > 0).

    Inverse CDF in float64, in two levels: a block of SAMPLE_BLOCK ids by the blocks' cumulative mass,
    then an id within it. One float64 uniform is taken from rng, and an id of probability 0 is never
    returned. It draws what torch.multinomial draws (with float64 rather than float32 sums), at a
    fraction of the cost over a large vocabulary: one draw over Qwen's 151,936 ids took 3.1 ms with
    torch.multinomial here (a tenth of a llama.cpp pass of the 1.5B target) and 0.11 ms this way.
    """
    pad = (-probs.numel()) % SAMPLE_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(-1, SAMPLE_BLOCK)  # (nb, SAMPLE_BLOCK)
    block_cdf = blocks.sum(dim=1, dtype=torch.float64).cumsum(0)  # (nb,)
    total = float(block_cdf[-1])
    if not total > 0.0 or total == float("inf"):
        raise ValueError(f"cannot sample from weights whose total is {total}")
    u = float(torch.rand((), generator=rng, dtype=torch.float64, device=rng.device)) * total  # uniform on [0, total)
    b = _first_above(block_cdf, u)
    below = float(block_cdf[b - 1]) if b > 0 else 0.0  # mass of the blocks before b (<= u)
    inner_cdf = blocks[b].cumsum(0, dtype=torch.float64)  # (SAMPLE_BLOCK,)
    return b * SAMPLE_BLOCK + _first_above(inner_cdf, u - below)


def _first_above(cdf: torch.Tensor, x: float) -> int:
    """The first index whose cdf (K,) float64 exceeds x >= 0: one with positive mass. Where rounding puts x
    at or past the end (the two levels' sums differ in their last bits), the last index with positive mass."""
    i = int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64, device=cdf.device), right=True))
    if i < cdf.numel():
        return i
    mass = torch.diff(cdf, prepend=cdf.new_zeros(1))  # (K,)
    return int((mass > 0).nonzero().max())


class Processors:
    """One sequence's processor chain, built once from its `SamplingConfig` (`Sequence.processors`): repetition
    penalty -> temperature / top-k / top-p / min-p -> a greedy or a sampled draw. (A structured-output constraint
    masks the logits before the chain: `constraints.apply_constraint` for p, `drafters.drawing.constrained_logits`
    for q.) The verifier (for p) and every drafter that draws from logits (for q) go through it, so the greedy
    branch and the penalty's seen-mask are decided here, once.
    """

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.greedy = config.greedy  # temperature 0: argmax on both sides, q None
        self.penalised = config.repetition_penalty != 1.0

    def seen(self, tokens: list[int], vocab: int) -> torch.Tensor | None:
        """(1, V) the tokens the penalty applies to after `tokens` (a context, with drafts after it); None without a
        penalty."""
        if not self.penalised:
            return None
        context = torch.tensor(tokens, dtype=torch.long)  # (T,)
        return seen_masks(context, context[:0], vocab)

    def seen_rows(self, context: list[int], tokens: torch.Tensor, parents: torch.Tensor | None,
                  vocab: int) -> torch.Tensor | None:
        """(N + 1, V) the penalty's tokens at the root and after each of a draft's N nodes (`parents` None: a chain);
        None without a penalty."""
        if not self.penalised:
            return None
        committed = torch.tensor(context, dtype=torch.long)  # (T,)
        return (seen_masks(committed, tokens, vocab) if parents is None else
                tree_seen_masks(committed, tokens, parents, vocab))

    def target(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """The target's rows as verification reads them: (N, V) logits -> (N,) argmax when greedy, else (N, V) p."""
        return greedy_tokens(logits, self.config, seen) if self.greedy else logits_to_probs(logits, self.config, seen)

    def propose(self, logits: torch.Tensor, seen: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
        """A draft position from (1, V) logits: (the argmax, None) when greedy, else (-1, q) with q (V,) the
        distribution to draw it from (`draw`, or `sample` once the drafter decides to go on)."""
        if self.greedy:
            return int(greedy_tokens(logits, self.config, seen)[0]), None
        return -1, logits_to_probs(logits, self.config, seen)[0]

    def draw(self, logits: torch.Tensor, seen: torch.Tensor | None,
             rng: torch.Generator) -> tuple[int, torch.Tensor | None]:
        """A draft token from (1, V) logits: the argmax when greedy (q None), else a sample from q and q (V,)."""
        token, q = self.propose(logits, seen)
        return (token, None) if q is None else (sample(q, rng), q)
