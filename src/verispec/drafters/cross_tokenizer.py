"""A draft model with another tokenizer than the target's: it proposes text, the target verifies its own tokens.

The draft keeps its own cache of its own tokens. Target and draft meet in bytes (`token_text`): each row's committed
target tokens are read as text, the draft reads that text in its own tokenization, and what it drafts is turned into
target tokens. Two schemes (`CrossTokenizerConfig.scheme`), after Timor et al. (ICML 2025):

String level ("string", the default). The draft writes greedily in its own vocabulary until its text holds K + 1
target tokens (the target's tokenizer's ids of that text) or it has made `passes_per_token * K` passes; the first K
are the draft (the last one may still grow with the next draft token, so it is held back unless the draft ended its
text). q is one-hot at each drafted token.
    Why it is exact: the drafted tokens x_1..x_K are a function of the committed tokens alone (the draft's argmax in
    its own vocabulary; no draw of the sequence's generator). Speculative sampling with a one-hot q accepts x_i with
    probability p_i(x_i) and otherwise samples normalize(max(0, p_i - onehot(x_i))), p_i without x_i, so for every y
        P(y) = p(x) [y = x] + (1 - p(x)) p(y) [y != x] / (1 - p(x)) = p(y),
    the same identity as prompt lookup's (`verispec.rejection`); at temperature 0 a draft is accepted exactly when it
    is the target's argmax. Nothing about the draft's text, its tokenization or its seams can change the output:
    they only decide which x_i are proposed.

Token-level intersection ("intersection"). The draft's distribution is restricted to the ids whose bytes are a
target token too (`VocabBridge`): q_d over the draft's ids, processed with the row's sampling settings, zero off the
shared ids, renormalised; x is drawn from it (argmax at temperature 0) and its q mapped to the target's ids,
        q(t) = q_d(d)  where t is d's shared target id,  q(t) = 0 elsewhere,
a distribution over target ids that x (as a target id) was really drawn from, so speculative sampling is exact with
it as with any draft's q. The draft reads x as its own id d (the same bytes), so its text stays the target's.

Seams. After every step the committed text grows by the accepted tokens and a recovered or bonus token. The draft's
cache keeps its fed draft tokens whose bytes are a prefix of the new text (the same bytes, not the same tokens), and
drops the rest (`Runner.commit`); the text after the kept ones is read in the draft's own tokenization next step.
The cache never covers the whole committed text, so each step starts with at least one token read and its logits.
Added tokens stand for their content (`<|im_end|>` is both models' end of turn where both have it, text where one
has not); a draft's special token that the target has not ends its text. A tokenizer's BOS is read before the
prompt. Rows under a structured-output constraint are not drafted (the target decodes them alone).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from itertools import takewhile

import torch

from verispec.config import CrossTokenizerConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.prefix import PrefixStore
from verispec.core.protocols import PrefixState, Runner, RunnerState
from verispec.core.sequence import Sequence
from verispec.drafters.token_text import VocabBridge


@dataclass
class _Row:
    """One sequence's text and what the draft's cache holds of it."""

    text: bytearray = field(default_factory=bytearray)  # the committed tokens as bytes
    read: int = 0  # target tokens of the sequence turned into `text`
    ends: list[int] = field(default_factory=list)  # per target token read: where its bytes end in `text`
    covered: int = 0  # bytes of `text` the draft's committed cache holds
    ids: list[int] = field(default_factory=list)  # the draft ids in its committed cache (BOS included)
    fed: list[int] = field(default_factory=list)  # this step's draft ids fed as uncommitted nodes, in order
    off: bool = False  # past the draft's context window: no more drafts for this row


class CrossTokenizerDrafter(RowStates):
    """Draft with a model whose tokenizer differs from the target's (see the module docstring).

    Args:
        runner: the draft model's runner (its own vocabulary).
        bridge: the two tokenizers (`VocabBridge(target text, draft text)`).
        target_vocab_size: width of the target's logits (q rows).
        config: the scheme and how many draft passes a target token may take.
    """

    name = "cross-tokenizer"
    # reads only committed tokens; a row given no drafts reads `prefill_chunk` ids a step
    traits = Traits(reads_prompt=True, chunked_prefill=True, follows_prefixes=True)

    def __init__(self, runner: Runner, bridge: VocabBridge, target_vocab_size: int,
                 config: CrossTokenizerConfig = CrossTokenizerConfig()) -> None:
        self.runner, self.bridge, self.config = runner, bridge, config
        self.target_vocab_size = target_vocab_size
        # the string scheme writes a K + 1st target token it does not propose (the tuner charges it)
        self.traits = replace(self.traits, held_back=1 if config.scheme == "string" else 0)
        self.state: RunnerState | None = None
        self.rows: list[_Row] = []
        self.prefixes: PrefixStore | None = None  # finished rows' caches by their draft ids (`reuse_prefixes`)
        # (Vd,) draft ids the string scheme may write: those with text. Intersection: only the shared ones.
        self.writable = bridge.draft.usable
        self.shared = bridge.draft_to_target >= 0
        # a draft's added token ends its text unless the target has the same added token
        target_added = {bridge.target.pieces[i] for i in bridge.target.added}
        self.ends_text = {j for j in bridge.draft.added if bridge.draft.pieces[j] not in target_added}

    def cache_bytes(self, tokens: int) -> int:
        return self.runner.cache_bytes(tokens)

    @property
    def cached(self) -> list[int]:
        """Per row: the target tokens whose text the draft's cache holds whole (the composite charges the reading of
        the rest)."""
        return [bisect_right(row.ends, row.covered) for row in self.rows]

    def new_row(self, seq: Sequence) -> _Row:
        return _Row()  # its text is read from the row's tokens when it drafts

    def start(self, sequences: list[Sequence]) -> None:
        self.state = self.runner.new_state(len(sequences))
        super().start(sequences)
        self._reuse(0, sequences)

    def extend(self, sequences: list[Sequence]) -> None:
        assert self.state is not None, "start() must be called before extend()"
        self.state.extend(len(sequences))
        first = len(self.rows)
        super().extend(sequences)
        self._reuse(first, sequences)

    def keep(self, rows: list[int]) -> None:
        assert self.state is not None
        store, kept = self._store(), set(rows)
        for b, row in enumerate(self.rows if store is not None else ()):
            if b not in kept and row.ids:  # leaving: its cache over the draft ids it holds, kept for later rows
                store.try_keep(self.state, b, row.ids, "the cross-tokenizer draft")
        self.state.select(torch.tensor(rows, dtype=torch.long))
        super().keep(rows)

    # --- prefix reuse ------------------------------------------------------------------------------------------
    def reuse_prefixes(self, budget_bytes: int) -> None:
        self.prefixes = PrefixStore.of(budget_bytes)

    def _store(self) -> PrefixStore | None:
        """The draft's own prefix store where its rows copy exactly (the native runner's)."""
        return self.prefixes if self.prefixes is not None and isinstance(self.state, PrefixState) else None

    def _reuse(self, first: int, sequences: list[Sequence]) -> None:
        """Joining rows start from the longest stored prefix of their text in the draft's own ids (its BOS, then the
        text's encoding): the cache over those ids and the bytes they hold. Stored rows read their text in pieces
        (seams), so a prefix matches up to the first place the two tokenizations part."""
        store = self._store()
        for b, seq in enumerate(sequences if store is not None else (), start=first):
            row = self.rows[b]
            self._sync(row, seq)
            text = self.bridge.draft.encode(bytes(row.text))
            if self.bridge.draft.bytes_of(text) != bytes(row.text):  # (an encoding that does not give the bytes back)
                continue
            ids = self.bridge.draft.prefix + text
            taken = store.try_take(self.state, b, ids, "the cross-tokenizer draft")
            if taken:
                row.ids = ids[:taken]
                row.covered = len(self.bridge.draft.bytes_of(ids[len(self.bridge.draft.prefix) : taken]))

    def _sync(self, row: _Row, seq: Sequence) -> None:
        """Append the sequence's new committed tokens to the row's text."""
        for token in seq.tokens[row.read:]:
            row.text += self.bridge.target.bytes_of([token])
            row.ends.append(len(row.text))
        row.read = len(seq.tokens)

    def _read(self, row: _Row, drafting: bool) -> list[int]:
        """The draft's ids of the committed text its cache does not hold (its BOS before the prompt), marked read: all
        of it, or for a row given no drafts while the target reads a long prompt in chunks, `prefill_chunk` ids."""
        ids = self.bridge.draft.encode(bytes(row.text[row.covered:]))
        prefix = self.bridge.draft.prefix if not row.ids else []
        chunk = self.prefill_chunk
        if not drafting and chunk is not None and len(ids) > chunk:
            read = self.bridge.draft.bytes_of(ids[:chunk])
            if row.text[row.covered:row.covered + len(read)] == read:  # (not where bytes were read as U+FFFD)
                row.covered += len(read)
                row.ids += prefix + ids[:chunk]
                return prefix + ids[:chunk]
        row.covered = len(row.text)
        row.ids += prefix + ids
        return prefix + ids

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        assert self.state is not None, "start() must be called before propose()"
        B = len(sequences)
        inputs: list[list[int]] = []
        limits = list(depths)  # per row: target tokens still wanted (0: none)
        budget = [max(1, int(self.config.passes_per_token * k)) for k in depths]  # per row: draft passes allowed
        for b, (row, seq) in enumerate(zip(self.rows, sequences)):
            self._sync(row, seq)
            row.fed = []
            if not row.off and len(row.ids) + (len(row.text) - row.covered) + budget[b] + 1 > self.runner.context_window:
                row.off = True  # (a token holds a byte or more) the draft cannot read further: no drafts for this row
            drafting = limits[b] > 0 and not row.off and seq.constraint is None
            pending = [] if row.off else self._read(row, drafting)
            if not drafting or not pending or row.covered < len(row.text):
                limits[b] = 0
            inputs.append(pending)
        if not any(limits):
            if any(inputs):
                self.runner.forward(self.state, inputs, [0] * B)  # keep up, so the next step stays narrow
            return [EMPTY_DRAFT] * B
        written: list[bytearray] = [bytearray() for _ in range(B)]  # string scheme: the draft's text so far
        drafted: list[list[int]] = [[] for _ in range(B)]  # target ids
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(B)]  # intersection, sampled: (Vt,) per draft
        active = [limit > 0 for limit in limits]
        parents = None  # the first pass reads committed text; later ones each row's last draft token, a node
        passes = 0
        while any(active):
            logits = self.runner.forward(self.state, inputs, [1 if row else 0 for row in inputs], parents)[:, 0]
            passes += 1
            inputs, parents = [[] for _ in range(B)], [[] for _ in range(B)]
            for b, seq in enumerate(sequences):
                if not active[b]:
                    continue
                if self.config.scheme == "string":
                    token, done = self._write(b, logits[b], written[b], drafted, limits[b], passes >= budget[b])
                else:
                    token, done = self._intersect(b, seq, logits[b], drafted, q_rows, limits[b])
                if not done:
                    inputs[b], parents[b] = [token], [len(self.rows[b].fed) - 1]
                    self.rows[b].fed.append(token)
                active[b] = not done
        return [Draft(torch.tensor(d, dtype=torch.long), torch.stack(q_rows[b]) if q_rows[b] else None)
                if d else EMPTY_DRAFT for b, d in enumerate(drafted)]

    def _write(self, b: int, logits: torch.Tensor, text: bytearray, drafted: list[list[int]], k: int,
               last_pass: bool) -> tuple[int, bool]:
        """String scheme: the draft's next token (its argmax among ids with text); True when the row is done, with
        its target tokens in drafted[b]."""
        width = min(logits.shape[-1], self.writable.numel())
        token = int(logits[:width].masked_fill(~self.writable[:width], float("-inf")).argmax())
        ended = token in self.ends_text
        if not ended:
            text += self.bridge.draft.pieces[token]
        ids = self.bridge.target.encode(bytes(text)) if text else []
        if len(ids) > k or ended or last_pass:
            complete = ids if (ended and len(ids) <= k) else ids[: min(k, len(ids) - 1)]
            drafted[b] = list(takewhile(lambda i: i < self.target_vocab_size, complete))
            return token, True
        return token, False

    def _intersect(self, b: int, seq: Sequence, logits: torch.Tensor, drafted: list[list[int]],
                   q_rows: list[list[torch.Tensor]], k: int) -> tuple[int, bool]:
        """Intersection scheme: a draw from the draft's q on the shared ids; True when the row has k drafts."""
        width = min(logits.shape[-1], self.shared.numel())
        row = logits[:width].float().masked_fill(~self.shared[:width], float("-inf")).unsqueeze(0)  # (1, Vd)
        token, q_d = seq.processors.draw(row, None, seq.rng)  # q_d (Vd,): zero off the shared ids; None when greedy
        if q_d is not None:
            q = torch.zeros(self.target_vocab_size, dtype=q_d.dtype)  # (Vt,)
            q[self.bridge.shared_target] = q_d[self.bridge.shared_draft]
            q_rows[b].append(q)
        drafted[b].append(int(self.bridge.draft_to_target[token]))
        return token, len(drafted[b]) >= k

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        """Keep the fed draft tokens whose bytes begin the new committed text (short of its end); drop the others."""
        assert self.state is not None
        keep = []
        for row, seq in zip(self.rows, sequences):
            self._sync(row, seq)
            end, kept = row.covered, 0
            for token in row.fed:
                piece = self.bridge.draft.pieces[token]
                if end + len(piece) >= len(row.text) or row.text[end:end + len(piece)] != piece:
                    break
                end, kept = end + len(piece), kept + 1
            keep.append(list(range(kept)))
            row.covered, row.ids, row.fed = end, row.ids + row.fed[:kept], []
        self.runner.commit(self.state, keep)
