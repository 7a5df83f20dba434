"""EAGLE-3's training-time test (Li et al. 2025): the loss that offline training (`heads.eagle3_train`) and
online adaptation (`drafters.head_adapt`) both minimise.

The layer is unrolled `ttt` steps over a window of a sequence. Step 0 at index t is position t: the target's
fused feature f_t and the embedding of token t + 1. Step j at index t is position t + j: the head's own output
of step j - 1 at index t and the embedding of token t + j + 1; it attends to step 0's entries at indices <= t
and to its own and earlier steps' entries at index t only, exactly what drafting j + 1 tokens past committed
position t attends to. Step j's loss is the soft cross-entropy against the target's distribution of token
t + j + 2, over the draft vocabulary (renormalised there), weighted 0.8^j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.models.heads.eagle3 import Eagle3Head


@dataclass
class Sample:
    """One answer: tokens (T,) long (prompt window, then answer); aux (T, 3E) float16, the states entering the
    head's layers for each token; label ids / probs (T, k): the target's distribution of the token after each
    position (rows before `start` are prompt positions: zeros, never used)."""

    tokens: torch.Tensor
    aux: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor
    start: int  # the first position whose label is kept (the last prompt token's)


def training_batch(samples: list[Sample], head: Eagle3Head, embed, ttt: int):
    """Pad a batch: tokens' next embeddings, features, positions and per-step labels over the draft vocab.
    Returns embeds (B, T + ttt, E) (index t holds token t + 1's), aux (B, T, 3E), valid (B, T), label ids
    (B, T + ttt, k) as draft ids, probs (B, T + ttt, k) renormalised over the draft vocab (0 where unusable)."""
    T = max(s.aux.shape[0] for s in samples)
    B, k = len(samples), samples[0].ids.shape[1]
    to_draft = torch.full((head.config.vocab,), -1, dtype=torch.long)
    to_draft[head.target_ids.cpu()] = torch.arange(head.config.draft_vocab)
    aux = torch.zeros(B, T, samples[0].aux.shape[1])
    next_ids = torch.zeros(B, T + ttt, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.zeros(B, T + ttt, k, dtype=torch.long)
    probs = torch.zeros(B, T + ttt, k)
    for b, s in enumerate(samples):
        n = s.aux.shape[0]
        aux[b, :n] = s.aux.float()
        next_ids[b, : n - 1] = s.tokens[1:n]
        valid[b, : n - 1] = True  # the last token's next one is unknown
        d = to_draft[s.ids]  # (n, k)
        p = torch.where(d >= 0, s.probs, torch.zeros_like(s.probs))
        p[: s.start] = 0
        ids[b, :n], probs[b, :n] = d.clamp_min(0), p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    embeds = embed(next_ids.reshape(-1)).reshape(B, T + ttt, -1)
    device = head.fc.weight.device
    return tuple(t.to(device) for t in (embeds, aux, valid, ids, probs))


def unrolled(head: Eagle3Head, embeds, aux, valid, ids, probs, ttt: int, skip_unlabelled: bool = True):
    """The training-time test over a padded batch. Returns the loss and, per step, (right, counted) greedy
    agreement counts with the target's top label (drafts before it assumed right).

    Step 0 runs over every index (its keys and values are what later steps attend to). Steps 1 .. ttt - 1 only
    matter where a label follows within the unroll, so with `skip_unlabelled` they run from the first index
    that can reach one (a batch's prompt windows, often half its indices, are skipped); False runs every index
    (the reference the test compares against: the same loss)."""
    B, T, _ = aux.shape
    mid, c = head.midlayer, head.config
    group = c.heads // c.kv_heads
    labelled = (probs.sum(-1) > 0).any(0).nonzero()  # (n, 1) indices of token positions with a label
    s0 = max(0, int(labelled[0, 0]) - ttt) if skip_unlabelled and labelled.numel() else 0  # later steps start here
    positions = torch.arange(T, device=aux.device)
    h = head.fc(aux)  # (B, T, E)
    causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()  # (T, T) step 0's entries at indices <= t
    keys, values, loss, stats = [], [], torch.zeros((), device=aux.device), []
    for j in range(ttt):
        o = 0 if j == 0 else s0  # step j runs over indices o .. T - 1
        n = T - o
        if j == 1 and o:
            h = h[:, o:]  # (B, n, E)
        cos, sin = head.rope(positions[o:] + j)  # (n, D)
        q, k, v = mid.qkv(embeds[:, o + j : j + T].reshape(B * n, -1), h.reshape(B * n, -1),
                          cos.repeat(B, 1), sin.repeat(B, 1))
        q = q.view(B, n, c.heads, c.head_dim).transpose(1, 2)  # (B, Hq, n, D)
        k = k.view(B, n, c.kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(group, 1)  # (B, Hq, n, D)
        v = v.view(B, n, c.kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        keys.append(k)  # step 0's over every index, later steps' over indices o .. only
        values.append(v)
        scale = c.head_dim ** -0.5
        first = (q @ keys[0].transpose(-1, -2)) * scale  # (B, Hq, n, T)
        first = first.masked_fill(~causal[o:], float("-inf"))
        diagonal = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # (B, Hq, n, 1) each
        weights = torch.softmax(torch.cat([first, *diagonal], dim=-1), dim=-1)  # (B, Hq, n, T + j)
        out = weights[..., :T] @ values[0]  # (B, Hq, n, D)
        for i in range(1, j + 1):
            out = out + weights[..., T + i - 1 : T + i] * values[i]
        h = mid.finish(out.transpose(1, 2).reshape(B * n, -1), h.reshape(B * n, -1)).view(B, n, -1)
        p = probs[:, o + j + 1 : j + 1 + T]  # (B, n, k): the target's distribution of token t + j + 2
        use = valid[:, o:] & (p.sum(-1) > 0)
        if j:
            use = use & torch.nn.functional.pad(valid[:, o + j :], (0, j))  # the tokens fed at step j exist
        labels = ids[:, o + j + 1 : j + 1 + T][use]  # (m, k) at the positions with a label only (the LM head's cost)
        logq = torch.log_softmax(head.lm_head(head.norm(h[use])), -1)  # (m, V_draft)
        ce = -(p[use] * logq.gather(-1, labels)).sum(-1)  # (m,)
        loss = loss + 0.8 ** j * ce.sum() / max(1, ce.numel())
        with torch.no_grad():
            stats.append((int((logq.argmax(-1) == labels[:, 0]).sum()), int(ce.numel())))
    return loss, stats


def tau(rates: list[float]) -> float:
    """Tokens per target pass of a greedy chain whose drafts are right at these rates (given the ones before)."""
    total, alive = 1.0, 1.0
    for a in rates:
        alive *= a
        total += alive
    return total
