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
earlier requests' outputs shared by every row of this drafter (a server's requests), bounded by `capacity`
tokens, the oldest output dropped first, kept in a file across processes where one is named (`suffix:FILE`:
read at start, written again each time a request's output joins it). Deterministic: q is one-hot, so the output
is exactly the target's at any temperature (the verifier accepts draft x with probability p(x)).
"""

from __future__ import annotations

import heapq
from collections import deque
from pathlib import Path

import numpy as np
import torch

from verispec.config import SuffixConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, Drafter
from verispec.core.sequence import Sequence
from verispec.errors import VerispecError
from verispec.tree import breadth_first, tree_from_parents

SEPARATOR = -1  # between documents of one index: never equal to a token, so no match crosses it
STORE_FORMAT, STORE_VERSION = "verispec-suffix-store", "1"  # a store file's header


class SuffixIndex:
    """Token text (documents one after another) with, for every `key`-token window, the positions that follow it."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.buffer = np.empty(1024, dtype=np.int64)  # (capacity,) the text; self.size of it used
        self.size = 0
        self.after: dict[tuple[int, ...], list[int]] = {}  # key window -> positions right after its occurrences

    def append(self, tokens: list[int]) -> None:
        """Add tokens at the end of the last document."""
        if self.size + len(tokens) > self.buffer.size:
            grown = np.empty(max(2 * self.buffer.size, self.size + len(tokens)), dtype=np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        for token in tokens:
            self.buffer[self.size] = token
            self.size += 1
            if self.size >= self.key:
                window = tuple(self.buffer[self.size - self.key : self.size].tolist())
                if SEPARATOR not in window:
                    self.after.setdefault(window, []).append(self.size)

    def add_document(self, tokens: list[int]) -> None:
        """Add a whole document (closed by the separator)."""
        self.append(tokens)
        self.append([SEPARATOR])

    def candidates(self, context: list[int], config: SuffixConfig) -> tuple[np.ndarray, np.ndarray]:
        """(positions, match lengths): where text follows an occurrence of the context's last `key` tokens (the most
        recent `max_candidates`), and how many tokens before each agree with the context's end (<= max_match)."""
        if len(context) < self.key:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        found = self.after.get(tuple(context[-self.key :]))
        if not found:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        positions = np.asarray(found[-config.max_candidates :], dtype=np.int64)  # (P,)
        positions = positions[positions < self.size]  # a continuation must exist
        positions = positions[self.buffer[positions] != SEPARATOR] if positions.size else positions
        if not positions.size:
            return positions, positions
        tail = np.asarray(context[-config.max_match :][::-1], dtype=np.int64)  # (M,) the context's end, last first
        back = positions[:, None] - 1 - np.arange(tail.size)[None, :]  # (P, M) the tokens before each position
        before = np.where(back >= 0, self.buffer[np.clip(back, 0, None)], SEPARATOR - 1)
        agree = before == tail[None, :]  # (P, M)
        lengths = np.where(agree.all(1), tail.size, agree.argmin(1))  # (P,) up to the first disagreement
        return positions, lengths

    def continuation(self, position: int, depth: int) -> list[int]:
        """Up to `depth` tokens from `position`, stopping at the document's end."""
        out = self.buffer[position : min(position + depth, self.size)].tolist()
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


class OutputStore:
    """Earlier requests' outputs, one document each, at most `capacity` tokens: over it, the oldest are dropped
    and the index rebuilt from the rest (down to three quarters, so a rebuild is paid once per many outputs)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.documents: deque[list[int]] = deque()
        self.tokens = 0
        self.index = SuffixIndex(config.min_match)

    def add(self, output: list[int]) -> None:
        output = list(output[-self.config.capacity :])
        if not output:
            return
        self.documents.append(output)
        self.tokens += len(output)
        if self.tokens <= self.config.capacity:
            self.index.add_document(output)
            return
        while self.tokens > 3 * self.config.capacity // 4 and len(self.documents) > 1:
            self.tokens -= len(self.documents.popleft())
        self.index = SuffixIndex(self.config.min_match)
        for document in self.documents:
            self.index.add_document(document)

    def save(self, path: Path, tokenizer: dict) -> None:
        """Write the outputs atomically (a kill leaves the previous file): their tokens end to end, their lengths,
        and a header naming the tokenizer (`tokenizer`: its "name" and "sha256") they are ids of."""
        from safetensors.numpy import save_file

        from verispec.atomic import atomic_path

        tokens = np.fromiter((t for d in self.documents for t in d), dtype=np.int32, count=self.tokens)  # (T,)
        lengths = np.array([len(d) for d in self.documents], dtype=np.int64)  # (D,)
        header = {"format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer": tokenizer["name"],
                  "tokenizer_sha256": tokenizer["sha256"]}
        with atomic_path(path) as tmp:
            save_file({"tokens": tokens, "lengths": lengths}, str(tmp), metadata=header)

    @classmethod
    def load(cls, path: Path, config: SuffixConfig, tokenizer: dict, vocab_size: int) -> OutputStore:
        """A store read from `path`, refused in one line where the file is not one, is damaged or holds ids of
        another tokenizer; outputs past the capacity are dropped oldest first, as they are while decoding."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                header = f.metadata() or {}
                if header.get("format") != STORE_FORMAT:
                    raise VerispecError(f"{path} is not a suffix store (no '{STORE_FORMAT}' header)")
                tokens, lengths = f.get_tensor("tokens"), f.get_tensor("lengths")
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            raise VerispecError(f"{path} is not a readable suffix store ({type(err).__name__}: {err})") from None
        if header.get("version") != STORE_VERSION:
            raise VerispecError(f"{path} is a suffix store of format version {header.get('version')}, this verispec "
                                f"reads version {STORE_VERSION}: delete it to start a new one")
        if header.get("tokenizer_sha256") != tokenizer["sha256"]:
            raise VerispecError(f"{path} holds token ids of another tokenizer ('{header.get('tokenizer', '?')}') "
                                f"than the target's ('{tokenizer['name']}'): name another file, or delete it")
        if (tokens.ndim != 1 or lengths.ndim != 1 or (lengths < 1).any() or int(lengths.sum()) != tokens.size
                or (tokens.size and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab_size))):
            raise VerispecError(f"{path} is a damaged suffix store (its lengths and tokens disagree, or ids lie "
                                f"outside the vocabulary of {vocab_size}): delete it to start a new one")
        store = cls(config)
        for document in np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []:
            store.add(document.tolist())
        return store


class SuffixDrafter(Drafter):
    """Suffix decoding over each row's own context and the outputs of earlier requests (see the module doc)."""

    name = "suffix"
    chunked_prefill = True

    def __init__(self, config: SuffixConfig = SuffixConfig(), store_path: str | Path | None = None,
                 tokenizer: dict | None = None, vocab_size: int | None = None) -> None:
        """`store_path`: a file keeping the store across processes (read now if it exists, written as outputs join);
        `tokenizer` ({"name", "sha256"}) and `vocab_size` then say whose token ids it may hold."""
        self.config = config
        self.store_path = None if store_path is None else Path(store_path)
        self.tokenizer = tokenizer
        self.store = OutputStore(config)
        if self.store_path is not None:
            if tokenizer is None or vocab_size is None:
                raise VerispecError("a suffix store file needs the target's tokenizer and vocabulary size")
            if self.store_path.is_dir():
                raise VerispecError(f"the suffix store {self.store_path} is a folder: name a file")
            if not self.store_path.parent.is_dir():
                raise VerispecError(f"the suffix store's folder {self.store_path.parent} does not exist")
            if self.store_path.exists():
                self.store = OutputStore.load(self.store_path, config, tokenizer, vocab_size)
        self.rows: list[tuple[Sequence, SuffixIndex]] = []

    @property
    def supports_trees(self) -> bool:
        return True

    # --- rows ---------------------------------------------------------------------------------------------
    def start(self, sequences: list[Sequence]) -> None:
        self._retire(range(len(self.rows)))
        self.rows = []
        self.extend(sequences)

    def extend(self, sequences: list[Sequence]) -> None:
        self.rows += [(seq, self._index(seq)) for seq in sequences]

    def _index(self, seq: Sequence) -> SuffixIndex:
        """A new index of the row's context so far."""
        index = SuffixIndex(self.config.min_match)
        index.append(list(seq.tokens))
        return index

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        self._retire([r for r in range(len(self.rows)) if r not in kept])
        self.rows = [self.rows[r] for r in rows]

    def _retire(self, rows) -> None:
        """Rows leaving: their outputs join the store for later requests (and its file, if it has one)."""
        added = False
        for r in rows:
            seq, _ = self.rows[r]
            if seq.generated:
                self.store.add(seq.generated)
                added = True
        if added and self.store_path is not None:
            self.store.save(self.store_path, self.tokenizer)

    # --- drafting -------------------------------------------------------------------------------------------
    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        drafts = []
        for b, (seq, depth) in enumerate(zip(sequences, depths)):
            index = self._own(b, seq)
            continuations = self._continuations(seq.tokens, index, depth) if depth > 0 else []
            if not continuations:
                drafts.append(EMPTY_DRAFT)
                continue
            tree = trees[b] if trees is not None else None
            tokens, parents = frequency_tree(continuations, tree, self.config.min_share)
            shape = None if tree is None else tree_from_parents(parents)  # a chain keeps Draft's own (1, ..., 1)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), tree=shape) if tokens else EMPTY_DRAFT)
        return drafts

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        if depth <= 0 or b >= len(self.rows) or self.rows[b][0] is not seq:
            return []
        continuations = self._continuations(seq.tokens + after, self._own(b, seq), depth)
        return frequency_tree(continuations, None, self.config.min_share)[0] if continuations else []

    def _own(self, b: int, seq: Sequence) -> SuffixIndex:
        """Row b's index of its own context, brought up to the tokens it has committed."""
        if b >= len(self.rows) or self.rows[b][0] is not seq:  # a row the batch did not announce: index it now
            index = self._index(seq)
            if b < len(self.rows):
                self.rows[b] = (seq, index)
            else:
                self.rows.append((seq, index))
            return index
        index = self.rows[b][1]
        if index.size < len(seq.tokens):
            index.append(list(seq.tokens[index.size :]))
        return index

    def _continuations(self, context: list[int], own: SuffixIndex, depth: int) -> list[list[int]]:
        """The continuations of the longest match's occurrences (own context first, most recent first), cut to
        the draft length the match allows."""
        found = [(index, *index.candidates(context, self.config)) for index in (own, self.store.index)]
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
