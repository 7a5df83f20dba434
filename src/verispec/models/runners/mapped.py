"""A runner for a draft whose vocabulary is a subset of the target's (the distilled tiny draft).

It reads and returns target ids like any `ModelRunner`: inputs are mapped to draft ids (tokens
outside the draft vocabulary become the draft's OTHER token), and the draft's logits are scattered
back to the target's vocabulary with -inf elsewhere, so q is exactly 0 there. Drafters, trees and
the verifier therefore need no special case.
"""

from __future__ import annotations

import torch

from verispec.models.distilled import VocabMap
from verispec.models.runners.hf import ModelRunner, training_logits


class MappedVocabRunner:
    """A runner over a reduced-vocabulary model, in target ids; `vocab_size` is the target's.

    runner: the draft's own runner (a `ModelRunner`, or the native runner of a converted draft); a torch
    module is wrapped in a `ModelRunner`."""

    def __init__(self, runner, vocab: VocabMap, context_window: int | None = None) -> None:
        self.runner = ModelRunner(runner) if isinstance(runner, torch.nn.Module) else runner
        self.vocab = vocab
        self.vocab_size = int(vocab.to_draft.numel())
        self.context_window = context_window or self.runner.context_window
        self.dtype = self.runner.dtype

    @property
    def device(self) -> torch.device:  # where its logits are: the inner runner's
        return self.runner.device

    @property
    def model(self):
        return self.runner.model

    @model.setter
    def model(self, model) -> None:  # online adaptation swaps in new weights
        self.runner.model = model

    def new_state(self, batch_size: int):
        return self.runner.new_state(batch_size)

    def cache_bytes(self, tokens: int) -> int:
        return self.runner.cache_bytes(tokens)

    def commit(self, state, paths: list[list[int]]) -> None:
        self.runner.commit(state, paths)

    def to_draft_ids(self, tokens: list[list[int]]) -> list[list[int]]:
        table = self.vocab.to_draft
        return [table[torch.as_tensor(row, dtype=torch.long)].tolist() if row else [] for row in tokens]

    def forward(self, state, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """As `ModelRunner.forward`, in target ids: returns (B, M, Vt) logits, -inf outside the draft vocabulary."""
        logits = self.runner.forward(state, self.to_draft_ids(tokens), num_logits, parents)  # (B, M, Vd + 1)
        return self.vocab.scatter(logits, self.vocab_size)  # (B, M, Vt)

    def training_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor,
                        cols: torch.Tensor) -> torch.Tensor:
        """As `ModelRunner.training_logits`, in target ids: (N, Vt) logits for online adaptation.

        Outside the draft vocabulary the logits are a large finite negative rather than -inf, so the
        forward KL stays finite; its gradient then moves q towards p renormalised on the draft vocabulary."""
        logits = training_logits(model, self.vocab.to_draft[input_ids], rows, cols)  # (N, Vd + 1)
        out = logits.new_full((logits.shape[0], self.vocab_size), -1e4)  # (N, Vt)
        out[:, self.vocab.to_target] = logits[:, : self.vocab.draft_vocab_size]
        return out
