"""Suffix decoding (Oliaro et al. 2024, as in Snowflake's ArcticInference): draft what followed the context's
longest suffix wherever it occurred before, in this request's prompt and output and in earlier requests' outputs,
the continuations ranked by how often each one followed.

For a row's context c, every earlier position whose preceding tokens equal c's last tokens is a candidate (found
through an index of `min_match`-token keys); its match length is how many tokens agree, up to `max_match`. The
candidates of the longest match length L are kept (the deepest node of a suffix tree over the indexed text) and
their continuations merged into a trie whose nodes count how many candidates pass through them. A chain follows
the most frequent child while it holds at least `min_share` of its parent's count; a tree keeps the nodes of the
highest share (count / candidates), best first. Drafts are at most `spec_factor` x L tokens: a long match is long
context repeating itself (an edit, an agent loop), a short one drafts little.

Two sources: the row's own context (prompt and accepted tokens, indexed as they are committed), and a store of
earlier requests' outputs (`OutputStore`). With `scope="shared"` every row of this drafter (a server's requests)
reads and joins one store; with `scope="key"` a row reads and joins only the outputs of its own `Sequence.scope`
(a server's tenant; rows of no scope share one), so no tenant's drafts, and no acceptance count a response
reports, depend on another tenant's text. The store is bounded by `capacity` tokens over all scopes together, the
oldest output dropped first whichever scope holds it, and kept in a file across processes where one is named
(`suffix:FILE`: read at start; written by a background thread, `StoreWriter`, after outputs join it, never on the
decoding thread; readable by its owner only). Deterministic: q is one-hot, so the output is exactly the target's
at any temperature (the verifier accepts draft x with probability p(x)).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from verispec.config import SuffixConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.sequence import Sequence
from verispec.drafters.suffix_store import (  # noqa: F401 - SEPARATOR, WRITE_INTERVAL and the rest, named here too
    SEPARATOR, STORE_FORMAT, STORE_MODE, STORE_VERSION, WRITE_INTERVAL, OutputStore, StoreWriter, SuffixIndex)
from verispec.errors import VerispecError
from verispec.tree import breadth_first, tree_from_parents

log = logging.getLogger("verispec.suffix")

class _Row:
    """A row of the batch: its sequence, the index of its own context, and whether its output joined the store."""

    __slots__ = ("seq", "index", "retired")

    def __init__(self, seq: Sequence, index: SuffixIndex) -> None:
        self.seq, self.index, self.retired = seq, index, False


class SuffixDrafter(RowStates):
    """Suffix decoding over each row's own context and the outputs of earlier requests (see the module doc)."""

    name = "suffix"
    traits = Traits(trees=True, chunked_prefill=True, follows_prefixes=True)

    def __init__(self, config: SuffixConfig = SuffixConfig(), store_path: str | Path | None = None,
                 tokenizer: dict | None = None, vocab_size: int | None = None) -> None:
        """`store_path`: a file keeping the store across processes (read now if it exists, written in the
        background as outputs join); `tokenizer` ({"name", "sha256"}) and `vocab_size` then say whose token ids it
        may hold."""
        self.config = config
        self.store_path = None if store_path is None else Path(store_path)
        self.tokenizer = tokenizer
        self.store = OutputStore(config)
        self.writer: StoreWriter | None = None
        if self.store_path is not None:
            if tokenizer is None or vocab_size is None:
                raise VerispecError("a suffix store file needs the target's tokenizer and vocabulary size")
            if self.store_path.is_dir():
                raise VerispecError(f"the suffix store {self.store_path} is a folder: name a file")
            if not self.store_path.parent.is_dir():
                raise VerispecError(f"the suffix store's folder {self.store_path.parent} does not exist")
            if self.store_path.exists():
                self.store = OutputStore.load(self.store_path, config, tokenizer, vocab_size)
            self.writer = StoreWriter(self.store_path, self._save)
        self.rows: list[_Row] = []


    def start_from(self, path: str | Path, tokenizer: dict, vocab_size: int) -> None:
        """Begin from the outputs a store file holds, the file read now and never written (no writer is kept for it):
        `verispec bench` starts each suffix system from the same `--draft suffix:FILE`, apart from the others."""
        path = Path(path)
        if self.rows:
            raise VerispecError("a suffix drafter starts from a store file only before its first batch")
        if not path.is_file():
            raise VerispecError(f"the suffix store {path} does not exist (a bench reads a store, never writes one)")
        self.store = OutputStore.load(path, self.config, tokenizer, vocab_size)

    def scope(self, seq: Sequence) -> str | None:
        """The store scope a row reads and joins: its own with scope="key", else the shared one (None)."""
        return seq.scope if self.config.scope == "key" else None

    # --- rows ---------------------------------------------------------------------------------------------
    def start(self, sequences: list[Sequence]) -> None:
        """A new batch, or rows started afresh (a fault's restart, `verispec.faults`, may start rows still running,
        alone or in any subset). The rows held before that finished (`finish_reason` set) join the store; those still
        running do not (they join once, when `keep` drops them or `retire_all` is called): a restart never adds an
        output so far, nor one already added (a row held again keeps its "retired" mark)."""
        previous, self.rows = self.rows, []
        again = {id(seq) for seq in sequences}
        self._retire([row for row in previous
                      if id(row.seq) not in again and row.seq.finish_reason is not None])
        retired = {id(row.seq) for row in previous if row.retired}
        self.extend(sequences)
        for row in self.rows:
            row.retired = id(row.seq) in retired

    def new_row(self, seq: Sequence) -> _Row:
        return _Row(seq, self._index(seq))

    def _index(self, seq: Sequence) -> SuffixIndex:
        """A new index of the row's context so far."""
        index = SuffixIndex(self.config.min_match)
        index.append(list(seq.tokens))
        return index

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        leaving = [row for r, row in enumerate(self.rows) if r not in kept]
        super().keep(rows)
        self._retire(leaving)

    def retire_all(self) -> None:
        """Every current row's output joins its scope's store now (a server cutting its batch at shutdown, without
        `keep`); the rows stay (they may still draft) but never join again, whatever `keep` or `start` follows."""
        self._retire(self.rows)

    def _retire(self, rows: Iterable[_Row]) -> None:
        """Rows leaving: their outputs join their scopes' stores for later requests, each once (a row is marked
        retired before its output is added), and the file's writer is told (it writes in the background)."""
        added = False
        try:
            for row in rows:
                if row.retired:
                    continue
                row.retired = True
                if row.seq.generated:
                    self.store.add(row.seq.generated, self.scope(row.seq))
                    added = True
        finally:
            if added and self.writer is not None:
                self.writer.mark()

    def _save(self) -> None:
        self.store.save(self.store_path, self.tokenizer)

    def flush_store(self, timeout: float) -> bool:
        """Write the store's pending outputs to its file now and wait up to `timeout` seconds (a server's shutdown,
        after `retire_all`); True when the file holds them all, or there is no file."""
        return True if self.writer is None else self.writer.flush(timeout)

    # --- drafting -------------------------------------------------------------------------------------------
    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        drafts = []
        for b, (seq, depth) in enumerate(zip(sequences, depths)):
            index = self._own(b, seq)
            continuations = self._continuations(seq.tokens, index, self.scope(seq), depth) if depth > 0 else []
            if not continuations:
                drafts.append(EMPTY_DRAFT)
                continue
            tree = trees[b] if trees is not None else None
            tokens, parents = frequency_tree(continuations, tree, self.config.min_share)
            shape = None if tree is None else tree_from_parents(parents)  # a chain keeps Draft's own (1, ..., 1)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), tree=shape) if tokens else EMPTY_DRAFT)
        return drafts

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        if depth <= 0 or b >= len(self.rows) or self.rows[b].seq is not seq:
            return []
        continuations = self._continuations(seq.tokens + after, self._own(b, seq), self.scope(seq), depth)
        return frequency_tree(continuations, None, self.config.min_share)[0] if continuations else []

    def _own(self, b: int, seq: Sequence) -> SuffixIndex:
        """Row b's index of its own context, brought up to the tokens it has committed."""
        if b >= len(self.rows) or self.rows[b].seq is not seq:  # a row the batch did not announce: index it now
            row = _Row(seq, self._index(seq))
            if b < len(self.rows):
                self.rows[b] = row
            else:
                self.rows.append(row)
            return row.index
        index = self.rows[b].index
        if index.size < len(seq.tokens):
            index.append(list(seq.tokens[index.size :]))
        return index

    def _continuations(self, context: list[int], own: SuffixIndex, scope: str | None,
                       depth: int) -> list[list[int]]:
        """The continuations of the longest match's occurrences (own context first, then the row's scope's earlier
        outputs; most recent first), cut to the draft length the match allows."""
        indexes = [own] + [index for index in (self.store.index(scope),) if index is not None]
        found = [(index, *index.candidates(context, self.config)) for index in indexes]
        longest = max((int(lengths.max()) for _, _, lengths in found if lengths.size), default=0)
        if longest < self.config.min_match:
            return []
        limit = min(depth, max(1, int(self.config.spec_factor * longest)))
        out = []
        for index, positions, lengths in found:
            for position in positions[lengths == longest][::-1].tolist():
                continuation = index.continuation(position, limit)
                if continuation:
                    out.append(continuation)
        return out


