"""What the engine and the drafters ask of a runner: declared here, checked with `isinstance`, never probed.

A runner holds one model and decodes a batch of rows on caches of its own (`new_state`). One pass, one commit:

- `Runner`: `forward` reads each row's new tokens and returns logits for its last `num_logits[b]` positions.
  With `parents`, a row's last tokens are draft nodes (a tree; a chain is the tree (-1, 0, 1, ...)): each
  attends to the committed prefix, its ancestors and itself, and stays in the cache, uncommitted, until
  `commit` keeps the accepted path's nodes and drops the others. A runner may read a chain-shaped draft with
  its plain causal pass (the same mask); callers do not see the difference.
- `FeatureRunner`: also the hidden states draft heads read (Medusa: the last layer's, `keep_features`; EAGLE-3:
  those entering `aux_layers`) and the target's own embedding and head.

Every runner verispec ships reads trees: the native GGUF runner (the default), the torch runners (dynamic
and static cache, row by row, a reduced vocabulary), the skip-set runner of self-speculation and llama.cpp's.
The native and torch runners are `FeatureRunner`s as well.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

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
class RestorableState(RunnerState, Protocol):
    """A state that can be brought back to where it was before a pass that raised part-way (`verispec.faults`: the
    batch then runs the pass again by parts, to confine the fault to the row that causes it)."""

    def checkpoint(self):
        """What `restore` needs to bring the state back to now, between passes (None: it cannot be, here)."""

    def restore(self, point) -> None:
        """Back to `checkpoint`'s moment: what a pass since then wrote is dropped, whether it finished or not."""


@runtime_checkable
class PrefixState(RunnerState, Protocol):
    """A state whose rows' committed cache can be copied out and into an empty row (`verispec.core.prefix`: prefix reuse
    across requests). Only where a reused row is the same bits as a recomputed one (the native runner's kernels are
    batch-invariant): a prefix is then a cache, never an approximation."""

    def read_prefix(self, row: int, length: int) -> Any:
        """A copy of row `row`'s first `length` committed positions: an object with `length`, `nbytes` and
        `head(n)` (its first n positions, as such an object)."""

    def write_prefix(self, row: int, prefix: Any) -> None:
        """Make an empty row hold a copied prefix as its committed positions."""


@runtime_checkable
class Runner(Protocol):
    """A model that decodes chains. `vocab_size` is the target's vocabulary (a reduced-vocabulary draft maps back)."""

    vocab_size: int
    context_window: int
    device: torch.device  # where its logits are: a GPU for the static runner on CUDA, the host otherwise

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of cache one row of `tokens` tokens takes."""

    def new_state(self, batch_size: int) -> RunnerState:
        """Empty caches for `batch_size` rows."""

    def forward(self, state, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """(B, max num_logits, V) float32: row b reads tokens[b] and gets its logits at its last num_logits[b]
        new positions. parents (None: every token is committed): the last len(parents[b]) tokens of row b are
        draft nodes; parents[b][j] is node j's parent slot, slots numbering the row's uncommitted nodes in the
        order they were read since the last `commit` (earlier passes first), -1 the last committed token.
        Committed tokens cannot follow uncommitted nodes in a row."""

    def commit(self, state, paths: list[list[int]]) -> None:
        """Keep paths[b] (slots from the root down, possibly none) of row b's uncommitted nodes as committed
        tokens, and drop the others."""


@runtime_checkable
class FeatureRunner(Runner, Protocol):
    """A runner that also gives the target's hidden states to draft heads."""

    keep_features: bool  # keep each pass's final hidden states (Medusa heads read them)
    aux_layers: tuple[int, ...]  # keep the hidden states entering these layers (EAGLE-3's fused features)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n, E) float32: the target's input embeddings of these token ids."""

    def head_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """(n, V) float32: the target's LM head applied to final hidden states."""


@runtime_checkable
class NativeWeights(Protocol):
    """The weights view of a runner over verispec's native quantized GGUF weights (`models.gguf`: the native runner,
    and the views that run it, as a draft with its LM head cut to ranked ids): `gguf` is the model (its config,
    layers, head and embedding). What reads weights (skip sets, self-speculation's costs, an EAGLE head's backend)
    asks with `isinstance`, never `getattr`."""

    gguf: Any


@runtime_checkable
class TorchWeights(Protocol):
    """The weights view of a runner over a torch module (`models.runners`: the dynamic and static caches, row by row,
    a reduced vocabulary): `model` is the transformers model it runs (online adaptation swaps in new weights)."""

    model: torch.nn.Module
