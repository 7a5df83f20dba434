"""The quantized CPU runner: the runner interface (`core.protocols.Runner`: new_state / forward / commit) over a
`GGUFModel`, every op a C kernel.

Caches. Each row (sequence) owns a static, position-indexed cache per layer, (Hkv, capacity, D) for keys and
for values, grown by doubling: float16 by default (each value rounded to the nearest half, as llama.cpp's default
cache keeps them: half the bytes a pass reads and a row holds), float32 with `cache_dtype="float32"`. Committed
token c sits in column c, and rows never pad each other.
Head-major, so that attention streams each key/value head's columns from contiguous memory.

Trees. Between commits a row may hold speculative entries: slot s (numbered in the order added) sits in
column base + s, base being the committed length, at position base + depth - 1. A node attends to columns
0 .. base - 1, then its ancestors' columns and its own, in increasing order. A chain token at the same
depth attends to the same keys and values in the same order, and the kernels compute each query alone
in a fixed order, so a node's logits equal the chain's bit for bit. `commit` copies the accepted
path's entries to columns base, base + 1, ... and forgets the others. A chain's nodes already sit there (slot s
in column base + s, its ancestors the columns before it): a node whose ancestors are contiguous is read as the
causal query it is, and committing a chain's first drafts copies nothing, only the length moves.

Batch invariance. Every op computes a token's row with the same arithmetic whatever else the pass holds
(csrc/kernels.c says how): a token's logits are the same bits alone, in a wide verification pass, in a
ragged batch or in a tree. The tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ctypes

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.models.gguf import CACHE_DTYPES, ops, tiles
from verispec.models.gguf.model import GGUFModel
from verispec.models.gguf.attend import Attend, Query, windowed
from verispec.models.gguf.experts import ExpertStructs
from verispec.models.gguf.per_op import experts_sublayer, layers_per_op
from verispec.models.gguf.native import DimsStruct, LayerStruct, WeightStruct, check, lib, ptr, set_threads
from verispec.models.gguf.rope import rope_frequencies
from verispec.models.passes import forward_nodes, tree_pass_counts
from verispec.models.runners.hf import training_logits

# Tokens in one pass (all rows together): a longer prompt is read in chunks of this many. Measured on the default
# target, 2 threads, a 1,500-token prompt read alone: 11.3 / 11.2 / 11.2 s in passes of 128 / 256 / 512 tokens,
# 14.1 s in one pass of 1,500 (a wide pass's activations no longer stay in the caches). The bits are the same.
MAX_PASS_TOKENS = 512


@dataclass
class RowCache:
    """One sequence: keys and values (layers, Hkv, capacity, D), its committed length, its tree entries."""

    keys: np.ndarray
    values: np.ndarray
    length: int = 0
    spec_parents: list[int] = field(default_factory=list)  # slot -> parent slot (-1: the last committed token)
    spec_depths: list[int] = field(default_factory=list)  # slot -> depth (1: a child of the last committed token)

    def reserve(self, columns: int) -> None:
        capacity = self.keys.shape[2]
        if columns <= capacity:
            return
        while capacity < columns:
            capacity *= 2
        for name in ("keys", "values"):
            old = getattr(self, name)
            layers, heads, _, dim = old.shape
            new = np.empty((layers, heads, capacity, dim), old.dtype)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)


@dataclass
class NativeState:
    """A batch's caches, one `RowCache` per row. lengths: (B,) long, committed tokens per row."""

    runner: "NativeRunner"
    rows: list[RowCache]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([row.length for row in self.rows], dtype=torch.long)

    @property
    def speculative(self) -> bool:
        return any(row.spec_parents for row in self.rows)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order. rows: (B',) long."""
        if self.speculative:
            raise ValueError("select needs the draft nodes committed first (commit)")
        self.rows = [self.rows[i] for i in rows.tolist()]

    def extend(self, num_rows: int) -> None:
        self.rows += [self.runner.new_row() for _ in range(num_rows)]

    def read_prefix(self, row: int, length: int) -> CachePrefix:
        """A copy of row `row`'s first `length` committed positions (`core.protocols.PrefixState`)."""
        cache = self.rows[row]
        if not 0 <= length <= cache.length:
            raise ValueError(f"row {row} holds {cache.length} committed positions, not {length}")
        return CachePrefix(cache.keys[:, :, :length].copy(), cache.values[:, :, :length].copy())

    def write_prefix(self, row: int, prefix: CachePrefix) -> None:
        """An empty row takes a copied prefix as its committed positions: its keys and values are the bits a pass
        over those tokens would write (the kernels are batch-invariant), so what follows is decoded as if it had."""
        cache = self.rows[row]
        if cache.length or cache.spec_parents:
            raise ValueError(f"row {row} is not empty")
        cache.reserve(prefix.length)
        cache.keys[:, :, : prefix.length] = prefix.keys
        cache.values[:, :, : prefix.length] = prefix.values
        cache.length = prefix.length

    def checkpoint(self):
        """What `restore` needs (`core.protocols.RestorableState`): each row's committed length and draft nodes (a pass
        writes only past a row's committed length, so the columns there need no copy)."""
        return [(row, row.length, list(row.spec_parents), list(row.spec_depths)) for row in self.rows]

    def restore(self, point) -> None:
        """Back to `checkpoint`'s moment, whatever a pass since then wrote past the rows' committed lengths."""
        self.rows = [row for row, *_ in point]
        for row, length, parents, depths in point:
            row.length, row.spec_parents, row.spec_depths = length, parents, depths


@dataclass(frozen=True)
class CachePrefix:
    """A copy of a row's first `length` committed positions: keys and values (layers, Hkv, length, D)."""

    keys: np.ndarray
    values: np.ndarray

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def head(self, length: int) -> CachePrefix:
        """The first `length` positions (views: `write_prefix` copies them into a row)."""
        return self if length == self.length else CachePrefix(self.keys[:, :, :length], self.values[:, :, :length])


class NativeRunner:
    """verispec's quantized CPU runner over a GGUF model."""

    device = torch.device("cpu")  # where its logits are (core.protocols.Runner)

    def __init__(self, model: GGUFModel, threads: int | None = None, initial_capacity: int = 256,
                 source: torch.nn.Module | None = None, fused: bool = True, cache_dtype: str = CACHE_DTYPES[0]) -> None:
        """source: the torch module a converted draft came from (`convert.model_from_torch`): online
        adaptation trains it, and assigning `model` converts the new weights. None for a GGUF file.
        fused: each layer in one C call (vs_layer_forward); False runs the same kernels one by one from
        Python (the same bits, ~3 ms slower a pass on the 1.5B target; the tests compare the two).
        cache_dtype: "float16" (keys and values rounded to halves, as llama.cpp's default cache) or "float32"
        (every bit the layer computed: what the tests comparing with transformers use)."""
        if cache_dtype not in CACHE_DTYPES:
            raise VerispecError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {cache_dtype!r}")
        self.cache_dtype = np.dtype(cache_dtype)
        self._source = source
        self.fused = fused
        self.gguf = model
        self.config = model.config
        self.vocab_size = model.config.vocab
        self.context_window = model.config.context
        self.dtype = torch.float32
        self.threads = threads or torch.get_num_threads()
        self.keep_draft_prefix = True  # keep draft passes' full-layer prefixes for the next full pass (_Resume)
        self.resumed_tokens = 0  # tokens full passes started past the embedding, thanks to _Resume
        self._resume: dict[tuple, _Resume] = {}  # by _resume_key: what the draft passes since the last full pass kept
        self.keep_features = False  # keep each full pass's final hidden states (`features`) for draft heads
        self.features: torch.Tensor | None = None  # (B, M, E): the last full pass's, aligned with its logits
        self.aux_layers: tuple[int, ...] = ()  # keep the hidden states entering these layers (EAGLE-3's features)
        self.aux_features: list[torch.Tensor] | None = None  # per row (n_b, A E): the last full pass's, every token
        self.initial_capacity = initial_capacity
        set_threads(self.threads)
        tiles.apply(self.threads)  # this machine's widest AVX-512 tile: measured once, then read from the cache

    @property
    def gguf(self) -> GGUFModel:
        return self._gguf

    @gguf.setter
    def gguf(self, model: GGUFModel) -> None:
        """The weights, and the C structures that point at them (rebuilt whenever the weights change)."""
        c = model.config
        self._gguf = model
        self._heads: dict[int, ops.Weight] = {}  # draft LM heads over the first n token ids (Weight.first_rows)
        # the global layers' RoPE: (R/2,) each pair's frequency divisor (or None) and cos / sin's factor
        self._rope_factors, self._rope_mscale = rope_frequencies(
            c.rope_kind, c.rotated, c.rope_theta, c.rope_scale, c.rope_context, c.rope_attn_factor, model.rope_factors)
        self._experts_c = {i: ExpertStructs(layer) for i, layer in enumerate(model.layers) if layer.experts}
        self._dims = DimsStruct(c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, int(c.neox), int(c.gelu),
                                int(c.whole_qk_norm), c.rotated, c.rms_eps, c.scale, c.residual_scale, c.attn_softcap,
                                int(self.cache_dtype == np.float16))

        def weight(w: ops.Weight | None) -> WeightStruct:
            return WeightStruct() if w is None else WeightStruct(w.qtype, w.address, w.rows, w.cols)

        def vector(a: np.ndarray | None) -> int | None:
            return None if a is None else ptr(a)

        self._layers_c = [LayerStruct(vector(layer.attn_norm), vector(layer.ffn_norm), vector(layer.q_bias),
                                    vector(layer.k_bias), vector(layer.v_bias), vector(layer.q_norm),
                                    vector(layer.k_norm), vector(layer.attn_post_norm), vector(layer.ffn_post_norm),
                                    weight(layer.q), weight(layer.k),
                                    weight(layer.v), weight(layer.out), weight(layer.gate), weight(layer.up),
                                    weight(layer.down)) for layer in model.layers]
        self._layer_refs = [ctypes.byref(layer) for layer in self._layers_c]  # made once: a draft's pass is short

    @property
    def model(self) -> torch.nn.Module | None:
        return self._source

    @model.setter
    def model(self, module: torch.nn.Module) -> None:  # online adaptation swaps in new weights
        from verispec.models.gguf.convert import model_from_torch

        self.gguf = model_from_torch(module, str(self.gguf.path), qtype=self.gguf.head.qtype)  # in the same format
        self._source = module

    def training_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, rows: torch.Tensor,
                        cols: torch.Tensor) -> torch.Tensor:
        """As `ModelRunner.training_logits`: the torch source model's logits, for online adaptation."""
        return training_logits(model, input_ids, rows, cols)

    def head_logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The target's own LM head on (n, E) hidden states (after the final norm): (n, V) float32 logits,
        over token ids below `rows` only (-inf above) when given. For draft heads tied to the target's."""
        x = np.ascontiguousarray(hidden.detach().float().numpy())
        return torch.from_numpy(self._head_logits(x, rows))

    def _head_logits(self, final: np.ndarray, rows: int | None) -> np.ndarray:
        """(n, E) final hidden states -> (n, V) float32 logits of the LM head, or of its first `rows` rows
        (`Weight.first_rows`, made once per size) with -inf above."""
        if rows is None or rows >= self.vocab_size:
            return self._final(self.gguf.head(ops.Activations(final)))
        if rows not in self._heads:
            self._heads[rows] = self.gguf.head.first_rows(rows)
        logits = np.full((final.shape[0], self.vocab_size), -np.inf, np.float32)  # (n, V)
        logits[:, :rows] = self._final(self._heads[rows](ops.Activations(final)))
        return logits

    def _final(self, logits: np.ndarray) -> np.ndarray:
        """The head's logits as the model ends them, each step as llama.cpp takes it: divided by a logit scale (a
        product by its float32 inverse: Granite), then capped, c tanh(logits / c) (Gemma)."""
        c = self.config
        if c.logit_scale != 1.0:
            logits *= np.float32(1.0) / np.float32(c.logit_scale)
        cap = np.float32(c.final_softcap)
        if not cap:
            return logits
        return np.tanh(logits * (np.float32(1.0) / cap)) * cap

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """(n,) token ids -> (n, E) float32 rows of the target's token embedding (draft heads embed with it)."""
        return torch.from_numpy(self.gguf.embed.take_rows(tokens.numpy().astype(np.int64)))

    def new_row(self) -> RowCache:
        c = self.config
        shape = (c.layers, c.kv_heads, self.initial_capacity, c.head_dim)
        return RowCache(np.zeros(shape, self.cache_dtype), np.zeros(shape, self.cache_dtype))

    def new_state(self, batch_size: int) -> NativeState:
        return NativeState(self, [self.new_row() for _ in range(batch_size)])

    def cache_bytes(self, tokens: int) -> int:
        """Bytes one row's cache holds once it holds `tokens` tokens: keys and values per layer (`cache_dtype`), the
        capacity doubled from `initial_capacity` until it fits (`RowCache.reserve`)."""
        capacity = self.initial_capacity
        while capacity < tokens:
            capacity *= 2
        c = self.config
        return 2 * c.layers * capacity * c.kv_dim * self.cache_dtype.itemsize

    # ------------------------------------------------------------------ the interface

    def forward(self, state: NativeState, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None, skip: np.ndarray | None = None,
                head_rows: int | None = None) -> torch.Tensor:
        """Append each row's tokens; (B, M, V) logits at each row's last num_logits[b] positions,
        M = max(1, max(num_logits)); the last len(parents[b]) tokens are draft nodes, uncommitted until `commit`
        (`core.protocols.Runner`). skip: (layers,) int32 sublayers to skip (`verispec.models.skip.SkipSet.bits`:
        the self-speculation draft), None runs the whole model. head_rows: the draft's LM head keeps only token
        ids below this (-inf logits above); None keeps all."""
        if not state.speculative and (parents is None or not any(parents)):
            return self._forward_committed(state, tokens, num_logits, skip, head_rows)
        return forward_nodes(tokens, num_logits, parents, lambda chains, nodes, parents, root: self._forward_tree(
            state, chains, nodes, parents, root, skip, head_rows))

    def _forward_committed(self, state: NativeState, tokens: list[list[int]], num_logits: list[int],
                           skip: np.ndarray | None, head_rows: int | None) -> torch.Tensor:
        """`forward` without draft nodes: every token is committed."""
        queries, wanted = [], []
        for b, row_tokens in enumerate(tokens):
            row = state.rows[b]
            if num_logits[b] > len(row_tokens):
                raise ValueError(f"row {b}: {num_logits[b]} logits asked for {len(row_tokens)} new tokens")
            for j, token in enumerate(row_tokens):
                column = row.length + j
                queries.append(Query(b, token, column, column, column + 1, []))
                wanted.append(j >= len(row_tokens) - num_logits[b])
        logits = self._run(state, queries, wanted, len(tokens), max(1, max(num_logits, default=0)), skip, head_rows)
        for b, row_tokens in enumerate(tokens):
            state.rows[b].length += len(row_tokens)
        return logits

    def _forward_tree(self, state: NativeState, chains: list[list[int]], nodes: list[list[int]],
                      parents: list[list[int]], root: list[bool], skip: np.ndarray | None,
                      head_rows: int | None) -> torch.Tensor:
        """Committed tokens chains[b], then draft nodes nodes[b] with parent slots parents[b]; (B, M, V) logits
        after the last chain token (where root[b]) and each node."""
        for b, row in enumerate(state.rows):  # check everything before the state changes
            held = len(row.spec_parents)
            if chains[b] and held:
                raise ValueError("committed tokens cannot follow draft nodes: commit first")
            for j, parent in enumerate(parents[b]):
                if not -1 <= parent < held + j:
                    raise ValueError(f"row {b}: node {j} has parent slot {parent}, which does not exist yet")
        queries, wanted = [], []
        for b, row in enumerate(state.rows):
            chain, base = chains[b], row.length + len(chains[b])
            for j, token in enumerate(chain):
                column = row.length + j
                queries.append(Query(b, token, column, column, column + 1, []))
                wanted.append(root[b] and j == len(chain) - 1)
            held = len(row.spec_parents)
            for j, (token, parent) in enumerate(zip(nodes[b], parents[b])):
                slot = held + j
                row.spec_parents.append(parent)
                row.spec_depths.append(1 if parent < 0 else row.spec_depths[parent] + 1)
                path = []
                while slot >= 0:
                    path.append(base + slot)
                    slot = row.spec_parents[slot]
                depth = row.spec_depths[-1]
                if path[0] == base + depth - 1:  # ancestors in columns base, base + 1, ...: a causal query
                    queries.append(Query(b, token, base + depth - 1, base + held + j, base + depth, []))
                else:  # an ancestor at depth d sits at position base + d - 1
                    queries.append(Query(b, token, base + depth - 1, base + held + j, base, path[::-1],
                                          list(range(base, base + depth))))
                wanted.append(True)
        width = max(tree_pass_counts(nodes, root), default=0)
        logits = self._run(state, queries, wanted, len(chains), max(1, width), skip, head_rows)
        for b, row in enumerate(state.rows):
            row.length += len(chains[b])
        return logits

    def commit(self, state: NativeState, paths: list[list[int]]) -> None:
        """Keep each row's accepted path of draft slots (root first) as committed tokens; drop the rest."""
        for b, (row, path) in enumerate(zip(state.rows, paths)):
            if not row.spec_parents and path:
                raise ValueError(f"row {b} holds no draft nodes")
            for i, slot in enumerate(path):
                expected = -1 if i == 0 else path[i - 1]
                if not 0 <= slot < len(row.spec_parents) or row.spec_parents[slot] != expected:
                    raise ValueError(f"row {b}: slots {path} are not a path from the root")
        for row, path in zip(state.rows, paths):
            base = row.length
            for i, slot in enumerate(path):  # sources lie at or right of their destinations: copy in order
                if slot != i:
                    row.keys[:, :, base + i] = row.keys[:, :, base + slot]
                    row.values[:, :, base + i] = row.values[:, :, base + slot]
            row.length += len(path)
            row.spec_parents, row.spec_depths = [], []

    # ------------------------------------------------------------------ one pass

    def _check(self, queries: list[Query]) -> None:
        bad = [q.token for q in queries if not 0 <= q.token < self.vocab_size]
        if bad:
            raise VerispecError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        for q in queries:
            if q.position >= self.context_window:
                raise VerispecError(f"position {q.position} is past the model's context window ({self.context_window})")

    def _run(self, state: NativeState, queries: list[Query], wanted: list[bool], batch: int, width: int,
             skip: np.ndarray | None = None, head_rows: int | None = None) -> torch.Tensor:
        """Evaluate the queries (in chunks of MAX_PASS_TOKENS) and return (batch, width, V) logits of the wanted ones."""
        self._check(queries)
        # A full pass takes (and ends) the layer prefixes the last draft passes left behind; see `_Resume`.
        resume = None
        if skip is None:
            resume, self._resume = self._resume, {}
        aux: list[list[np.ndarray]] | None = [[] for _ in range(batch)] if skip is None and self.aux_layers else None
        if aux is None and len(queries) <= MAX_PASS_TOKENS and (
                [q.row for q, k in zip(queries, wanted) if k] == [b for b in range(batch) for _ in range(width)]):
            # one chunk whose wanted logits are the (B, M) grid in order (a plain step, a chain's verification): the
            # pass's own arrays, viewed, not zero-filled and copied (0.6 MB each a token of a 151,936-token vocabulary)
            logits, final, _ = self._pass(state, queries, wanted, skip, resume, head_rows)
            if skip is None and self.keep_features:
                self.features = torch.from_numpy(final).view(batch, width, self.config.hidden)
            return torch.from_numpy(logits).view(batch, width, self.vocab_size)
        out = torch.zeros(batch, width, self.vocab_size)  # (B, M, V)
        features = torch.zeros(batch, width, self.config.hidden) if skip is None and self.keep_features else None
        filled = [0] * batch
        for start in range(0, len(queries), MAX_PASS_TOKENS):
            chunk, keep = queries[start : start + MAX_PASS_TOKENS], wanted[start : start + MAX_PASS_TOKENS]
            # (n_wanted, V), (n_wanted, E), (n, A E) or None
            logits, final, chunk_aux = self._pass(state, chunk, keep, skip, resume, head_rows)
            for q, row_logits, row_final in zip([q for q, k in zip(chunk, keep) if k], logits, final):
                out[q.row, filled[q.row]] = torch.from_numpy(row_logits)
                if features is not None:
                    features[q.row, filled[q.row]] = torch.from_numpy(row_final)
                filled[q.row] += 1
            if aux is not None:
                for q, row_aux in zip(chunk, chunk_aux):
                    aux[q.row].append(row_aux)
        if features is not None:
            self.features = features
        if aux is not None:
            width_aux = len(self.aux_layers) * self.config.hidden
            self.aux_features = [torch.from_numpy(np.stack(a)) if a else torch.zeros(0, width_aux) for a in aux]
        return out

    @staticmethod
    def _resume_key(row: RowCache, q: Query) -> tuple:
        """What a token's first layers depend on: its row's cache, column, id, position and what it attends to."""
        return row.keys.ctypes.data, q.column, q.token, q.position, q.prefix, tuple(q.extra)

    def _pass(self, state: NativeState, queries: list[Query], wanted: list[bool], skip: np.ndarray | None = None,
              resume: dict | None = None, head_rows: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """One forward over these tokens: writes their keys and values, returns (n_wanted, V) float32 logits,
        the (n_wanted, E) final hidden states (after the final norm) they came from and, on a full pass with
        `aux_layers`, every token's (n, A E) hidden states entering those layers (else None).

        skip: (layers,) int32 sublayers to skip (a draft pass); its tokens' hidden states entering the first
        layer it skips are kept for the next full pass (`_Resume`). resume: those kept states, by `_resume_key`;
        a full pass starts such a token at that layer instead of at the embedding."""
        c, model = self.config, self.gguf
        n = len(queries)
        aux_ids = self.aux_layers if skip is None else ()
        if n == 0:
            empty_aux = np.zeros((0, len(aux_ids) * c.hidden), np.float32) if aux_ids else None
            return np.zeros((0, self.vocab_size), np.float32), np.zeros((0, c.hidden), np.float32), empty_aux
        for q in queries:
            state.rows[q.row].reserve(q.column + 1)
        rows = [state.rows[q.row] for q in queries]
        x = model.embed.take_rows(np.array([q.token for q in queries], np.int64))  # (N, E)
        if c.embed_scale != 1.0:
            x *= np.float32(c.embed_scale)  # one float32 product a value, as llama.cpp scales them
        if skip is not None:
            first = int(np.flatnonzero(skip)[0]) if skip.any() else c.layers  # layers before it run in full
            self._layers(x, queries, rows, 0, first, None)
            if first and self.keep_draft_prefix:
                for i, q in enumerate(queries):
                    self._resume[self._resume_key(rows[i], q)] = _Resume(first, x[i].copy())
            self._layers(x, queries, rows, first, c.layers, skip)
        else:
            # with aux layers every token starts at the embedding (their states are kept on the way)
            hits = [resume.get(self._resume_key(rows[i], q)) if resume and not aux_ids else None
                    for i, q in enumerate(queries)]
            starts = [0 if h is None else h.layer for h in hits]  # the layer each token starts at
            bounds = sorted(set(starts) | {c.layers} | set(aux_ids))
            for i, h in enumerate(hits):
                if h is not None:
                    x[i] = h.hidden  # untouched until the layer it starts at
            entering = {0: x.copy()} if 0 in aux_ids else {}  # layer -> (N, E) states entering it
            for low, high in zip(bounds, bounds[1:]):
                active = [i for i in range(n) if starts[i] <= low]
                if len(active) == n:
                    self._layers(x, queries, rows, low, high, None)
                else:
                    part = np.ascontiguousarray(x[active])
                    self._layers(part, [queries[i] for i in active], [rows[i] for i in active], low, high, None)
                    x[active] = part
                if high in aux_ids:
                    entering[high] = x.copy()
            self.resumed_tokens += sum(h is not None for h in hits)
        aux = np.concatenate([entering[i] for i in aux_ids], axis=1) if aux_ids else None  # (N, A E)
        keep = np.flatnonzero(np.array(wanted))
        if keep.size == 0:
            return np.zeros((0, self.vocab_size), np.float32), np.zeros((0, c.hidden), np.float32), aux
        final = ops.rmsnorm(np.ascontiguousarray(x[keep]), model.norm, c.rms_eps)  # (M, E)
        return self._head_logits(final, head_rows), final, aux  # (M, V), (M, E), (N, A E)

    def _layers(self, x: np.ndarray, queries: list[Query], rows: list[RowCache], low: int, high: int,
                skip: np.ndarray | None) -> None:
        """Layers low .. high - 1 on x (N, E) in place (skip[i]: sublayers of layer i to skip)."""
        if low >= high:
            return
        c = self.config
        bases = (np.array([r.keys.ctypes.data for r in rows], np.int64),
                 np.array([r.values.ctypes.data for r in rows], np.int64),
                 np.array([r.keys[0].nbytes for r in rows], np.int64))  # a layer: Hkv blocks of (capacity, D)
        positions = np.array([q.position for q in queries], np.int64)  # (N,)
        factors, mscale = self._rope_factors, self._rope_mscale
        table = ops.rope_table(positions, c.rotated, c.rope_theta, factors, mscale)  # (N, R/2, 2)
        views = {False: (Attend.of([(q.prefix, q.extra) for q in queries], *bases), table)}
        if any(c.local[low:high]):  # local layers: their own base, the global scaling only where the family says so
            scaling = (factors, mscale) if c.local_rope_scaled else (None, c.rope_attn_factor)
            same = c.local_rope_scaled and c.rope_theta_local == c.rope_theta
            views[True] = (Attend.of([windowed(q, c.window) for q in queries], *bases),
                           table if same else ops.rope_table(positions, c.rotated, c.rope_theta_local, *scaling))
        layers = [(i, views[bool(c.local) and c.local[i]]) for i in range(low, high)]
        if c.no_rope:  # those layers' queries and keys go unrotated: no table
            layers = [(i, (view[0], None) if c.no_rope[i] else view) for i, view in layers]
        skips = np.zeros(c.layers, np.int32) if skip is None else skip
        if self.fused:
            self._layers_fused(x, queries, layers, skips)
        else:
            x[:] = layers_per_op(self.gguf, x, queries, rows, layers, skips)

    def _layers_fused(self, x: np.ndarray, queries: list[Query], layers: list[tuple[int, tuple]],
                      skips: np.ndarray) -> None:
        """These layers on x (N, E) in place, one C call each (vs_layer_forward). layers: (index, (what its queries
        attend to, its RoPE table)). A mixture of experts' layer: its attention in this call, its experts in a second
        (`experts.experts_forward`: vs_moe_ffn), the same bits as the per-op path's."""
        columns = np.array([q.column for q in queries], np.int32)  # (N,)
        forward, dims, n, dim = lib().vs_layer_forward, ctypes.byref(self._dims), len(queries), self.config.head_dim
        # the arrays' addresses once a view, not once a layer (a draft model's pass is short enough for it to show)
        xp, columnp, pointers = ptr(x), ptr(columns), {}
        model_layers, refs, skip_bits = self.gguf.layers, self._layer_refs, skips.tolist()
        for i, view in layers:
            if (key := (id(view[0]), id(view[1]))) not in pointers:  # (what it attends to, its RoPE table or None)
                a, angles = view
                pointers[key] = (ptr(a.key_base), ptr(a.value_base), ptr(a.layer_bytes), ptr(a.prefix),
                                 ptr(a.extra_off), ptr(a.extra), None if angles is None else ptr(angles))
            keys, values, layer_bytes, prefix, extra_off, extra, anglep = pointers[key]
            layer = model_layers[i]
            skip = skip_bits[i] | (2 if layer.experts else 0)  # (bit 2: the feed-forward, here from Python)
            status = forward(dims, refs[i], xp, n, anglep, keys, values, layer_bytes, i, dim, columnp, prefix,
                             extra_off, extra, skip)
            if status:
                check(status, f"layer {i}")
            if layer.experts and not skip_bits[i] & 2:
                x += experts_sublayer(self.config, layer, x, self._experts_c[i])


@dataclass
class _Resume:
    """A draft token's hidden state entering `layer`, the first layer its draft pass skipped a part of.

    Layers before it ran in full, on the same token at the same column and position, attending to the same
    columns, whose keys and values (the target's committed ones, and the draft's for earlier tokens of its
    pass, themselves computed in full up to there) a full pass would also read: so the state, and the keys
    and values those layers wrote, are the bits a full pass computes (the kernels are batch invariant).
    A full pass over the same query starts it at `layer` (LayerSkip's reuse of the early-exit layers)."""

    layer: int
    hidden: np.ndarray  # (E,) float32
