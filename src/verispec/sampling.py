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

from dataclasses import dataclass

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


def answer_counts(answer: torch.Tensor, continuation: torch.Tensor, vocab_size: int,
                  parents: torch.Tensor | None = None) -> torch.Tensor:
    """How often each token occurs in the answer at each position of a continuation (presence / frequency penalties).

    Args:
        answer: (T,) the tokens generated so far (not the prompt).
        continuation: (n,) draft tokens; parents: (n,) each node's parent (-1: the root) for a tree, None for a chain.
    Returns:
        (n + 1, V) float32: row 0 at the root, row i + 1 after draft token i (its path's tokens counted).
    """
    base = torch.zeros(vocab_size, dtype=torch.float32)  # (V,)
    base.index_add_(0, answer.long(), torch.ones(answer.numel()))
    counts = base.expand(continuation.numel() + 1, vocab_size).clone()  # (n + 1, V)
    for i in range(continuation.numel()):
        if parents is None:
            counts[i + 1 :, continuation[i]] += 1
        else:
            counts[i + 1] = counts[int(parents[i]) + 1]
            counts[i + 1, continuation[i]] += 1
    return counts


@dataclass(frozen=True)
class Seen:
    """What the history penalties read at each of N rows: `mask` (N, V) bool, the tokens of the context so far (the
    repetition penalty); `counts` (N, V) float32, each token's occurrences in the answer so far (presence and frequency
    penalties). Either is None where no penalty reads it. seen[i : j] -> those rows."""

    mask: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    def __getitem__(self, rows: slice) -> Seen:
        return Seen(None if self.mask is None else self.mask[rows], None if self.counts is None else self.counts[rows])


def penalise(logits: torch.Tensor, config: SamplingConfig, seen: Seen | torch.Tensor | None) -> torch.Tensor:
    """The logits every setting sees before temperature: logit bias, then the repetition penalty (seen.mask), then the
    presence and frequency penalties (seen.counts). logits: (N, V') any float dtype (V' <= V: a draft's smaller
    vocabulary; bias and counts past it are ignored); seen: a Seen, a bare (N, V) repetition mask, or None.
    Returns (N, V') float32."""
    logits = logits.float()
    width = logits.shape[-1]
    if config.logit_bias:
        ids = [t for t, _ in config.logit_bias if t < width]
        if ids:
            bias = torch.tensor([b for t, b in config.logit_bias if t < width], device=logits.device)  # (k,)
            logits = logits.clone()
            logits[:, ids] += bias
    if seen is None:
        return logits
    if isinstance(seen, torch.Tensor):
        seen = Seen(mask=seen)
    if seen.mask is not None:
        logits = apply_repetition_penalty(logits, seen.mask[:, :width], config.repetition_penalty)
    if seen.counts is not None and (config.presence_penalty or config.frequency_penalty):
        counts = seen.counts[:, :width].to(logits.device)  # (N, V')
        logits = logits - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).float()
    return logits


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


def greedy_tokens(logits: torch.Tensor, config: SamplingConfig, seen: Seen | torch.Tensor | None = None) -> torch.Tensor:
    """Argmax tokens (temperature 0) of the penalised logits (`penalise`). logits: (N, V) -> (N,) long."""
    logits = penalise(logits, config, seen)
    _row_max(logits)
    return logits.argmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig, seen: Seen | torch.Tensor | None = None) -> torch.Tensor:
    """Processed probabilities for sampling (temperature > 0).

    Args:
        logits: (N, V) raw model logits, any float dtype.
        config: the sampling settings; must not be greedy.
        seen: what the history penalties read (`Seen`, or a bare (N, V) repetition mask; None: none).
    Returns:
        (N, V) float32 probabilities, each row summing to 1.
    """
    if config.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; use greedy_tokens for temperature 0")
    logits = penalise(logits, config, seen)  # (N, V)
    # (l - max) / T <= 0: never overflows, however small T; entries below the max go to -inf as T -> 0
    temperature = max(config.temperature, torch.finfo(logits.dtype).tiny)  # 5e-324 is 0 in float32: 0 / 0
    logits = (logits - _row_max(logits)) / temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (N, V)
    if config.top_p < 1.0:
        probs = top_p_filter(probs, config.top_p)
    if config.min_p > 0.0:
        floor = config.min_p * probs.max(dim=-1, keepdim=True).values  # (N, 1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / row_sums(probs)


