"""Incremental, ragged, rollback-able forward passes over a Hugging Face causal LM.

A `KVState` holds one batch's key/value cache. Each row (sequence) advances by its own
number of tokens per call, so a batch is ragged: a call's input is right-padded to the widest
row, and the padded columns become "holes" in the cache that the attention mask hides
forever. Dropping a row's last entries marks them invalid the same way, then crops the columns
no row still uses. With one row this is exactly a crop of the cache.

Positions are explicit per row (RoPE sees each row's true token positions), and the cache
index order stays chronological, so the causal mask over cache columns stays correct.

Drafts (`forward` with `parents`, then `commit`): a row may also hold *speculative* entries, draft nodes
that are not committed. A node sits at position (committed length + depth - 1) and attends to the
committed entries, its ancestors and itself, through a 4D mask (B, 1, W, L + W) given to the model; where
every row's mask is the causal one (chains), the model gets its usual 2D mask and kernels.
After verification `commit` moves the accepted path's entries into the columns right after the
committed prefix and drops the other nodes, so the cache again holds committed tokens only (a chain's
accepted drafts are already there: nothing moves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from verispec.errors import VerispecError
from verispec.models.passes import forward_nodes


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
    # Per row: cache columns of speculative tree entries ("slots", in the order they were added) and
    # each slot's parent slot (-1: the last committed token). Empty outside a tree step.
    spec_columns: list[list[int]] = field(default_factory=list)
    spec_parents: list[list[int]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    @property
    def speculative(self) -> bool:
        """Whether some row holds uncommitted draft nodes (then only `forward` with parents and `commit` apply)."""
        return any(self.spec_columns)

    def _no_speculative(self, what: str) -> None:
        if self.speculative:
            raise ValueError(f"{what} needs the draft nodes committed first (commit)")

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (e.g. drop finished sequences), then drop the columns no row uses. rows: (B',) long."""
        self._no_speculative("select")
        if self.valid.shape[1] > 0:
            self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]
        self._compact()

    def extend(self, num_rows: int) -> None:
        """Add rows with no live entries at the end (sequences joining a running batch).

        Their columns are all holes until their first forward pass; positions start at 0.
        """
        self._no_speculative("extend")
        for layer in self._layers():
            pad = layer.keys.new_zeros((num_rows, *layer.keys.shape[1:]))  # (n, H, L, D)
            layer.keys = torch.cat([layer.keys, pad])
            layer.values = torch.cat([layer.values, pad])
        self.valid = torch.cat([self.valid, torch.zeros(num_rows, self.valid.shape[1], dtype=torch.bool)])
        self.lengths = torch.cat([self.lengths, torch.zeros(num_rows, dtype=torch.long)])

    def checkpoint(self):
        """What `restore` needs (`core.protocols.RestorableState`): the columns, lengths and draft nodes now."""
        return (self.valid.shape[1], self.valid.clone(), self.lengths.clone(),
                [list(c) for c in self.spec_columns], [list(p) for p in self.spec_parents])

    @torch.inference_mode()
    def restore(self, point) -> None:
        """Back to `checkpoint`'s moment: the columns a pass appended since (in every layer it reached before it
        raised) are cut, and the masks, lengths and draft nodes are those of then."""
        width, valid, lengths, columns, parents = point
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4 or keys.shape[-2] <= width:
                continue
            if width == 0 and hasattr(layer, "reset"):
                layer.reset()  # as before the first pass: not yet initialized
            else:
                layer.keys, layer.values = keys[..., :width, :], layer.values[..., :width, :]
        self.valid, self.lengths, self.spec_columns, self.spec_parents = valid, lengths, columns, parents

    def _layers(self) -> list:
        """The cache layers that hold tensors (none before the first forward pass)."""
        if self.valid.shape[1] == 0:
            return []
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]

    def truncate(self, length: int) -> None:
        """Drop the cache columns from `length` on (every row's are dead there)."""
        self.cache.crop(length - self.valid.shape[1])  # a negative count: the columns removed
        self.valid = self.valid[:, :length]

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

    device = torch.device("cpu")  # where its logits are (core.protocols.Runner)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.keep_features = False  # keep each pass's final hidden states (`features`) for draft heads
        self.features: torch.Tensor | None = None  # (B, M, E): the last pass's, aligned with its logits
        self.aux_layers: tuple[int, ...] = ()  # keep the hidden states entering these layers (EAGLE-3's features)
        self.aux_features: list[torch.Tensor] | None = None  # per row (n_b, A E): the last pass's, every token
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        config = model.config
        self.context_window: int = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 30
        self.dtype: torch.dtype = next(model.parameters()).dtype

    def cache_bytes(self, tokens: int) -> int:
        """Bytes one row's cache holds at `tokens` tokens: keys and values of every layer in the model's dtype.
        (A ragged batch's rows also hold the holes between other rows' tokens: see the module docstring.)"""
        config = self.model.config
        layers = int(config.num_hidden_layers)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return 2 * layers * heads * head_dim * self.dtype.itemsize * tokens

    def new_state(self, batch_size: int) -> KVState:
        cache = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            # Sliding-window layers (Gemma 2 / 3) drop keys past their window, so a rollback past it cannot be undone
            # and the columns would no longer be positions: keep every layer whole; the model's sliding-window mask
            # still limits what each layer attends to (counted in cache columns: in a ragged batch a shorter row's
            # holes widen its window, so run a sliding-window target one sequence at a time).
            cache = DynamicCache()
        return KVState(
            cache=cache,
            valid=torch.zeros(batch_size, 0, dtype=torch.bool),
            lengths=torch.zeros(batch_size, dtype=torch.long),
        )

    @torch.inference_mode()
    def forward(self, state: KVState, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """Append each row's tokens to the cache and return logits at each row's last positions.

        Args:
            state: the batch's cache; updated in place.
            tokens: B lists of new token ids (a list may be empty: that row only waits).
            num_logits: for each row, how many of its last new positions need logits (<= len(tokens[b])).
            parents: None, or per row the parent slots of its last len(parents[b]) tokens, which are draft nodes
                (see `core.protocols.Runner` and `_forward_tree`).
        Returns:
            (B, M, V) float logits, M = max(num_logits); row b's logits for its last num_logits[b]
            positions are in [:, :num_logits[b]] in order, the rest is filler.
        """
        if not state.speculative and (parents is None or not any(parents)):
            return self._forward_committed(state, tokens, num_logits)
        return forward_nodes(tokens, num_logits, parents, lambda chains, nodes, parents, root: self._forward_tree(
            state, chains, nodes, parents, root))

    def _forward_committed(self, state: KVState, tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """`forward` without draft nodes."""
        counts = torch.tensor([len(t) for t in tokens], dtype=torch.long)  # (B,)
        W = self._width(int(counts.max()))
        M = max(1, max(num_logits))
        input_ids = _pad_rows(tokens, W)  # (B, W)
        columns = torch.arange(W)  # (W,)
        new_valid = columns[None, :] < counts[:, None]  # (B, W)
        position_ids = state.lengths[:, None] + columns[None, :]  # (B, W)
        attention_mask = self._fit(torch.cat([state.valid, new_valid], dim=1).long())  # (B, L + W)
        wanted = torch.tensor(num_logits, dtype=torch.long)  # (B,)
        # Row b keeps positions counts[b] - wanted[b] + j for j < M, clamped into the row.
        keep = (counts - wanted)[:, None] + torch.arange(M)[None, :]  # (B, M)
        keep = keep.clamp(min=0, max=max(W - 1, 0))
        logits = self._run(state, input_ids, position_ids, attention_mask, keep, counts)
        state.valid = torch.cat([state.valid, new_valid], dim=1)
        state.lengths = state.lengths + counts
        return logits

    def _run(self, state: KVState, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
             keep: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One model call on the cache. input_ids, position_ids: (B, W); keep: (B, M); counts: (B,) real tokens
        per row (the first of its W columns) -> (B, M, V) float logits."""
        caught = []  # the final norm's output (B, W, E), when draft heads want the hidden states
        entering: dict[int, torch.Tensor] = {}  # aux layer -> (B, W, E) the hidden states entering it
        hooks = []
        if self.keep_features:
            hooks.append(self.model.model.norm.register_forward_hook(lambda module, args, output: caught.append(output)))
        for i in self.aux_layers:
            def grab(module, args, kwargs, i=i):
                entering[i] = args[0] if args else kwargs["hidden_states"]
            hooks.append(self.model.model.layers[i].register_forward_pre_hook(grab, with_kwargs=True))
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=state.cache, use_cache=True, logits_to_keep=keep)
        finally:
            for hook in hooks:
                hook.remove()
        if caught:
            final = caught[-1]
            self.features = final.gather(1, keep[:, :, None].expand(-1, -1, final.shape[-1])).float()  # (B, M, E)
        if self.aux_layers:
            aux = torch.cat([entering[i] for i in self.aux_layers], dim=-1).float()  # (B, W, A E)
            self.aux_features = [aux[b, : int(n)].clone() for b, n in enumerate(counts)]
        return out.logits.float()  # (B, M, V)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) token ids -> (n, E) float32 rows of the target's token embedding (draft heads embed with it)."""
        with torch.inference_mode():
            embed = self.model.get_input_embeddings()
            return embed(tokens.to(embed.weight.device)).float().cpu()

    def _forward_tree(self, state: KVState, chains: list[list[int]], nodes: list[list[int]],
                      parents: list[list[int]], root: list[bool]) -> torch.Tensor:
        """Append committed tokens, then speculative tree nodes, per row, in one pass.

        Args:
            state: the batch's cache; updated in place.
            chains: B lists of committed tokens not yet in the cache (read causally, as by `forward`); a
                row's list must be empty once the row holds tree entries.
            nodes: B lists of tree-node tokens. Each attends to the committed prefix, its ancestors and
                itself only, at position (committed length + depth - 1).
            parents: parents[b][j] is the parent of nodes[b][j] as a slot of row b: slots number the
                row's tree entries in the order they were added since the last commit (earlier
                calls first, then this call's nodes); -1 is the last committed token. Parents come first.
        Returns:
            (B, M, V) float logits: row b has, in order, the logits after its last chain token (if
            chains[b] is not empty) and after each of its nodes; M is the most any row has, the rest is filler.
        """
        B, L = len(chains), state.valid.shape[1]
        if not state.spec_columns:
            state.spec_columns, state.spec_parents = [[] for _ in range(B)], [[] for _ in range(B)]
        for b in range(B):  # check everything before the state changes
            held = len(state.spec_columns[b])
            if chains[b] and held:
                raise ValueError("committed tokens cannot follow draft nodes: commit first")
            for j, parent in enumerate(parents[b]):
                if not -1 <= parent < held + j:
                    raise ValueError(f"row {b}: node {j} has parent slot {parent}, which does not exist yet")
        chain_counts = [len(c) for c in chains]
        counts = torch.tensor([c + len(n) for c, n in zip(chain_counts, nodes)], dtype=torch.long)  # (B,)
        W = self._width(max(1, int(counts.max())))
        input_ids = _pad_rows([c + n for c, n in zip(chains, nodes)], W)  # (B, W)
        columns = torch.arange(W)  # (W,)
        new_valid = columns[None, :] < counts[:, None]  # (B, W)
        position_ids = state.lengths[:, None] + columns[None, :]  # (B, W) chain positions; nodes set below
        committed = state.valid.clone()  # (B, L) committed entries
        mask = torch.zeros(B, W, L + W, dtype=torch.bool)  # (B, W, L + W) query j attends to column c
        mask[:, :, :L] = committed[:, None, :]
        mask[:, :, L:] = torch.ones(W, W, dtype=torch.bool).tril()  # causal among the chain tokens
        keep_rows: list[list[int]] = []
        for b in range(B):
            spec_cols, spec_parents = state.spec_columns[b], state.spec_parents[b]
            committed[b, spec_cols] = False
            mask[b, :, spec_cols] = False
            depth = _slot_depths(spec_parents)
            first_new = len(spec_cols)
            for j, parent in enumerate(parents[b]):
                column = L + chain_counts[b] + j
                depth.append(1 if parent < 0 else depth[parent] + 1)
                spec_cols.append(column)
                spec_parents.append(parent)
                query = chain_counts[b] + j
                row = mask[b, query]  # (L + W,)
                row[L:] = False
                row[L : L + chain_counts[b]] = True
                row[:L] = committed[b]
                slot = first_new + j
                while slot >= 0:  # itself and its ancestors
                    row[spec_cols[slot]] = True
                    slot = spec_parents[slot]
                position_ids[b, query] = state.lengths[b] + chain_counts[b] + depth[-1] - 1
            keep_rows.append(([chain_counts[b] - 1] if root[b] else []) + [chain_counts[b] + j for j in range(len(nodes[b]))])
        pad = ~new_valid  # (B, W) padded queries attend to their own column only: no row is empty
        mask[pad] = False
        mask[:, :, L:] |= torch.eye(W, dtype=torch.bool)[None] & pad[:, :, None]
        M = max(1, max(len(k) for k in keep_rows))
        keep = torch.tensor([k + [k[-1] if k else 0] * (M - len(k)) for k in keep_rows], dtype=torch.long)  # (B, M)
        causal = torch.cat([state.valid, new_valid], dim=1)[:, None, :] & (
            torch.arange(L + W)[None, None, :] <= L + columns[None, :, None])  # (B, W, L + W) what `forward` builds
        if bool((mask == causal)[new_valid].all()):
            # Every row is a chain over all its entries: the model's own causal-mask path is the same mask,
            # and lets it pick its usual kernels (single-chain trees then give the chain's logits bit for bit).
            attention_mask = self._fit(torch.cat([state.valid, new_valid], dim=1).long())  # (B, L + W)
        else:
            attention_mask = self._mask_4d(mask)
        logits = self._run(state, input_ids, position_ids, attention_mask, keep, counts)
        state.valid = torch.cat([state.valid, new_valid], dim=1)
        state.lengths = state.lengths + torch.tensor(chain_counts, dtype=torch.long)
        return logits

    def _width(self, width: int) -> int:
        """The width a pass over `width` columns runs at (a static-cache runner pads to the widths it captured)."""
        return width

    def _fit(self, mask: torch.Tensor) -> torch.Tensor:
        """A (B, L + W) or (B, W, L + W) mask over the cache's columns, as this runner's cache takes it."""
        return mask

    def _mask_4d(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, W, L + W) bool (True: attend) -> the 4D mask the model's attention takes."""
        mask = self._fit(mask)
        implementation = getattr(self.model.config, "_attn_implementation", "sdpa")
        if implementation == "sdpa":
            return mask[:, None]  # (B, 1, W, L + W) bool
        if implementation == "eager":
            additive = torch.zeros(mask.shape, dtype=self.dtype)
            return additive.masked_fill(~mask, torch.finfo(self.dtype).min)[:, None]  # (B, 1, W, L + W)
        raise VerispecError(f"tree speculation needs 'sdpa' or 'eager' attention; this model uses '{implementation}'")

    @torch.inference_mode()
    def commit(self, state: KVState, paths: list[list[int]]) -> None:
        """Keep each row's accepted path of draft entries as committed tokens and drop its other entries.

        paths[b]: slots of row b from the root down (each slot's parent is the one before it; the
        first's is -1), possibly empty. Their keys and values move, in order, to the columns right
        after the row's committed prefix; the columns after them become holes of that row.
        """
        if not state.spec_columns:
            if any(paths):
                raise ValueError("no draft nodes to commit")
            return
        B, L = state.batch_size, state.valid.shape[1]
        source = torch.arange(L).repeat(B, 1)  # (B, L) column each column takes its entry from
        low = L
        for b, path in enumerate(paths):
            spec_cols, spec_parents = state.spec_columns[b], state.spec_parents[b]
            if not spec_cols:
                if path:
                    raise ValueError(f"row {b} holds no draft nodes")
                continue
            for i, slot in enumerate(path):
                expected = -1 if i == 0 else path[i - 1]
                if not 0 <= slot < len(spec_cols) or spec_parents[slot] != expected:
                    raise ValueError(f"row {b}: slots {path} are not a path from the root")
            start = spec_cols[0]  # the row's first tree entry: everything after it is tree or hole
            for i, slot in enumerate(path):
                source[b, start + i] = spec_cols[slot]
            state.valid[b, start:] = False
            state.valid[b, start : start + len(path)] = True
            low = min(low, start)
        if low < L and bool((source[:, low:] != torch.arange(low, L)).any()):  # a chain's drafts stay where they are
            index = source[:, low:] - low  # (B, R) within the region
            for layer in state._layers():
                H, D = layer.keys.shape[1], layer.keys.shape[3]
                gather = index[:, None, :, None].expand(B, H, L - low, D)  # (B, H, R, D)
                layer.keys[:, :, low:L] = layer.keys[:, :, low:L].gather(2, gather)  # a static cache runs past L
                layer.values[:, :, low:L] = layer.values[:, :, low:L].gather(2, gather)
        state.lengths = state.lengths + torch.tensor([len(p) for p in paths], dtype=torch.long)
        state.spec_columns, state.spec_parents = [], []
        self._crop_dead_columns(state)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The target's own LM head on (n, E) hidden states (after the final norm): (n, V) float32 logits,
        over token ids below `rows` only (-inf above) when given. For draft heads tied to the target's."""
        head = self.model.get_output_embeddings()
        weight = head.weight  # (V, E); a meta tensor for a packed head (models.runners.packed), which runs whole
        rows = self.vocab_size if rows is None else min(rows, self.vocab_size)
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"))  # (n, V)
        if weight.device.type == "meta":
            out[:, :rows] = head(hidden.to(self.dtype)).float()[:, :rows]
        else:
            out[:, :rows] = torch.nn.functional.linear(hidden.to(weight.device, weight.dtype), weight[:rows]).float().cpu()
        return out

    def training_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor,
                        cols: torch.Tensor) -> torch.Tensor:
        """Next-token logits with gradients at chosen positions, for online adaptation of a draft
        (`verispec.drafters.draft_adapt`). `model` is a trainable copy of this runner's model.
        See `training_logits` below."""
        return training_logits(model, input_ids, rows, cols)

    @staticmethod
    def _crop_dead_columns(state: KVState) -> None:
        live_columns = state.valid.any(dim=0).nonzero()
        new_len = int(live_columns.max()) + 1 if live_columns.numel() else 0
        if new_len < state.valid.shape[1]:
            state.truncate(new_len)


def training_logits(model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Next-token logits with gradients at chosen positions of a transformers causal LM.

    A runner that maps its model's ids (e.g. a reduced draft vocabulary) wraps this together with
    `forward`, so both return logits over the same ids.

    Args:
        input_ids: (B, T) long, right-padded (causal attention: padding never reaches a chosen position).
        rows, cols: (N,) long each: logits are wanted after token cols[i] of row rows[i] (a row may
            serve several positions: examples whose contexts are prefixes of one another share it).
    Returns:
        (N, V) float32 logits.
    """
    hidden = model.base_model(input_ids=input_ids).last_hidden_state  # (B, T, H)
    picked = hidden[rows, cols]  # (N, H)
    return model.get_output_embeddings()(picked).float()  # (N, V)


def _pad_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """B token lists -> (B, width) long, right-padded with 0."""
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # (B, W)
    for b, row in enumerate(rows):
        if row:
            input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return input_ids


def _slot_depths(parents: list[int]) -> list[int]:
    """Depth of each tree slot (1: a child of the last committed token) from its parent slot."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths
