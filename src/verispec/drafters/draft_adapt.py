"""Online adaptation of a draft model: a few AdamW steps of forward KL(p_target || q_draft) on the
buffered target distributions, on a float32 training copy, then a fresh serving copy.

The serving draft may be dense (any dtype) or weight-only int8: the training copy ("master") starts
from the serving weights (int8 layers dequantized), and after each update a serving copy is made in
the serving format again (cast to its dtype, re-quantized for int8). The drafter swaps it in at the
start of its next `propose`, so a step never drafts with weights that change under it. Packed
(oneDNN) draft weights cannot be unpacked for training and are refused.

The training forward goes through `runner.training_logits`, which a runner mapping a reduced draft
vocabulary to target ids overrides, so the loss always compares distributions over target ids.
"""

from __future__ import annotations

import collections
import copy

import torch

from verispec.config import AdaptConfig
from verispec.errors import VerispecError
from verispec.models.runners.packed import PackedLinear
from verispec.models.runners.quantized import Int8Linear, dequantize_linear_layers, quantize_linear_layers


def check_trainable(model: torch.nn.Module | None) -> None:
    """Refuse draft weights that online adaptation cannot train from."""
    if model is None or not isinstance(model, torch.nn.Module):
        raise VerispecError("online adaptation of a draft model needs the torch backend (not llama.cpp)")
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        raise VerispecError("online adaptation cannot train packed draft weights: use --draft-weights int8 or dense")


def shared_rows(contexts: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Pack contexts into as few rows as prefixes allow: returns the rows (the longest contexts that
    are no other's prefix) and, per context, the row it is a prefix of. Causal attention makes the
    logits after a prefix the same whether the row goes on or not."""
    carriers: list[tuple[int, ...]] = []
    row_of = [0] * len(contexts)
    for i in sorted(range(len(contexts)), key=lambda i: -len(contexts[i])):
        ctx = contexts[i]
        row = next((r for r, carrier in enumerate(carriers) if carrier[: len(ctx)] == ctx), None)
        if row is None:
            carriers.append(ctx)
            row = len(carriers) - 1
        row_of[i] = row
    return carriers, row_of


def optimizer_steps(examples: list, loss, params: list, optimizer: torch.optim.Optimizer, config: AdaptConfig,
                    shuffle: torch.Generator) -> tuple[int, float | None]:
    """One update: config.epochs passes over `examples` in an order drawn from `shuffle`, an optimizer step per
    batch of config.batch_size (gradients clipped to norm 1), at most config.max_steps steps. loss(batch) -> a
    scalar; a batch whose loss has no gradient (nothing in it to learn) is skipped. Returns the steps taken and
    the last loss."""
    steps, last = 0, None
    for _ in range(config.epochs):
        order = torch.randperm(len(examples), generator=shuffle).tolist()
        for start in range(0, len(examples), config.batch_size):
            if steps >= config.max_steps:
                break
            value = loss([examples[i] for i in order[start : start + config.batch_size]])
            if not value.requires_grad:
                continue
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            last = float(value.detach())
            steps += 1
    return steps, last


class DraftTrainer:
    """Owns the float32 master copy of a draft model and its optimizer.

    Args:
        runner: the draft's runner (its `training_logits` is the training forward).
        serving: the model the runner serves now (its format is kept for later serving copies).
        width: the number of target ids q covers (logits beyond it are cut, as in drafting).
        config: learning rate, batch size, epochs and step limit.
    """

    def __init__(self, runner, serving: torch.nn.Module, width: int, config: AdaptConfig) -> None:
        check_trainable(serving)
        self.runner, self.width, self.config = runner, width, config
        self.int8 = any(isinstance(m, Int8Linear) for m in serving.modules())
        self.dtype = next(p for p in serving.parameters() if p.is_floating_point()).dtype
        master = copy.deepcopy(serving)
        dequantize_linear_layers(master)
        self.master = master.float().train()
        for p in self.master.parameters():
            p.requires_grad_(True)
        self.lr = config.draft_lr(sum(p.numel() for p in self.master.parameters()))
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=self.lr, weight_decay=0.0)
        self.steps = 0
        self.last_loss: float | None = None
        self._shuffle = torch.Generator()  # the order examples are visited in; never a sequence's generator
        self._shuffle.manual_seed(0)
        self._history: collections.deque = collections.deque(maxlen=config.buffer_size)  # examples of earlier updates

    def loss(self, batch: list) -> torch.Tensor:
        """Forward KL(p || q) up to p's entropy (a constant): -sum_x p(x) log q(x), averaged over examples.
        Examples whose contexts are prefixes of another's (positions along one output) share its row."""
        carriers, rows = shared_rows([ex.context for ex in batch])
        lengths = torch.tensor([len(c) for c in carriers], dtype=torch.long)  # (C,)
        input_ids = torch.zeros(len(carriers), int(lengths.max()), dtype=torch.long)  # (C, T) right-padded
        for c, context in enumerate(carriers):
            input_ids[c, : len(context)] = torch.tensor(context, dtype=torch.long)
        cols = torch.tensor([len(ex.context) - 1 for ex in batch], dtype=torch.long)  # (B,)
        logits = self.runner.training_logits(self.master, input_ids, torch.tensor(rows, dtype=torch.long), cols)
        log_q = torch.log_softmax(logits[:, : self.width], dim=-1)  # (B, V')
        p = torch.zeros_like(log_q)  # (B, V') the buffered top-k of p, renormalized
        for b, ex in enumerate(batch):
            ids = [t for t in ex.tokens if t < log_q.shape[-1]]
            probs = torch.tensor([pr for t, pr in zip(ex.tokens, ex.probs) if t < log_q.shape[-1]], dtype=torch.float32)
            if ids:
                p[b, torch.tensor(ids, dtype=torch.long)] = probs / probs.sum()
        return -(p * log_q).sum(dim=-1).mean()

    def train(self, examples: list) -> torch.nn.Module:
        """Some optimizer steps on `examples` (and up to config.replay earlier ones); returns a new
        serving copy (the serving format, eval mode)."""
        examples = [ex for ex in examples if ex.context and ex.tokens]
        fresh = examples
        if self.config.replay and self._history:
            picks = torch.randperm(len(self._history), generator=self._shuffle)[: self.config.replay].tolist()
            examples = examples + [self._history[i] for i in picks]
        self._history.extend(fresh)
        steps, last = optimizer_steps(examples, self.loss, list(self.master.parameters()), self.optimizer, self.config,
                                      self._shuffle)
        self.last_loss = last if last is not None else self.last_loss
        self.steps += steps
        return self.serving_copy()

    @torch.no_grad()
    def serving_copy(self) -> torch.nn.Module:
        model = copy.deepcopy(self.master).to(self.dtype).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if self.int8:
            quantize_linear_layers(model)
        return model
