"""Training tied Medusa heads on the target's own text (Medusa-1: the target frozen, heads only).

1. Data: the target answers training prompts greedily (Spec-Bench's TRAIN split by default, never the
   held-out one) on the runner that will serve; at every position t of its answers it keeps the final hidden
   state h_t and its top-k next-token distribution (soft labels).
2. Head k learns the target's distribution k + 1 positions later: the soft cross-entropy
   -sum_x p_(t+k+1)(x) log q_k(x | h_t), over the ids the tied LM head covers (p renormalised there). Only
   the ResBlocks learn; the LM head is the target's own (its first `rows` rows, dequantized once).
3. Validation: on the answers to held-back training prompts, how often head k's argmax is the target's
   greedy token k + 1 places on (the greedy acceptance of a head's draft, position by position).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from verispec.console import progress
from verispec.errors import VerispecError
from verispec.head_training import common
from verispec.models.heads.medusa import MedusaHeads


@dataclass(frozen=True)
class MedusaTrainConfig:
    """Attributes: heads, layers (ResBlocks per head), rows (token ids the tied head covers), tokens (answer
    length per prompt), top_k (soft-label width), steps, batch_size, lr, val_fraction, seed."""

    heads: int = 3
    layers: int = 1
    rows: int = 32768
    tokens: int = 96
    top_k: int = 16
    steps: int = 600
    batch_size: int = 256
    lr: float = 1e-3
    val_fraction: float = 0.15
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heads < 1 or self.layers < 1 or self.rows < 16 or self.tokens < 4 or self.top_k < 1:
            raise VerispecError("train-heads needs heads >= 1, layers >= 1, rows >= 16, tokens >= 4, top_k >= 1")
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0 or not 0 < self.val_fraction < 1:
            raise VerispecError("train-heads needs steps >= 1, batch_size >= 1, lr > 0 and 0 < val_fraction < 1")


@dataclass
class Answers:
    """The target's answers: per answer, hidden states (T, E) and top-k labels (T, k) ids / probs; position t's
    label is the target's distribution of the token after t."""

    hidden: list[torch.Tensor]
    ids: list[torch.Tensor]
    probs: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.hidden)

    def records(self) -> list[dict[str, torch.Tensor]]:
        """One dict per answer (what `heads.common.Partial` saves)."""
        return [{"hidden": h, "ids": i, "probs": p} for h, i, p in zip(self.hidden, self.ids, self.probs)]

    @classmethod
    def from_records(cls, records: list[dict[str, torch.Tensor]]) -> "Answers":
        return cls([r["hidden"] for r in records], [r["ids"] for r in records], [r["probs"] for r in records])


def target_answers(runner, prompts: list[list[int]], config: MedusaTrainConfig, show: bool = True) -> Answers:
    """Greedy answers by the target, with the hidden state and top-k distribution at every answer position."""
    runner.keep_features = True
    out = Answers([], [], [])
    with progress("the target answers the training prompts", len(prompts), show) as advance:
        for prompt in prompts:
            state = runner.new_state(1)
            logits = runner.forward(state, [prompt], [1])[0, 0]
            hidden, ids, probs = [], [], []
            for _ in range(config.tokens):
                p = torch.softmax(logits.float(), -1)  # (V,)
                top = p.topk(config.top_k)
                hidden.append(runner.features[0, 0].clone())
                ids.append(top.indices)
                probs.append(top.values)
                token = int(logits.argmax())
                if token >= runner.vocab_size:
                    break
                logits = runner.forward(state, [[token]], [1])[0, 0]
            out.hidden.append(torch.stack(hidden))
            out.ids.append(torch.stack(ids))
            out.probs.append(torch.stack(probs))
            advance()
    if not len(out):
        raise VerispecError("no training answers: the prompts gave nothing to learn from")
    return out


