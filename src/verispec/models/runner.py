"""Incremental, ragged, rollback-able forward passes over a Hugging Face causal LM.

A `KVState` holds one batch's key/value cache. Each row (sequence) advances by its own
number of tokens per call, so a batch is ragged: a call's input is right-padded to the widest
row, and the padded columns become "holes" in the cache that the attention mask hides
forever. Rollback marks a row's last entries invalid the same way, then crops the columns
no row still uses. With one row this is exactly a crop of the cache.

Positions are explicit per row (RoPE sees each row's true token positions), and the cache
index order stays chronological, so the causal mask over cache columns stays correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class KVState:
    """One batch's cache.

    cache: the model's key/value cache, L columns per row.
    valid: (B, L) bool, which cache columns hold a live token of that row.
    lengths: (B,) long, live tokens per row (= the position of the row's next token).
    """

    cache: DynamicCache
    valid: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (e.g. drop finished sequences), then drop the columns no row uses. rows: (B',) long."""
        if self.valid.shape[1] > 0:
            self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]
        self._compact()

    def extend(self, num_rows: int) -> None:
        """Add rows with no live entries at the end (sequences joining a running batch).

        Their columns are all holes until their first forward pass; positions start at 0.
        """
        for layer in self._layers():
            pad = layer.keys.new_zeros((num_rows, *layer.keys.shape[1:]))  # (n, H, L, D)
            layer.keys = torch.cat([layer.keys, pad])
            layer.values = torch.cat([layer.values, pad])
        self.valid = torch.cat([self.valid, torch.zeros(num_rows, self.valid.shape[1], dtype=torch.bool)])
        self.lengths = torch.cat([self.lengths, torch.zeros(num_rows, dtype=torch.long)])

    def _layers(self) -> list:
        """The cache layers that hold tensors (none before the first forward pass)."""
        if self.valid.shape[1] == 0:
            return []
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]

    def _compact(self) -> None:
        """Remove columns that are a hole in every row (left by departed rows): the cache stays
        as long as its live rows need, however long a server runs. Order is kept, so causality holds."""
        live = self.valid.any(dim=0)  # (L,)
        if bool(live.all()):
            return
        columns = live.nonzero().squeeze(1)  # (L',)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(2, columns)  # (B, H, L', D)
            layer.values = layer.values.index_select(2, columns)
        self.valid = self.valid[:, columns]


class ModelRunner:
    """Wraps a causal LM for speculative decoding: ragged forward with logits at chosen positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        config = model.config
        self.context_window: int = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 30
        self.dtype: torch.dtype = next(model.parameters()).dtype

    def new_state(self, batch_size: int) -> KVState:
        return KVState(
            cache=DynamicCache(config=self.model.config),
            valid=torch.zeros(batch_size, 0, dtype=torch.bool),
            lengths=torch.zeros(batch_size, dtype=torch.long),
        )

    @torch.inference_mode()
    def forward(self, state: KVState, tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Append each row's tokens to the cache and return logits at each row's last positions.

        Args:
            state: the batch's cache; updated in place.
            tokens: B lists of new token ids (a list may be empty: that row only waits).
            num_logits: for each row, how many of its last new positions need logits (<= len(tokens[b])).
        Returns:
            (B, M, V) float logits, M = max(num_logits); row b's logits for its last num_logits[b]
            positions are in [:, :num_logits[b]] in order, the rest is filler.
        """
        B = len(tokens)
        counts = torch.tensor([len(t) for t in tokens], dtype=torch.long)  # (B,)
        W = int(counts.max())
        M = max(1, max(num_logits))
        input_ids = torch.zeros(B, W, dtype=torch.long)  # (B, W)
        for b, row in enumerate(tokens):
            if row:
                input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        columns = torch.arange(W)  # (W,)
        new_valid = columns[None, :] < counts[:, None]  # (B, W)
        position_ids = state.lengths[:, None] + columns[None, :]  # (B, W)
        attention_mask = torch.cat([state.valid, new_valid], dim=1).long()  # (B, L + W)
        wanted = torch.tensor(num_logits, dtype=torch.long)  # (B,)
        # Row b keeps positions counts[b] - wanted[b] + j for j < M, clamped into the row.
        keep = (counts - wanted)[:, None] + torch.arange(M)[None, :]  # (B, M)
        keep = keep.clamp(min=0, max=max(W - 1, 0))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=state.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        state.valid = torch.cat([state.valid, new_valid], dim=1)
        state.lengths = state.lengths + counts
        return out.logits.float()  # (B, M, V)

    def training_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Next-token logits with gradients at one position per row, for online adaptation of a draft
        (`verispec.drafters.draft_adapt`). `model` is a trainable copy of this runner's model.

        A runner that maps its model's ids (e.g. a reduced draft vocabulary) overrides this together
        with `forward`, so both return logits over the same ids.

        Args:
            input_ids: (B, T) long, right-padded (causal attention: padding never reaches `last`).
            last: (B,) long, the position in each row whose next-token logits are wanted.
        Returns:
            (B, V) float32 logits.
        """
        hidden = model.base_model(input_ids=input_ids).last_hidden_state  # (B, T, H)
        picked = hidden[torch.arange(input_ids.shape[0]), last]  # (B, H)
        return model.get_output_embeddings()(picked).float()  # (B, V)

    def rollback(self, state: KVState, num_dropped: list[int]) -> None:
        """Forget each row's last num_dropped[b] live tokens (e.g. rejected drafts)."""
        drop = torch.tensor(num_dropped, dtype=torch.long)  # (B,)
        if int(drop.sum()) == 0:
            return
        if bool((drop > state.lengths).any()):
            raise ValueError("cannot roll back more tokens than a row holds")
        from_right = state.valid.flip(1).long().cumsum(1).flip(1)  # (B, L) live entries at or right of each column
        state.valid = state.valid & (from_right > drop[:, None])
        state.lengths = state.lengths - drop
        self._crop_dead_columns(state)

    @staticmethod
    def _crop_dead_columns(state: KVState) -> None:
        live_columns = state.valid.any(dim=0).nonzero()
        new_len = int(live_columns.max()) + 1 if live_columns.numel() else 0
        dead = state.valid.shape[1] - new_len
        if dead > 0:
            state.cache.crop(-dead)
            state.valid = state.valid[:, :new_len]
