"""Running a `SkipSet` (`verispec.models.skip`): the self-speculation draft on each backend.

`SkipRunner` runs a skip set on the native runner (`models.gguf`); its states are views of the target's
caches (see `verispec.drafters.self_draft` for which entries the draft reads and writes).
`skipping_module` builds the torch version: a shallow copy of a transformers decoder whose skipped layers
pass the residual through (a skipped attention still writes zero keys and values, so that every layer of
its own cache stays as long as the others, as transformers' mask code expects).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from verispec.errors import VerispecError
from verispec.models.gguf.runner import NativeState, RowCache
from verispec.models.skip import SkipSet, decoder_layers


class SkipRunner:
    """A runner interface over the native target runner that skips sublayers; no weights of its own.

    Its states hold one skip set per row (`SkipState`); a pass runs each group of rows that share a set as
    one target pass with those sublayers skipped (one group, one pass, in the usual case).
    """

    device = torch.device("cpu")  # where its logits are (core.protocols.Runner)

    def __init__(self, target, skip: SkipSet) -> None:
        self.target = target
        self.skip = skip
        self.vocab_size = target.vocab_size
        self.context_window = target.context_window
        self.dtype = target.dtype

    def cache_bytes(self, tokens: int) -> int:
        """A state of its own holds the target's caches (the self drafter shares the target's instead)."""
        return self.target.cache_bytes(tokens)

    def new_state(self, batch_size: int):
        """Caches of its own (for measuring its cost); the self drafter reads the target's through `view`."""
        return SkipState.of(self.target.new_state(batch_size), [self.skip] * batch_size)

    def view(self, target_state, skips: list[SkipSet]):
        """A state over the target's caches: the same arrays, its own lengths (see drafters.self_draft)."""
        return SkipState.of(target_state, skips, share=True)

    def forward(self, state, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        return self._grouped(state, lambda sub, idx, bits, head: self.target.forward(
            sub, [tokens[i] for i in idx], [num_logits[i] for i in idx],
            None if parents is None else [parents[i] for i in idx], skip=bits, head_rows=head))

    def commit(self, state, paths: list[list[int]]) -> None:
        self.target.commit(state, paths)

    def _grouped(self, state, run) -> torch.Tensor:
        groups: dict[SkipSet, list[int]] = {}
        for b, skip in enumerate(state.skips):
            groups.setdefault(skip, []).append(b)
        if len(groups) == 1:
            skip, = groups
            return run(state, list(range(state.batch_size)), skip.bits(), skip.head)
        parts = {}
        for skip, idx in groups.items():
            sub = type(state)(state.runner, [state.rows[i] for i in idx], [skip] * len(idx))
            parts[skip] = (idx, run(sub, idx, skip.bits(), skip.head))  # (b, M_g, V)
        width = max(out.shape[1] for _, out in parts.values())
        logits = torch.zeros(state.batch_size, width, self.vocab_size)  # (B, M, V)
        for idx, out in parts.values():
            logits[idx, : out.shape[1]] = out
        return logits


@dataclass
class SkipState(NativeState):
    """A native state with one skip set per row; `of(..., share=True)` views another state's caches."""

    skips: list = field(default_factory=list)  # per row: its SkipSet

    @classmethod
    def of(cls, state: NativeState, skips: list, share: bool = False) -> SkipState:
        rows = [RowCache(r.keys, r.values, r.length) for r in state.rows] if share else state.rows
        return cls(state.runner, rows, list(skips))

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.skips = [self.skips[i] for i in rows.tolist()]

    def extend(self, num_rows: int) -> None:
        super().extend(num_rows)
        self.skips += [self.skips[-1]] * num_rows


# ---------------------------------------------------------------------- the torch runner's draft


class _SkippingLayer(torch.nn.Module):
    """A decoder layer with its attention and / or MLP skipped (the residual passes through)."""

    def __init__(self, layer: torch.nn.Module, skip_attention: bool, skip_mlp: bool) -> None:
        super().__init__()
        self.layer = layer
        self.skip_attention, self.skip_mlp = skip_attention, skip_mlp
        attention = layer.self_attn
        self.layer_idx = attention.layer_idx
        self.kv_heads = attention.config.num_key_value_heads
        self.head_dim = attention.head_dim

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        layer = self.layer
        if self.skip_attention:
            if past_key_values is not None:  # keep this layer's cache as long as the others' (never read)
                B, W = hidden_states.shape[:2]
                zeros = hidden_states.new_zeros(B, self.kv_heads, W, self.head_dim)  # (B, Hkv, W, D)
                past_key_values.update(zeros, zeros, self.layer_idx)
        else:
            attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states),
                                          attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_values=past_key_values, use_cache=use_cache,
                                          position_embeddings=position_embeddings, **kwargs)
            hidden_states = hidden_states + attended
        if not self.skip_mlp:
            hidden_states = hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))
        return hidden_states


def skipping_module(model: torch.nn.Module, skip: SkipSet) -> torch.nn.Module:
    """A shallow copy of a transformers causal LM whose skipped sublayers pass the residual through.
    The weights are the target's own tensors."""
    layers = decoder_layers(model)
    if len(layers) != skip.layers:
        raise VerispecError(f"the skip set is for {skip.layers} layers; this target has {len(layers)}")
    outer = copy.copy(model)
    outer._modules = dict(model._modules)
    decoder = copy.copy(model.model)
    decoder._modules = dict(model.model._modules)
    decoder.layers = torch.nn.ModuleList(
        _SkippingLayer(layer, i in skip.attention, i in skip.mlp) if (i in skip.attention or i in skip.mlp)
        else layer for i, layer in enumerate(layers))
    outer.model = decoder
    if skip.head is not None and skip.head < outer.get_output_embeddings().weight.shape[0]:
        outer.lm_head = _PrefixHead(outer.get_output_embeddings(), skip.head)
    return outer


class _PrefixHead(torch.nn.Module):
    """An LM head over the first n token ids: their logits, -inf for the others (q is 0 there)."""

    def __init__(self, head: torch.nn.Module, n: int) -> None:
        super().__init__()
        self.head, self.n = head, n

    @property
    def weight(self) -> torch.Tensor:  # the full head's: runners read the vocabulary size from it
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.head, "bias", None)
        part = torch.nn.functional.linear(hidden, self.head.weight[: self.n], None if bias is None else bias[: self.n])
        out = part.new_full((*part.shape[:-1], self.head.weight.shape[0]), float("-inf"))  # (..., V)
        out[..., : self.n] = part
        return out