def _examples(answers: Answers, head: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_t, ids, probs) pairs for head `head`: h at t, the target's distribution at t + head + 1
    (position t's label is the token after t, so head k's is at t + k), ids >= rows dropped, renormalised."""
    hs, ids, probs = [], [], []
    for h, i, p in zip(answers.hidden, answers.ids, answers.probs):
        n = h.shape[0] - head - 1
        if n <= 0:
            continue
        hs.append(h[:n])
        ids.append(i[head + 1 : head + 1 + n])
        probs.append(p[head + 1 : head + 1 + n])
    if not hs:
        return torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1)
    ids, probs = torch.cat(ids), torch.cat(probs)
    probs = torch.where(ids < rows, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
    return torch.cat(hs), ids.clamp(max=rows - 1), probs


def train_heads(train: Answers, val: Answers, lm_head: torch.Tensor, vocab: int, config: MedusaTrainConfig,
                show: bool = True, resume: dict | None = None, checkpoint=None,
                device: str = "cpu") -> tuple[MedusaHeads, dict]:
    """Train tied heads for a target of `vocab` tokens; lm_head: (rows, E) float32, its LM head's first rows.
    resume: a checkpoint to go on from ({"model", "optimizer", "step"}); checkpoint(heads, optimizer, step) is
    called every 100 steps; device: where the heads train. Returns the heads (on the CPU) and a log (loss,
    validation and training agreement by head, seconds)."""
    torch.manual_seed(config.seed)
    rows, hidden = lm_head.shape
    heads = MedusaHeads(config.heads, config.layers, hidden, vocab, tied_rows=rows)
    data = [tuple(t.to(device) for t in _examples(train, k, rows)) for k in range(config.heads)]
    if any(d[0].shape[0] == 0 for d in data):
        raise VerispecError(f"the answers are too short for {config.heads} heads (tokens per answer: {config.tokens})")
    if resume is not None:
        heads.load_state_dict(resume["model"])
    heads, head_rows = heads.to(device), lm_head.to(device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    first = 0
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        first = int(resume["step"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s + first, config.steps) / config.steps)))
    generator = torch.Generator().manual_seed(config.seed + first)
    log = {"loss": []}
    start = time.perf_counter()
    with progress("training Medusa heads", config.steps - first, show) as advance:
        for step in range(first, config.steps):
            loss = torch.zeros((), device=device)
            for k, (h, ids, probs) in enumerate(data):
                pick = torch.randint(h.shape[0], (min(config.batch_size, h.shape[0]),), generator=generator).to(device)
                loss = loss + heads.soft_loss(k, h[pick], ids[pick], probs[pick], head_rows)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            if step % 50 == 0 or step == config.steps - 1:
                log["loss"].append((step, round(float(loss.detach()) / config.heads, 4)))
            if checkpoint is not None and (step + 1) % 100 == 0:
                checkpoint(heads, optimizer, step + 1)
            advance()
    log["seconds"] = round(time.perf_counter() - start, 1)
    heads = heads.cpu()
    log["validation_agreement"] = agreement(heads, val, lm_head)
    log["train_agreement"] = agreement(heads, train, lm_head)
    return heads.eval(), log


@torch.no_grad()
def agreement(heads: MedusaHeads, answers: Answers, lm_head: torch.Tensor) -> list[float]:
    """Per head: how often its argmax is the target's greedy token at its distance (ids past the tied rows
    count as misses)."""
    out = []
    for k, block in enumerate(heads.heads):
        h, ids, _ = _examples(answers, k, lm_head.shape[0] + 10**9)  # the labels' own ids, unclipped
        if h.shape[0] == 0:
            out.append(float("nan"))
            continue
        guess = (block(h) @ lm_head.T).argmax(-1)  # (n,)
        out.append(round(float((guess == ids[:, 0]).float().mean()), 4))
    return out


def split(answers: Answers, val_fraction: float, seed: int) -> tuple[Answers, Answers]:
    train, val = common.split(answers.records(), val_fraction, seed)
    return Answers.from_records(train), Answers.from_records(val)
