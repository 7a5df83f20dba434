"""EAGLE-3 drafting: one decoder layer on the target's own features, chains and dynamic (EAGLE-2) trees.

Positions. Committed tokens s_0 .. s_(N-1); the target has read s_0 .. s_(N-2) (s_(N-1), the step's
recovered or bonus token, is read by the next verification pass). Its passes kept, for every token read,
the hidden states entering the head's three layers (`runner.aux_features`), fused by the head into f_t.
The head's layer holds one committed entry per position t <= N - 2, made from f_t and the embedding of
s_(t+1) (`_Row.length` = N - 1 after catching up); its output at N - 2 gives draft 1. Draft k >= 2 comes
from position N - 3 + k, fed the head's own output of the position before (standing in for the target's
feature there) and the embedding of draft k - 1. Those entries lie past `length` and are overwritten by
the next step's catching up, which reads the target's features of the tokens verification just kept.

Exactness: draft token k is drawn from the head's q_k (processed like p: temperature, top-k, top-p,
repetition penalty), which is the distribution verification divides by, at every temperature; trees grow
with `TreeGrowth` (top-token or sampled children, EAGLE-2's confidence-ranked expansion and budget), each
expanded node's children drawn from the head's distribution after the node's own path. `argmax=True`
drafts the head's argmax as a one-hot draft instead (what vLLM does; for comparison only).

Lookup first (`lookup`, off unless set): where the context and the drafts so far end in an n-gram seen
before in the context, the draft copies the token that followed it (q one-hot there, a deterministic choice
of the context) and the head goes on from the copied token; in trees it is a node's first child.

Rows are drafted one by one, so a row's drafts are the same alone or in a batch.

Prefix reuse (`reuse_prefixes`, on where the target's prefix store is): a row's entries read the target's features,
which a position taken from the target's store never gets again, so the head keeps finished rows' entries by the
tokens they were made from (entry t: the features at t and token t + 1) in a store of its own, a joining row starts
from the longest stored prefix of its tokens, and the batch lets the target take at most as many positions
(`prefix_limit`); at its first catch-up the row keeps as many entries as the target took. A conversation's later turns
then run the head's layer over what is new only, as the target reads only that.

Online adaptation (`--adapt`, `drafters.head_adapt`): the target's features of the committed positions are
logged in windows, a copy of the head trains on them with the training-time test, and the new head drafts
from the next step on.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from verispec.config import AdaptConfig, PromptLookupConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.prefix import PrefixStore
from verispec.core.protocols import FeatureRunner, NativeWeights
from verispec.core.sequence import Sequence
from verispec.drafters.drawing import constrained_logits, draw_token, penalty_seen
from verispec.drafters.head_adapt import AdaptiveHead, HeadAdaptation, HeadTrainer, eagle_loss
from verispec.drafters.prompt_lookup import lookup
from verispec.drafters.tree_growth import TreeGrowth
from verispec.errors import VerispecError
from verispec.models.heads.eagle3 import Eagle3Head


@dataclass
class _Row:
    """One sequence's keys and values of the head's layer."""

    keys: torch.Tensor  # (capacity, Hkv, D)
    values: torch.Tensor  # (capacity, Hkv, D)
    length: int = 0  # committed entries: positions 0 .. length - 1, made from the target's features
    pending: list[torch.Tensor] = field(default_factory=list)  # (n, E) fused features of positions length ..
    tokens: list[int] = field(default_factory=list)  # the sequence's tokens (its own list, growing as it commits)
    reused: bool = False  # its first entries came from the head's prefix store: fitted to the target's at catch-up

    def write(self, column: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (n, Hkv, D) into columns column .. column + n - 1 (growing the cache when needed)."""
        end = column + k.shape[0]
        if end > self.keys.shape[0]:
            grow = max(end, 2 * self.keys.shape[0]) - self.keys.shape[0]
            self.keys = torch.cat([self.keys, self.keys.new_zeros(grow, *self.keys.shape[1:])])
            self.values = torch.cat([self.values, self.values.new_zeros(grow, *self.values.shape[1:])])
        self.keys[column:end] = k
        self.values[column:end] = v


