"""Corpus n-gram drafting: counts from a corpus, from the sequence's own context and from online
adaptation, mixed by backoff, with q the exact distribution each draft token is drawn from.

For the last tokens c of a sequence, `NGramModel.distribution` tries orders n = max_n .. min_n: at the
first order where any source has seen the context c[-(n-1):], each source's continuation counts are
normalized and mixed with the configured weights (renormalized over the sources present):

    q(x) = sum_s w_s count_s(c, x) / sum_y count_s(c, y)  /  sum_s w_s

The running context makes this a superset of prompt lookup (weighted above the corpus by default).
With no context seen at any order >= min_n drafting stops early: a draft may be shorter than K, or
empty. Greedy steps propose the argmax chain (ties go to the context's most recent continuation);
sampling steps draw each token from q^(1/T) (renormalized) with the sequence's own generator and
return those rows as Draft.q, so `rejection.verify` keeps the output exactly the target's. q is
sparse (a few tokens); it is made dense (n, V) only for the verifier.

Online adaptation (`adapt`) adds the target's distributions, where drafts were rejected, to the
adapted counts. Examples arriving from another thread wait in a list that `propose` applies at its
start, so a step never sees the counts change under it.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from verispec.config import NGramConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.sequence import Sequence
from verispec.errors import VerispecError
from verispec.ngram.table import NGramCounts, NGramTable
from verispec.sampling import sample
from verispec.tree import breadth_first, tree_from_parents

SPEC_PREFIX = "ngram-corpus"
TABLE_SUFFIX = ".ngram"
DEFAULT_TABLE = Path(__file__).resolve().parent.parent / "ngram" / "data" / "default.ngram"
DEFAULT_TABLE_SHA256 = "6115bc26278c57dcf32b605b805d529479946eb39329d7143e4d678b655ef466"  # see data/SOURCE.txt


def table_path(spec: str) -> Path:
    """The table file a corpus n-gram spec names (`ngram-corpus` alone: the table shipped with verispec,
    built for the default target's tokenizer; its sha256 is checked)."""
    if spec.startswith(SPEC_PREFIX + ":"):
        return Path(spec[len(SPEC_PREFIX) + 1 :]).expanduser()
    if spec == SPEC_PREFIX:
        if not DEFAULT_TABLE.is_file():
            raise VerispecError(f"the default n-gram table {DEFAULT_TABLE} is missing: reinstall verispec, or build "
                                "one with `verispec ngram build` and pass --draft ngram-corpus:TABLE")
        digest = hashlib.sha256(DEFAULT_TABLE.read_bytes()).hexdigest()
        if digest != DEFAULT_TABLE_SHA256:
            raise VerispecError(f"the default n-gram table {DEFAULT_TABLE} is damaged (sha256 {digest[:12]}..., "
                                f"expected {DEFAULT_TABLE_SHA256[:12]}...): reinstall verispec")
        return DEFAULT_TABLE
    return Path(spec).expanduser()


class NGramModel:
    """The backoff mixture of corpus, context and adapted counts (see the module docstring).

    Args:
        table: the corpus table, or None (context and adapted counts only).
        config: orders, weights and limits.
    """

    def __init__(self, table: NGramTable | None, config: NGramConfig = NGramConfig()) -> None:
        self.table = table
        self.config = config
        self.max_n = config.max_n
        self.adapted = NGramCounts(self.max_n)

    def distribution(self, tokens: list[int], context: NGramCounts | None = None) -> tuple[list[int], list[float]] | None:
        """The next-token distribution after `tokens` as (ids, probabilities), or None with no match.

        Args:
            tokens: the sequence so far (only the last max_n - 1 tokens are read).
            context: the sequence's running counts (None: corpus and adapted counts only).
        """
        cfg = self.config
        T = len(tokens)
        for n in range(min(self.max_n, T + 1), cfg.min_n - 1, -1):
            key = tuple(tokens[T - n + 1 :]) if n > 1 else ()
            sources: list[tuple[float, list[int], list[float]]] = []
            if context is not None and cfg.context_weight > 0:
                seen = context.continuations(key)
                if seen:  # most recent continuation first
                    items = list(reversed(seen.items()))
                    sources.append((cfg.context_weight, [t for t, _ in items], [c for _, c in items]))
            if cfg.adapted_weight > 0:
                learned = self.adapted.continuations(key)
                if learned:
                    sources.append((cfg.adapted_weight, list(learned), list(learned.values())))
            if self.table is not None and cfg.corpus_weight > 0 and n <= self.table.max_n:
                ids, counts = self.table.continuations(key)
                if ids.size:
                    sources.append((cfg.corpus_weight, ids.tolist(), counts.tolist()))
            if not sources:
                continue
            total_weight = sum(w for w, _, _ in sources)
            mixture: dict[int, float] = {}
            for weight, ids, counts in sources:
                scale = weight / (sum(counts) * total_weight)
                for t, c in zip(ids, counts):
                    mixture[t] = mixture.get(t, 0.0) + c * scale
            return list(mixture), list(mixture.values())
        return None

    def learn(self, context: tuple[int, ...], tokens: tuple[int, ...], probs: tuple[float, ...]) -> None:
        """Add a target distribution (tokens with probabilities) after `context` to the adapted counts."""
        cfg = self.config
        for n in range(cfg.min_n, self.max_n + 1):
            if len(context) < n - 1:
                break
            key = tuple(context[len(context) - n + 1 :]) if n > 1 else ()
            table = self.adapted.tables[n]
            for t, p in zip(tokens, probs):
                self.adapted.add(key, int(t), float(p))
            while len(table) > cfg.adapted_contexts:  # forget the oldest contexts
                del table[next(iter(table))]


def sharpen(probs: list[float], temperature: float) -> torch.Tensor:
    """q^(1/T), renormalized, as float32 (the distribution a sampling step draws from). -> (m,)"""
    q = torch.tensor(probs, dtype=torch.float64)
    if temperature != 1.0:
        q = q.clamp_min(1e-300).log().div(temperature).softmax(dim=0)
    return (q / q.sum()).float()


class CorpusNGramDrafter(RowStates):
    """Draft from corpus n-gram counts mixed with the sequence's context and online-learned counts.

    Args:
        table: the corpus table (None: context and adapted counts only).
        vocab_size: the target's vocabulary size (width of q).
        config: orders, mixture weights and limits.
    """

    name = SPEC_PREFIX
    traits = Traits(trees=True, chunked_prefill=True, follows_prefixes=True, adaptive=True)

    def __init__(self, table: NGramTable | None, vocab_size: int, config: NGramConfig = NGramConfig()) -> None:
        if table is not None and table.vocab_size > vocab_size:
            raise VerispecError(f"the n-gram table has {table.vocab_size} token ids, more than the target's {vocab_size}")
        if table is not None:
            config = NGramConfig(**{**config.__dict__, "max_n": min(config.max_n, table.max_n),
                                    "min_n": min(config.min_n, table.max_n)})
        self.model = NGramModel(table, config)
        self.config = config
        self.vocab_size = vocab_size
        self.rows: list[NGramCounts] = []
        self._lock = threading.Lock()
        self._pending: list = []  # AdaptExamples waiting for the next propose
        self.examples_learned = 0

    @classmethod
    def from_spec(cls, spec: str, tokenizer, vocab_size: int, config: NGramConfig = NGramConfig()) -> CorpusNGramDrafter:
        """Load the table a spec names (`ngram-corpus[:TABLE]` or `X.ngram`), checking it was built with `tokenizer`."""
        return cls(NGramTable.load(table_path(spec), tokenizer), vocab_size, config)

    # --- batch rows ------------------------------------------------------------------------------
    def new_row(self, seq: Sequence) -> NGramCounts:
        return NGramCounts(self.model.max_n)  # the context's counts, read from its tokens when drafting

    # --- drafting --------------------------------------------------------------------------------
    def candidates(self, tokens: list[int], k: int, row: int | None = None,
                   counts: NGramCounts | None = None) -> list[tuple[int, float]]:
        """The k most likely continuations of `tokens` with their q (for tree drafting), best first.

        `row`: the batch row whose running context counts are mixed in (or pass those `counts`; neither:
        corpus and adapted counts only). Returns [] where no n-gram matches.
        """
        dist = self.model.distribution(tokens, counts if counts is not None else self.rows[row] if row is not None else None)
        if dist is None:
            return []
        ids, probs = dist
        order = sorted(range(len(ids)), key=lambda i: -probs[i])[:k]  # stable: ties keep the mixture's order
        return [(ids[i], probs[i]) for i in order]


    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        """Chains drawn from the mixture's q; trees are tries of the most likely continuations (deterministic
        candidates, one-hot q: exact under sampling too)."""
        self._apply_pending()
        drafts = []
        for b, (seq, depth) in enumerate(zip(sequences, depths)):
            counts = self.rows[b]
            counts.add_stream(seq.tokens)
            if depth <= 0:
                drafts.append(EMPTY_DRAFT)
            elif trees is not None:
                drafts.append(self._tree(seq.tokens, counts, trees[b], depth))
            else:
                drafts.append(self._chain(seq, counts, depth))
        return drafts

    def _chain(self, seq: Sequence, counts: NGramCounts, budget: int) -> Draft:
        width = self.model.max_n - 1  # context tokens the longest order reads
        tail = seq.tokens[max(0, len(seq.tokens) - width) :] if width else []
        greedy = seq.processors.greedy
        temperature = seq.sampling.temperature if self.config.match_temperature and not greedy else 1.0
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for _ in range(budget):
            dist = self.model.distribution(tail, counts)
            if dist is None:
                break
            ids, probs = dist
            best = max(range(len(ids)), key=probs.__getitem__)  # the first maximum
            if probs[best] < self.config.min_prob:
                break
            if greedy:
                token = ids[best]
            else:
                q = sharpen(probs, temperature)  # (m,)
                token = ids[sample(q, seq.rng)]
                row = torch.zeros(self.vocab_size, dtype=torch.float32)  # (V,)
                row[torch.tensor(ids, dtype=torch.long)] = q
                q_rows.append(row)
            tokens.append(token)
            tail = (tail + [token])[max(0, len(tail) + 1 - width) :] if width else []
        if not tokens:
            return EMPTY_DRAFT
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(q_rows) if q_rows else None)  # q: (n, V)

    # --- trees ------------------------------------------------------------------------------------
    def _tree(self, tokens: list[int], counts: NGramCounts, tree: TreeConfig, depth: int) -> Draft:
        """Grow best first by path probability: a static shape gives node depth d its shape[d] best
        continuations; a budget gives each expanded node its top_k, until `budget` nodes. The tree is a
        function of the context alone (no draws), so verification treats its candidates as deterministic."""
        width = self.model.max_n - 1
        limit = tree.size_upper_bound(depth)
        node_tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier = [(-1.0, -1, tokens[max(0, len(tokens) - width) :] if width else [], 0)]  # (-score, node, tail, depth)
        while frontier and len(node_tokens) < limit:
            frontier.sort(key=lambda f: (f[0], f[1]))
            neg_score, node, tail, d = frontier.pop(0)
            k = tree.shape[d] if tree.shape is not None else tree.top_k
            for token, prob in self.candidates(tail, k, counts=counts):
                if prob < self.config.min_prob or len(node_tokens) >= limit:
                    break
                node_tokens.append(token)
                parents.append(node)
                scores.append(-neg_score * prob)
                if d + 1 < depth:
                    child_tail = (tail + [token])[max(0, len(tail) + 1 - width) :] if width else []
                    frontier.append((neg_score * prob, len(node_tokens) - 1, child_tail, d + 1))
        if not node_tokens:
            return EMPTY_DRAFT
        order, new_parents = breadth_first(parents, [-s for s in scores])  # siblings: most likely first
        return Draft(torch.tensor([node_tokens[i] for i in order], dtype=torch.long), tree=tree_from_parents(new_parents))

    # --- online adaptation -----------------------------------------------------------------------
    def adapt(self, examples: list) -> None:
        """Queue examples (AdaptExample) for the adapted counts; they apply at the start of the next propose."""
        with self._lock:
            self._pending.extend(examples)

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for ex in pending:
            self.model.learn(ex.context, ex.tokens, ex.probs)
        self.examples_learned += len(pending)