def frequency_tree(continuations: list[list[int]], tree: TreeConfig | None,
                   min_share: float) -> tuple[list[int], tuple[int, ...]]:
    """The draft from merged continuations: for a chain (tree None) the most frequent path while each step keeps at
    least `min_share` of the count before it; for a tree the nodes of the highest share of all continuations, best
    first, within the tree's shape or budget. Ties go to the continuation listed first. Returns (tokens, parents),
    breadth first."""
    counts: list[int] = []  # per node: continuations through it
    first: list[int] = []  # per node: the first continuation through it (ties)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: list[dict[int, int]] = [{}]  # children[node + 1]: token -> node
    for rank, continuation in enumerate(continuations):
        node = -1
        for d, token in enumerate(continuation):
            child = children[node + 1].get(token)
            if child is None:
                child = len(tokens)
                children[node + 1][token] = child
                children.append({})
                tokens.append(token)
                parents.append(node)
                depths.append(d)
                counts.append(0)
                first.append(rank)
            counts[child] += 1
            node = child
    total = len(continuations)
    if tree is None:  # a chain: the most frequent child, while it holds its share
        chain, node, above = [], -1, total
        while children[node + 1]:
            best = min(children[node + 1].values(), key=lambda c: (-counts[c], first[c]))
            if counts[best] < min_share * above:
                break
            chain.append(tokens[best])
            node, above = best, counts[best]
        return chain, tuple(range(-1, len(chain) - 1))
    depth_limit = max(depths) + 1
    limit = tree.size_upper_bound(depth_limit)
    kept: list[int] = []
    taken: dict[int, int] = {}  # node -> children kept so far
    heap = [(-counts[c], first[c], c) for c in children[0].values()]
    heapq.heapify(heap)
    while heap and len(kept) < limit:
        _, _, node = heapq.heappop(heap)
        parent = parents[node]
        if tree.shape is not None and taken.get(parent, 0) >= tree.shape[depths[node]]:
            continue
        if counts[node] < min_share * total:
            break  # shares only fall from here on (a child never has more than its parent)
        kept.append(node)
        taken[parent] = taken.get(parent, 0) + 1
        if tree.shape is None or depths[node] + 1 < len(tree.shape):
            for child in children[node + 1].values():
                heapq.heappush(heap, (-counts[child], first[child], child))
    position = {node: i for i, node in enumerate(kept)}
    order, renumbered = breadth_first([position.get(parents[n], -1) for n in kept],
                                      [(-counts[n], first[n]) for n in kept])
    return [tokens[kept[i]] for i in order], renumbered
