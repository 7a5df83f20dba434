"""What the engine and the drafters ask of a runner: declared here, checked with `isinstance`, never probed.

A runner holds one model and decodes a batch of rows on caches of its own (`new_state`). Three levels:

- `Runner`: chains. `forward` reads each row's new tokens and returns logits for its last `num_logits[b]`
  positions; `rollback` drops each row's last tokens from the cache (rejected drafts).
- `TreeRunner`: also draft trees. `forward_tree` reads each row's tree (its nodes attend to the committed prefix
  and their ancestors) and `commit_tree` keeps the accepted path's cache columns.
- `FeatureRunner`: also the hidden states draft heads read (Medusa: the last layer's, `keep_features`; EAGLE-3:
  those entering `aux_layers`) and the target's own embedding and head.

Every runner verispec ships is a `TreeRunner`: the native GGUF runner (the default), the torch runners (dynamic
and static cache, row by row, a reduced vocabulary), the skip-set runner of self-speculation and llama.cpp's.
The native and torch runners are `FeatureRunner`s as well.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RunnerState(Protocol):
    """A batch's caches. Rows are the batch's sequences, in order."""

    @property
    def batch_size(self) -> int: ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows ((R,) long), in this order."""

    def extend(self, num_rows: int) -> None:
        """Add empty rows at the end."""


@runtime_checkable
class Runner(Protocol):
    """A model that decodes chains. `vocab_size` is the target's vocabulary (a reduced-vocabulary draft maps back)."""

    vocab_size: int
    context_window: int

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of cache one row of `tokens` tokens takes."""

    def new_state(self, batch_size: int) -> RunnerState:
        """Empty caches for `batch_size` rows."""

    def forward(self, state, tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """(B, max num_logits, V) float32: row b's logits at its last num_logits[b] new positions."""

    def rollback(self, state, num_dropped: list[int]) -> None:
        """Drop each row's last num_dropped[b] tokens from its cache."""


@runtime_checkable
class TreeRunner(Runner, Protocol):
    """A runner that also reads draft trees (`verispec.tree`) in one pass."""

    def forward_tree(self, state, chains: list[list[int]], nodes: list[list[int]],
                     parents: list[list[int]]) -> torch.Tensor:
        """(B, max(len(chain) + len(nodes)), V): row b reads chains[b] (committed tokens not yet cached, the last
        one the tree's root) then its nodes (parents[b][i]: node i's parent, -1 the root); logits of the root and
        of every node."""

    def commit_tree(self, state, paths: list[list[int]]) -> None:
        """Keep only paths[b]'s nodes (root to leaf) of row b's last tree in its cache."""


@runtime_checkable
class FeatureRunner(TreeRunner, Protocol):
    """A tree runner that also gives the target's hidden states to draft heads."""

    keep_features: bool  # keep each pass's final hidden states (Medusa heads read them)
    aux_layers: tuple[int, ...]  # keep the hidden states entering these layers (EAGLE-3's fused features)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n, E) float32: the target's input embeddings of these token ids."""

    def head_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """(n, V) float32: the target's LM head applied to final hidden states."""