SUM_BLOCK = 1024  # ids per block of `row_sums`


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum, added in one fixed order whatever the number of rows or threads: (N, V) -> (N, 1).

    torch's own sum of a single row splits it between the threads (two threads, two orders: the last bit moves),
    while several rows are summed one per thread; a row's probabilities would then depend on the rows beside it.
    Here blocks of SUM_BLOCK ids are summed first (one block per thread at a time, each in its own order), then the
    blocks' sums and the tail together (too few to split), so a row alone and the same row among others sum to the
    same bits: verification may make p one row at a time (`verispec.step`) and match `verify` on the whole pass."""
    n, vocab = x.shape
    x = x.contiguous()
    whole = vocab // SUM_BLOCK
    blocks = x.as_strided((n, whole, SUM_BLOCK), (vocab, SUM_BLOCK, 1)).sum(-1)  # (N, V // SUM_BLOCK)
    return torch.cat([blocks, x[:, whole * SUM_BLOCK :]], -1).sum(-1, keepdim=True)  # (N, 1)


def top_p_sorted(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering by its definition: the tokens in order of probability (ties by id, lowest first), each kept
    while the mass before it is below top_p (the most likely always stays); the others set to 0.
    probs (N, V) -> (N, V). A sort of the whole vocabulary per row (12 ms for 151,936 ids here): `top_p_filter`
    gives the same bits by sorting only the few tokens that can matter."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (N, V)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (N, V)
    drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)  # (N, V)
    return probs.masked_fill(drop, 0.0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_sorted`'s result, bit for bit, without sorting the vocabulary (about 1.5 ms instead of 47 for five rows
    of 151,936 ids).

    The probabilities are binned by their power of two (their float exponent, one pass); a row's candidates are the
    tokens at or above the largest power of two whose bins hold more than top_p; only they are sorted (ties by id,
    as `top_p_sorted`), and their running sums are the first ones of the whole sort's (a running sum reads only the
    values before it). The mass before a position never falls further on (each sum adds a value no larger), so once a
    candidate's mass before reaches top_p every token after it is dropped: the candidates reach one bin with a token
    past the bins whose mass reaches top_p (if rounding in the bins' sums leaves them short, the power of two is
    halved and the row's candidates taken again). Tokens of probability 0 are 0 kept or dropped. A row whose candidates are a
    quarter of the vocabulary (a nearly flat distribution) is sorted whole.
    probs (N, V) float32 -> (N, V)."""
    n, vocab = probs.shape
    exponent = probs.contiguous().view(torch.int32) >> 23  # (N, V) p in [2^(e - 127), 2^(e - 126)) for e > 0
    offsets = torch.arange(n, dtype=torch.int32, device=probs.device)[:, None] * 256  # (N, 1)
    mass = torch.bincount((exponent + offsets).flatten(), weights=probs.flatten(), minlength=n * 256)
    binned = mass.view(n, 256).flip(1)  # (N, 256) [:, i] the mass of exponent 255 - i
    above = binned.cumsum(1)  # (N, 256) [:, i] the mass of exponents >= 255 - i
    start = torch.searchsorted(above, torch.full((n, 1), top_p, dtype=above.dtype, device=above.device), right=True)
    # down to the next bin that holds a token: one past the position where the mass reaches top_p
    step = torch.arange(256, device=probs.device)  # (256,)
    later = (binned > 0) & (step > start)  # (N, 256)
    last = torch.where(later.any(1, keepdim=True), later.int().argmax(1, keepdim=True), 255)  # (N, 1)
    floor = torch.where(last < 255, torch.ldexp(torch.ones(n, 1, device=probs.device), (128 - last).to(torch.int32)),
                        2.0 ** -149)  # (N, 1) exponent 0 (bin 255): every positive (subnormal) probability
    candidates = probs >= floor  # (N, V)
    counts = candidates.sum(1).tolist()  # (N,) the one read of the device
    kept = torch.zeros_like(probs)  # (N, V)
    whole: list[int] = []  # rows sorted whole, together (a sort of several rows runs on every thread)
    for r in range(n):
        if counts[r] * 4 > vocab:
            whole.append(r)
            continue
        row, least, ids = probs[r], float(floor[r]), candidates[r].nonzero()[:, 0]  # ids increasing
        while True:
            values, order = torch.sort(row[ids], descending=True, stable=True)  # (C,)
            mass_before = torch.cumsum(values, 0) - values  # (C,)
            if ids.numel() and bool(mass_before[-1] >= top_p) or least == 0.0:  # the rest dropped, or all 0
                keep = ids[order[mass_before < top_p]]
                kept[r, keep] = row[keep]
                break
            least /= 2  # rounding in the bins' sums: a power of two lower (to 0 past float32's smallest)
            ids = (row >= least).nonzero()[:, 0]
            if ids.numel() * 4 > vocab:
                whole.append(r)
                break
    if whole:
        kept[whole] = top_p_sorted(probs[whole], top_p)
    return kept


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
    """One sequence's processor chain, built once from its `SamplingConfig` (`Sequence.processors`): logit bias ->
    repetition, presence and frequency penalties -> temperature / top-k / top-p / min-p -> a greedy or a sampled
    draw. (A structured-output constraint
    masks the logits before the chain: `constraints.apply_constraint` for p, `drafters.drawing.constrained_logits`
    for q.) The verifier (for p) and every drafter that draws from logits (for q) go through it, so the greedy
    branch and the penalty's seen-mask are decided here, once.
    """

    def __init__(self, config: SamplingConfig, prompt_len: int = 0) -> None:
        self.config = config
        self.prompt_len = prompt_len  # where the answer starts in a context (presence / frequency count the answer)
        self.greedy = config.greedy  # temperature 0: argmax on both sides, q None
        self.repeats = config.repetition_penalty != 1.0
        self.counts = bool(config.presence_penalty or config.frequency_penalty)
        # anything between the logits and the argmax (a greedy row is verified by a bare argmax only without)
        self.penalised = self.repeats or self.counts or bool(config.logit_bias)

    def q_row(self, q: torch.Tensor | None, token: int, vocab: int, device: torch.device | None = None
              ) -> torch.Tensor | None:
        """The row of q a drafted token carries to the verifier: None when greedy (argmax on both sides, no q), else
        the q it was drawn from, padded with zeros to the target's `vocab` ids (a draft with fewer), or one-hot at
        `token` where q is None (a copied, deterministic token beside drawn ones). q: (V',) -> (vocab,)."""
        if self.greedy:
            return None
        if q is None:
            row = torch.zeros(vocab, device=device)  # (vocab,)
            row[token] = 1.0
            return row
        return torch.nn.functional.pad(q, (0, vocab - q.shape[-1])) if q.shape[-1] < vocab else q

    def seen(self, tokens: list[int], vocab: int) -> Seen | None:
        """What the penalties read after `tokens` (the context, with drafts after it): one row; None without a history
        penalty."""
        return self.seen_rows(tokens, torch.zeros(0, dtype=torch.long), None, vocab)

    def seen_rows(self, context: list[int], tokens: torch.Tensor, parents: torch.Tensor | None,
                  vocab: int) -> Seen | None:
        """What the penalties read at the root and after each of a draft's N nodes (`parents` None: a chain): N + 1
        rows; None without a history penalty."""
        if not (self.repeats or self.counts):
            return None
        committed = torch.tensor(context, dtype=torch.long)  # (T,)
        mask = counts = None
        if self.repeats:
            mask = (seen_masks(committed, tokens, vocab) if parents is None else
                    tree_seen_masks(committed, tokens, parents, vocab))  # (N + 1, V)
        if self.counts:
            counts = answer_counts(committed[self.prompt_len :], tokens, vocab, parents)  # (N + 1, V)
        return Seen(mask, counts)

    def target(self, logits: torch.Tensor, seen: Seen | None) -> torch.Tensor:
        """The target's rows as verification reads them: (N, V) logits -> (N,) argmax when greedy, else (N, V) p."""
        return greedy_tokens(logits, self.config, seen) if self.greedy else logits_to_probs(logits, self.config, seen)

    def propose(self, logits: torch.Tensor, seen: Seen | None) -> tuple[int, torch.Tensor | None]:
        """A draft position from (1, V) logits: (the argmax, None) when greedy, else (-1, q) with q (V,) the
        distribution to draw it from (`draw`, or `sample` once the drafter decides to go on)."""
        if self.greedy:
            return int(greedy_tokens(logits, self.config, seen)[0]), None
        return -1, logits_to_probs(logits, self.config, seen)[0]

    def draw(self, logits: torch.Tensor, seen: Seen | None,
             rng: torch.Generator) -> tuple[int, torch.Tensor | None]:
        """A draft token from (1, V) logits: the argmax when greedy (q None), else a sample from q and q (V,)."""
        token, q = self.propose(logits, seen)
        return (token, None) if q is None else (sample(q, rng), q)