@dataclass(frozen=True)
class _HeadPrefix:
    """A row's first entries of the head's layer, kept by the tokens they were made from: entry t reads the target's
    features at t and the token after it, so the entries over n tokens are the first n - 1. keys, values: (n - 1,
    Hkv, D)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def head(self, tokens: int) -> _HeadPrefix:
        return _HeadPrefix(self.keys[: tokens - 1], self.values[: tokens - 1])


class _HeadRows:
    """The head's rows as a `core.protocols.PrefixState` for its `PrefixStore` (positions are tokens; see
    `_HeadPrefix`)."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows

    def read_prefix(self, row: int, tokens: int) -> _HeadPrefix:
        r = self.rows[row]
        return _HeadPrefix(r.keys[: tokens - 1].clone(), r.values[: tokens - 1].clone())

    def write_prefix(self, row: int, prefix: _HeadPrefix) -> None:
        r = self.rows[row]
        n = prefix.keys.shape[0]
        r.write(0, prefix.keys, prefix.values)
        r.length, r.reused = n, n > 0


class EagleDrafter(AdaptiveHead, RowStates):
    """Draft with an EAGLE-3 head on the target's features.

    Args:
        target: the target's runner (it keeps the head's layers' hidden states once this drafter starts).
        head: the head (`models.heads.eagle3.load_eagle3`), its aux layers fitted to the target.
        argmax: draft the head's argmax as one-hot drafts (vLLM's way) instead of sampling from q.
        native: run the head's linears on the native kernels in Q8_0 (a copy of the head; None: when the target
            runs on them). Only the head's speed and acceptance change: q is still what the drafts come from.
    """

    name = "eagle"
    @property
    def traits(self) -> Traits:
        """Its rows hold the target's features of every position (not rebuilt mid-answer: not restartable); argmax
        drafts (`argmax`, which the registry may set after construction) are chains only."""
        return Traits(trees=not self.argmax, adaptive=True, restartable=False, follows_prefixes=True)

    def __init__(self, target, head: Eagle3Head, argmax: bool = False, native: bool | None = None,
                 lookup: PromptLookupConfig | None = None) -> None:
        if not isinstance(target, FeatureRunner):
            raise VerispecError(f"EAGLE heads read the target's hidden states; the '{type(target).__name__}' "
                                "runner does not give them (use --backend native or torch)")
        from verispec.models.skip import num_layers

        layers = num_layers(target)
        if any(not 0 <= i < layers for i in head.config.aux_layers or ()):
            raise VerispecError(f"the EAGLE head reads the target's layers {head.config.aux_layers}; this target has "
                                f"{layers}")
        self.source, self.native = head, native if native is not None else isinstance(target, NativeWeights)
        self.target, self.head, self.argmax, self.lookup = target, self._serving(head), argmax, lookup
        self.vocab_size = target.vocab_size
        self.rows: list[_Row] = []
        target.aux_layers = tuple(head.config.aux_layers)
        # finished rows' entries by their tokens (`reuse_prefixes`; None: off), and the entries each row joining now
        # took from it (by id of its sequence, until the batch asks `prefix_limit`)
        self.prefixes: PrefixStore | None = None
        self.taken: dict[int, int] = {}

    def _serving(self, head: Eagle3Head) -> Eagle3Head:
        """The head to draft with: a copy on the native kernels (Q8_0 linears) where the drafter uses them."""
        if not self.native:
            return head
        from verispec.models.gguf.convert import native_linears

        head = copy.deepcopy(head)
        native_linears(head)
        return head


    def new_row(self, seq: Sequence | None = None) -> _Row:
        """A key / value cache of the head's layer, filled from the target's features as the row decodes: empty, or
        the entries of the longest stored prefix of the sequence's tokens (`reuse_prefixes`)."""
        c = self.head.config
        row = _Row(torch.zeros(64, c.kv_heads, c.head_dim), torch.zeros(64, c.kv_heads, c.head_dim))
        if seq is None:
            return row
        row.tokens = seq.tokens
        if self.prefixes is not None:  # a failed take leaves the row empty: its length is set once the entries are in
            self.prefixes.try_take(_HeadRows([row]), 0, seq.tokens, "the EAGLE head")
        self.taken[id(seq)] = row.length
        return row

    def reuse_prefixes(self, budget_bytes: int) -> None:
        self.prefixes = PrefixStore.of(budget_bytes)

    def prefix_limit(self, seq: Sequence) -> int | None:
        """The positions a joining row may take from the target's store: as many as the head's entries it took (the
        target's features of a reused position are never made again); None for a row the head does not hold."""
        return self.taken.pop(id(seq), None)

    def cache_bytes(self, tokens: int) -> int:
        """The head's one layer: float32 keys and values, grown by doubling from 64 columns (`_Row.write`)."""
        capacity = 64
        while capacity < tokens:
            capacity *= 2
        c = self.head.config
        return 2 * capacity * c.kv_heads * c.head_dim * 4

    def start(self, sequences: list[Sequence]) -> None:
        super().start(sequences)
        self._rows_started(len(sequences))

    def extend(self, sequences: list[Sequence]) -> None:
        super().extend(sequences)
        self._rows_started(len(sequences), add=True)

    def keep(self, rows: list[int]) -> None:
        if self.prefixes is not None:  # rows leaving: their entries kept by the tokens they were made from
            kept = set(rows)
            for b, row in enumerate(self.rows):
                if b not in kept and row.length:
                    self.prefixes.try_keep(_HeadRows(self.rows), b, row.tokens[: row.length + 1], "the EAGLE head")
        super().keep(rows)
        self._rows_kept(rows)
        self.taken.clear()  # asked of joining rows in the step they joined

    # --- online adaptation -----------------------------------------------------------------------
    def check_adaptable(self, config: AdaptConfig | None = None) -> None:
        """Start logging the target's features for online adaptation (`drafters.head_adapt`)."""
        config = config or AdaptConfig()
        embed = self.source.embed_tokens or self.target.token_embeddings
        self.adaptation = HeadAdaptation(config, lambda: HeadTrainer(
            self.source, eagle_loss(embed), self._serving, config, frozen=("embed_tokens",)), context=config.head_window)
        self.adaptation.rows(len(self.rows))

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long)
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(ids)
        return self.target.token_embeddings(ids)  # (n, E)

    def _layer(self, row: _Row, tokens: list[int], features: torch.Tensor, positions: list[int], column: int,
               mask: torch.Tensor) -> torch.Tensor:
        """The head's layer on n new entries written at columns column ..; mask: (n, column + n) -> (n, E)."""
        q, k, v = self.head.new_kv(self._embed(tokens), features, torch.tensor(positions))
        row.write(column, k, v)
        end = column + len(tokens)
        return self.head.attend(q, row.keys[:end], row.values[:end], mask, features)

    def _catch_up(self, row: _Row, seq: Sequence) -> torch.Tensor | None:
        """Read the target's features kept since the last step; the (E,) output that drafts token 1, or None
        before the target has read the prompt."""
        if not row.pending:
            return None
        features = torch.cat(row.pending)  # (n, E)
        n, start = features.shape[0], row.length
        if row.reused:  # entries from the store: the target took as many of its positions, or fewer (the rest go)
            taken = len(seq.tokens) - 1 - n
            if 0 <= taken <= start:
                start = row.length = taken
            row.reused = False
        if start + n != len(seq.tokens) - 1:
            raise VerispecError(f"the EAGLE head holds features of {start + n} positions for a sequence of "
                                f"{len(seq.tokens)} tokens (expected one fewer)")
        mask = torch.ones(n, start + n, dtype=torch.bool)  # (n, start + n)
        mask[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
        out = self._layer(row, seq.tokens[start + 1 : start + n + 1], features, list(range(start, start + n)), start, mask)
        row.length, row.pending = start + n, []
        return out[-1]

    @torch.inference_mode()
    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        self._swap()
        if trees is not None:
            return self._propose_tree(sequences, trees, depths)
        return self._propose_chain(sequences, depths)

    def _propose_chain(self, sequences: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for b, seq in enumerate(sequences):
            row = self.rows[b]
            h = self._catch_up(row, seq) if max_tokens[b] else None
            if h is None:
                drafts.append(EMPTY_DRAFT)
                continue
            tokens, q_rows = [], []
            for k in range(max_tokens[b]):
                if k:  # feed draft k - 1 at the column (and position) after the last
                    column = row.length + k - 1
                    mask = torch.ones(1, column + 1, dtype=torch.bool)
                    h = self._layer(row, tokens[-1:], h[None], [column], column, mask)[0]
                copied = self._copied(seq, tokens)
                if copied is not None and seq.constraint is not None:
                    allowed = seq.constraint.allowed_after(tokens)
                    if allowed is None or not bool(allowed[copied]):  # a copy the constraint forbids: the chain ends
                        break
                if copied is not None:
                    tokens.append(copied)
                    q_row = None if self.argmax else seq.processors.q_row(None, copied, self.vocab_size)
                    if q_row is not None:
                        q_rows.append(q_row)
                    continue
                logits = constrained_logits(self.head.logits(h[None]), seq, tokens)  # (1, V)
                if logits is None:  # the constraint allows nothing the head can write: the chain ends
                    break
                if self.argmax:
                    tokens.append(int(logits.argmax()))
                    continue
                token, q = draw_token(logits, seq, tokens)
                tokens.append(token)
                if q is not None:
                    q_rows.append(q)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(q_rows) if q_rows else None)
                          if tokens else EMPTY_DRAFT)
        return drafts

    def _propose_tree(self, sequences: list[Sequence], trees: list[TreeConfig], depths: list[int]) -> list[Draft]:
        drafts = []
        for b, seq in enumerate(sequences):
            row = self.rows[b]
            h = self._catch_up(row, seq) if depths[b] else None
            if h is None:
                drafts.append(EMPTY_DRAFT)
                continue
            growth = TreeGrowth(trees[b], depths[b], seq.sampling, seq.rng, self.vocab_size, seq.constraint,
                                seq.tree_costs)
            growth.add_children(-1, self.head.logits(h[None])[0], penalty_seen(seq, [], self.vocab_size),
                                self._copied(seq, []))
            outputs = {-1: h}  # node -> the head's output after it (E,)
            columns: dict[int, int] = {}  # node -> its entry's column
            for depth in range(1, depths[b]):
                nodes = growth.to_expand(depth)
                if not nodes:
                    break
                first = row.length + len(columns)
                mask = torch.zeros(len(nodes), first + len(nodes), dtype=torch.bool)  # (n, first + n)
                mask[:, : row.length] = True
                for j, node in enumerate(nodes):
                    columns[node] = first + j
                    ancestor = node
                    while ancestor >= 0:
                        mask[j, columns[ancestor]] = True
                        ancestor = growth.parents[ancestor]
                features = torch.stack([outputs[growth.parents[node]] for node in nodes])  # (n, E)
                positions = [row.length - 1 + depth] * len(nodes)
                out = self._layer(row, [growth.tokens[node] for node in nodes], features, positions, first, mask)
                for j, node in enumerate(nodes):
                    outputs[node] = out[j]
                    path = growth.path(node)
                    growth.add_children(node, self.head.logits(out[j : j + 1])[0],
                                        penalty_seen(seq, path, self.vocab_size), self._copied(seq, path))
            drafts.append(growth.finish()[0])
        return drafts

    def _copied(self, seq: Sequence, drafted: list[int]) -> int | None:
        """Lookup first: the token that followed the n-gram the context and the drafts end in, if any."""
        if self.lookup is None:
            return None
        found = lookup(seq.tokens + drafted, 1, self.lookup)
        return found[0] if found else None

    @torch.inference_mode()
    def token_cost(self) -> float:
        """One drafted token: the layer over one position after 64 committed ones, its logits and q (median of 7)."""
        row, E = self.new_row(), self.head.config.hidden
        h = self._layer(row, [11] * 64, torch.zeros(64, E), list(range(64)), 0, torch.ones(64, 64, dtype=torch.bool).tril())[-1]
        times = []
        for _ in range(8):
            start = time.perf_counter()
            out = self._layer(row, [11], h[None], [64], 64, torch.ones(1, 65, dtype=torch.bool))
            torch.softmax(self.head.logits(out), -1)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[3]

    def _aux(self) -> list[torch.Tensor]:
        aux = self.target.aux_features
        if aux is None:
            raise VerispecError("the target kept no hidden states for the EAGLE head")
        return aux

    @torch.inference_mode()
    def _keep_features(self, sequences: list[Sequence], kept: list[torch.Tensor]) -> None:
        """kept[b]: (n_b, 3 E_target) the target's states of row b's newly committed tokens, in order."""
        counts = [k.shape[0] for k in kept]
        if not sum(counts):
            return
        if self.adaptation is not None:
            self.adaptation.log(sequences, kept)
        fused = self.head.fc(torch.cat(kept).float())  # (sum n_b, E)
        for row, part in zip(self.rows, fused.split(counts)):
            if part.shape[0]:
                row.pending.append(part)

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        # the pass read each row's pending tokens, then its nodes: the pending ones and the accepted path stay
        kept = []
        for a, d, path in zip(self._aux(), drafts, paths):
            pending = a.shape[0] - len(d)
            kept.append(torch.cat([a[:pending], a[[pending + node for node in path]]]))
        self._keep_features(sequences, kept)
