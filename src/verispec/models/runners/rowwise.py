"""Row by row: a batch whose rows each keep their own one-row cache and get their own forward passes.

Why. In a batched pass a row's cache is padded to the longest row and its holes are masked, which
changes the order of the float additions inside attention: the row's numbers differ from its numbers
alone in the last bits. That never changes the output distribution, and a float32 model turns such
differences into a different token almost never; but an int8 draft rounds its activations to bfloat16,
which magnifies them into visibly different q. q decides which tokens a seeded sampling request draws
(not their distribution), so a seeded request decoded with an int8 draft gave different tokens alone
and batched (measured with the SmolLM2 pair at temperature 0.8: 4 of 6 sequences). Run row by row,
a row's draft computes exactly what it computes alone, so a seeded request gives the same tokens
whatever batch it shares.

Cost. The int8 kernel (`torch._weight_int8pack_mm`) costs about the same per row batched or not
(measured on this machine: 5 rows 4.8x one row), so int8 drafts lose only per-call Python overhead.
Float drafts, whose matmuls batch almost for free, stay batched (`LoadedModel.make_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.models.runners.hf import KVState, ModelRunner


@dataclass
class RowStates:
    """A batch's caches, one single-row KVState per row (the `KVState` interface the drafters use)."""

    runner: ModelRunner
    rows: list[KVState] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def speculative(self) -> bool:
        return any(row.speculative for row in self.rows)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order. rows: (B',) long."""
        if self.speculative:
            raise ValueError("select needs the draft nodes committed first (commit)")
        self.rows = [self.rows[i] for i in rows.tolist()]

    def extend(self, num_rows: int) -> None:
        self.rows += [self.runner.new_state(1) for _ in range(num_rows)]

    def checkpoint(self):
        """Each row's checkpoint (`core.protocols.RestorableState`); None where a row's cannot be taken."""
        points = [row.checkpoint() for row in self.rows]
        return None if any(p is None for p in points) else (list(self.rows), points)

    def restore(self, point) -> None:
        rows, points = point
        self.rows = rows
        for row, p in zip(rows, points):
            row.restore(p)


class RowwiseRunner:
    """A ModelRunner's interface over RowStates: each call runs the inner runner once per row with work."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.vocab_size, self.context_window, self.dtype = runner.vocab_size, runner.context_window, runner.dtype

    @property
    def device(self) -> torch.device:  # where its logits are: the inner runner's
        return self.runner.device

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:  # online adaptation swaps in new weights
        self.runner.model = model

    def cache_bytes(self, tokens: int) -> int:
        return self.runner.cache_bytes(tokens)

    def new_state(self, batch_size: int) -> RowStates:
        state = RowStates(self.runner)
        state.extend(batch_size)
        return state

    def forward(self, state: RowStates, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """As `ModelRunner.forward`, row by row: (B, M, V) logits, M = max(1, max(num_logits)); rows without
        tokens are filler."""
        outs = {b: self.runner.forward(state.rows[b], [row], [n], None if parents is None else [parents[b]])[0]
                for b, (row, n) in enumerate(zip(tokens, num_logits)) if row}  # (max(1, n), V) each
        return _stack(outs, len(tokens), max(1, max(num_logits, default=0)), self.vocab_size)

    def commit(self, state: RowStates, paths: list[list[int]]) -> None:
        for row, path in zip(state.rows, paths):
            self.runner.commit(row, [path])

    def training_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor,
                        cols: torch.Tensor) -> torch.Tensor:
        return self.runner.training_logits(model, input_ids, rows, cols)


def _stack(outs: dict[int, torch.Tensor], batch: int, width: int, vocab: int) -> torch.Tensor:
    """Per-row (m_b, V) logits -> (B, width, V), zeros where a row has none."""
    if outs:
        vocab = next(iter(outs.values())).shape[-1]
    logits = torch.zeros(batch, width, vocab)  # (B, M, V)
    for b, out in outs.items():
        logits[b, : out.shape[0]] = out[:width]
    return logits
