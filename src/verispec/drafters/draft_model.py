"""A smaller language model drafts autoregressively; its distributions q go to the verifier.

The draft keeps its own ragged KV cache. Each step it first catches up on the tokens it has not
seen (the last committed token, or two when every draft was accepted: the last draft and the
bonus token), then drafts one token per forward pass, each fed back to it as a draft node (the
runner's `forward` with parents: a chain). After verification the runner's `commit` keeps the draft
tokens the target accepted and drops the others from its cache.

Trees (a row's TreeConfig): the same catch-up pass gives the root's children; then one pass per depth
evaluates the nodes chosen for expansion with the tree's ancestor mask (`forward` with their parents),
and their children are drawn (`verispec.drafters.tree_growth`). After verification the accepted
path's entries are compacted into the draft's cache and the other nodes dropped (`commit`).
Lookup first (`lookup`, off unless configured): at each draft position where the context (with the
tokens drafted so far) ends in an n-gram seen earlier in it, the draft proposes what followed that
n-gram (prompt lookup) instead of its own choice, with q one-hot there; elsewhere its own token and q.
Which source drafts a position is a function of the context, and each position reports the q its
token was drawn from, so verification stays exact. In a tree, a node whose path ends in such an
n-gram gets the copied token as its first child (one-hot q; with sampled children, its only child).
A tiny draft gains most: on its validation set the copied tokens agree with the target far more
often than its own guesses (see verispec.distill).
Dynamic draft length (a sequence's `draft_stop`, see `verispec.core.stopping`): a chain stops where
the calibrated chance that all its drafts are accepted no longer pays for the next token; `fed` counts
the drafts that went into the draft's cache (all kept ones where a chain ends by dropping its next draft).
Online adaptation (`adapt`, see `verispec.adapt` and `draft_adapt.py`) trains a copy of the draft in
the caller's thread; the new weights wait in `_pending_model` until the start of the next `propose`,
which swaps them in and restarts the draft's cache (it holds keys and values of the old weights).
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from verispec.config import AdaptConfig, PromptLookupConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.prefix import PrefixStore
from verispec.core.protocols import PrefixState, Runner, RunnerState, TorchWeights
from verispec.core.sequence import Sequence
from verispec.core.stopping import AcceptanceCalibration
from verispec.drafters.drawing import constrained_logits, penalty_seen
from verispec.drafters.prompt_lookup import lookup, lookup_match
from verispec.drafters.tree_growth import TreeGrowth
from verispec.errors import VerispecError
from verispec.sampling import sample


class DraftModelDrafter(RowStates):
    """Draft with a smaller model that shares the target's tokenizer.

    Args:
        runner: the draft model's runner.
        target_vocab_size: width of the target's logits; q is padded or cut to it (a draft never
            proposes a token outside the target's vocabulary, so cutting keeps q a distribution
            that the draft really samples from).
        lookup: n-gram sizes of "lookup first" (see the module docstring); None drafts from the model only.
        context: the draft reads only the last `context` tokens of each prompt (then everything after
            them); None reads all. A long prompt's draft pass then costs at most `context` tokens, at the
            price of a draft that sees less. Only the draft's guesses change, never the output distribution.
    """

    name = "draft-model"
    traits = Traits(trees=True, adaptive=True, stops_chains=True, chunked_prefill=True, follows_prefixes=True,
                    reads_prompt=True, catches_up=True)  # and input_vocab, its model's (the constructor)

    def __init__(self, runner: Runner, target_vocab_size: int, lookup: PromptLookupConfig | None = None,
                 context: int | None = None) -> None:
        if context is not None and context < 1:
            raise VerispecError(f"a draft's context must be at least 1 token, got {context}")
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.lookup = lookup
        self.context = context
        self.state: RunnerState | None = None
        self.cached: list[int] = []  # per row: how many of the sequence's tokens the draft cache holds
        self.rows: list[list[int]] = []  # per row: its sequence's tokens (the list itself, which grows as it commits)
        self.prefixes: PrefixStore | None = None  # finished rows' draft cache by their tokens (`reuse_prefixes`)
        self.fed: list[int] = []  # per row, after propose: draft tokens fed to the draft model
        self.stop_keys: list[list[tuple]] = []  # per row, after propose: calibration keys of its drafts
        self.calibration = AcceptanceCalibration()  # where chains stop (seq.draft_stop, see core.stopping)
        self.tree_slots: list[list[int]] = []  # per row, after a tree's propose: each node's cache slot (-1: not fed)
        self.drafted_trees = False  # whether the last propose drafted trees (then commit keeps their paths)
        self.adapt_config = AdaptConfig()
        self.trainer = None  # a DraftTrainer, made at the first update
        self._pending_model: torch.nn.Module | None = None
        self._lock = threading.Lock()
        # ids the draft's model reads: its own vocabulary (a smaller one than the target's keeps rows out, see
        # `Traits.input_vocab`; a reduced vocabulary mapped to the target's reads every target id)
        self.traits = replace(type(self).traits, input_vocab=runner.vocab_size)

    def unread(self, b: int, seq: Sequence) -> int:
        return max(0, len(seq.tokens) - self.cached[b]) if b < len(self.cached) else 0

    def cache_bytes(self, tokens: int) -> int:
        return self.runner.cache_bytes(tokens)

    def new_row(self, seq: Sequence) -> list[int]:
        return seq.tokens  # the row's tokens (the sequence's own list), beside `cached`: how many the draft has read

    def start(self, sequences: list[Sequence]) -> None:
        self.state = self.runner.new_state(len(sequences))
        super().start(sequences)
        self.cached = [self._skipped(seq) for seq in sequences]
        self._reuse(0, sequences)

    def extend(self, sequences: list[Sequence]) -> None:
        assert self.state is not None, "start() must be called before extend()"
        self.state.extend(len(sequences))
        first = len(self.cached)
        super().extend(sequences)
        self.cached += [self._skipped(seq) for seq in sequences]
        self._reuse(first, sequences)

    def reuse_prefixes(self, budget_bytes: int) -> None:
        self.prefixes = PrefixStore.of(budget_bytes)

    def _store(self) -> PrefixStore | None:
        """The draft's own prefix store where it is exact: rows that copy (the native runner's), a whole context."""
        if self.prefixes is None or self.context is not None or not isinstance(self.state, PrefixState):
            return None
        return self.prefixes

    def _reuse(self, first: int, sequences: list[Sequence]) -> None:
        """Joining rows start from the longest stored prefix of their tokens (optional: a fault leaves the row to read
        its tokens itself)."""
        store = self._store()
        for b, seq in enumerate(sequences if store is not None else (), start=first):
            self.cached[b] = store.try_take(self.state, b, seq.tokens, "the draft")

    def _keep_leaving(self, rows: list[int]) -> None:
        """Rows leaving (not in `rows`): their cache over the tokens it holds is kept for later rows."""
        store, kept = self._store(), set(rows)
        for b in range(len(self.cached)) if store is not None else ():
            if b not in kept:
                store.try_keep(self.state, b, self.rows[b][: self.cached[b]], "the draft")

    def _skipped(self, seq: Sequence) -> int:
        """Tokens at the start of the sequence that the draft never reads (see `context`)."""
        return 0 if self.context is None else max(0, len(seq.tokens) - self.context)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., Vd) draft logits -> (..., min(Vd, Vt)) logits restricted to target token ids."""
        return logits[..., : self.target_vocab_size]

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        assert self.state is not None, "start() must be called before propose()"
        self.drafted_trees = trees is not None
        if trees is not None:
            return self._propose_tree(sequences, trees, depths)
        return self._propose_chain(sequences, depths)

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        assert self.state is not None
        if self.drafted_trees:
            self._commit_tree(paths)
        else:
            self._commit_chain([len(path) for path in paths])

    def _propose_chain(self, sequences: list[Sequence], depths: list[int]) -> list[Draft]:
        self._swap_pending(sequences)
        B = len(sequences)
        drafted: list[list[int]] = [[] for _ in range(B)]
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
        self.stop_keys = [[] for _ in range(B)]  # per row: calibration key of each draft (stopping rows only)
        p_all = [1.0] * B  # per row: estimated probability that every draft so far is accepted
        limits = list(depths)  # per row: drafts still allowed; cut to the last one where the chain stops
        self.fed = [0] * B  # per row: draft tokens fed to the draft model (in its cache until `commit`)
        inputs = [self._catch_up(seq, b, depths[b]) for b, seq in enumerate(sequences)]
        read = [len(row) for row in inputs]  # per row: pending tokens this call reads
        parents = None  # the first pass reads committed tokens; later ones each row's last draft, a node
        for step in range(max(depths, default=0)):
            if step > 0 and not any(inputs):
                break  # every row's chain has ended
            logits = self.runner.forward(self.state, inputs, [1 if row else 0 for row in inputs], parents)[:, 0]
            logits = self._fit_vocab(logits)  # (B, Vd)
            inputs = [[] for _ in range(B)]
            parents = [[] for _ in range(B)]
            for b, seq in enumerate(sequences):
                if step >= limits[b]:
                    continue
                seen = penalty_seen(seq, drafted[b], logits.shape[-1])  # (1, V) or None
                copied, match = lookup_match(seq.tokens + drafted[b], 1, self.lookup) if self.lookup else ([], 0)
                row = constrained_logits(logits[b : b + 1], seq, drafted[b])  # (1, V): q masked like the target's p
                if row is None or (copied and seq.constraint is not None and copied[0] < row.shape[-1]
                                   and row[0, copied[0]] == float("-inf")):
                    limits[b] = step  # the constraint allows no draft here (or not the copy): the chain ends
                    continue
                if copied:  # deterministic: q is one-hot at the copied token
                    token, q = copied[0], None
                else:  # the argmax when greedy; else q (V,), the token drawn below once the chain goes on
                    token, q = seq.processors.propose(row, seen)
                stop, key = seq.draft_stop, None
                if stop is not None:
                    key = self._stop_key(seq, logits[b], None, token, match) if q is None else None
                    if not self.calibration.proposes(p_all[b], stop.keep_at(step + 1), key, q):
                        limits[b] = step  # x_{step+1} does not pay for its share of the target pass
                        continue
                if q is not None:
                    token = sample(q, seq.rng)
                if stop is not None:
                    key = key or self._stop_key(seq, logits[b], q, token, match)
                    p_all[b] *= self.calibration.estimate(key)
                    self.stop_keys[b].append(key)
                    if p_all[b] < stop.go_on_at(step + 1):
                        limits[b] = step + 1  # no next draft could pay for its draft pass and its width
                q_row = seq.processors.q_row(q, token, self.target_vocab_size, logits.device)  # None when greedy
                if q_row is not None:
                    q_rows[b].append(q_row)
                drafted[b].append(token)
                if step + 1 < limits[b]:
                    inputs[b] = [token]  # the last draft token is never fed: the target scores it
                    parents[b] = [self.fed[b] - 1]  # node fed[b], the child of the one fed before it
                    self.fed[b] += 1  # (unless a chain stops by dropping its next draft: then every kept one is)
        if max(depths, default=0) == 0:
            # Nothing to draft, but keep the cache caught up so the next step stays one token wide.
            if any(inputs):
                self.runner.forward(self.state, inputs, [0] * B)
        for b in range(B):
            self.cached[b] += read[b] + self.fed[b]
        return [
            Draft(torch.tensor(d, dtype=torch.long), torch.stack(q_rows[b]) if q_rows[b] else None) if d else EMPTY_DRAFT
            for b, d in enumerate(drafted)
        ]

    def _catch_up(self, seq: Sequence, b: int, budget: int) -> list[int]:
        """The tokens row b reads first: all it has not read, or for a row given no drafts while the target reads a
        long prompt in chunks (`prefill_chunk`), at most one chunk of them."""
        end = len(seq.tokens) if budget > 0 or self.prefill_chunk is None else self.cached[b] + self.prefill_chunk
        return seq.tokens[self.cached[b] : end]

    def _propose_tree(self, sequences: list[Sequence], trees: list[TreeConfig], depths: list[int]) -> list[Draft]:
        B = len(sequences)
        pending = [self._catch_up(seq, b, depths[b]) for b, seq in enumerate(sequences)]
        logits = self._fit_vocab(self.runner.forward(self.state, pending, [1 if row else 0 for row in pending])[:, 0])
        self.cached = [cached + len(row) for cached, row in zip(self.cached, pending)]
        growths = [TreeGrowth(trees[b], depths[b], seq.sampling, seq.rng, self.target_vocab_size, seq.constraint,
                              seq.tree_costs)
                   if depths[b] > 0
                   else None for b, seq in enumerate(sequences)]
        for b, growth in enumerate(growths):
            if growth is not None:
                growth.add_children(-1, logits[b], penalty_seen(sequences[b], [], logits.shape[-1]),
                                    self._copied(sequences[b], growth, -1))
        slots: list[dict[int, int]] = [{} for _ in range(B)]  # node -> slot in the draft's tree entries
        for depth in range(1, max(depths, default=0)):
            expand = [growth.to_expand(depth) if growth is not None else [] for growth in growths]
            if not any(expand):
                break
            parents = []
            for b, nodes in enumerate(expand):
                parents.append([slots[b].get(growths[b].parents[n], -1) for n in nodes])
                for n in nodes:
                    slots[b][n] = len(slots[b])
            tokens = [[growths[b].tokens[n] for n in nodes] for b, nodes in enumerate(expand)]
            out = self._fit_vocab(self.runner.forward(self.state, tokens, [len(row) for row in tokens], parents))
            for b, nodes in enumerate(expand):
                for j, n in enumerate(nodes):
                    growths[b].add_children(n, out[b, j], penalty_seen(sequences[b], growths[b].path(n), out.shape[-1]),
                                            self._copied(sequences[b], growths[b], n))
        drafts: list[Draft] = []
        self.tree_slots = []
        for b, growth in enumerate(growths):
            if growth is None:
                drafts.append(EMPTY_DRAFT)
                self.tree_slots.append([])
                continue
            draft, nodes = growth.finish()
            drafts.append(draft)
            self.tree_slots.append([slots[b].get(n, -1) for n in nodes])
        return drafts

    def _copied(self, seq: Sequence, growth: TreeGrowth, node: int) -> int | None:
        """Lookup first in a tree: the token that followed the n-gram the context and the path to `node` end in."""
        if self.lookup is None:
            return None
        found = lookup(seq.tokens + growth.path(node), 1, self.lookup)
        return found[0] if found else None

    def _commit_tree(self, paths: list[tuple[int, ...]]) -> None:
        keep = []
        for b, path in enumerate(paths):
            # The path's nodes that were fed to the draft are a prefix of it: only a node with children is fed. A row
            # this drafter drafted no tree for fed none: its step verified a forced run or a predicted output, and in a
            # step where every row did, the drafter was not asked to propose at all (no slots this step).
            slots = self.tree_slots[b] if b < len(self.tree_slots) else []
            fed = [slots[n] for n in path if slots[n] >= 0] if slots else []
            keep.append(fed)
            self.cached[b] += len(fed)
        self.runner.commit(self.state, keep)
        self.tree_slots = []

    def _commit_chain(self, num_accepted: list[int]) -> None:
        keep = []
        for b, accepted in enumerate(num_accepted):
            in_cache = self.fed[b] if b < len(self.fed) else 0  # drafts x_1..x_fed are the draft's uncommitted nodes
            kept = min(accepted, in_cache)
            keep.append(list(range(kept)))
            self.cached[b] -= in_cache - kept
            if b < len(self.stop_keys) and self.stop_keys[b]:
                self.calibration.observe(self.stop_keys[b], accepted)
        self.runner.commit(self.state, keep)
        self.fed, self.stop_keys = [], []

    def _stop_key(self, seq: Sequence, logits: torch.Tensor, q: torch.Tensor | None, token: int, match: int) -> tuple:
        """The calibration key of a draft token: the length of the match it was copied after, or the draft's confidence
        in it (q(x) when sampled; at temperature 0 the draft's softmax at the argmax). logits: (V,)."""
        greedy = seq.processors.greedy
        if match:
            return AcceptanceCalibration.copy_key(match, greedy)
        confidence = float(q[token]) if q is not None else float(torch.softmax(logits.float(), -1)[token])
        return AcceptanceCalibration.model_key(confidence, greedy)

    def keep(self, rows: list[int]) -> None:
        assert self.state is not None
        self._keep_leaving(rows)
        self.state.select(torch.tensor(rows, dtype=torch.long))
        super().keep(rows)
        self.cached = [self.cached[r] for r in rows]

    # --- online adaptation -----------------------------------------------------------------------
    def check_adaptable(self, config: AdaptConfig | None = None) -> None:
        """Refuse draft weights that cannot be trained (packed, llama.cpp) before any request runs."""
        from verispec.drafters.draft_adapt import check_trainable

        check_trainable(self.runner.model if isinstance(self.runner, TorchWeights) else None)
        if config is not None:
            self.adapt_config = config

    def adapt(self, examples: list) -> None:
        """Train on AdaptExamples now (any thread); the new weights serve from the next `propose` on."""
        from verispec.drafters.draft_adapt import DraftTrainer

        if self.trainer is None:
            width = min(self.runner.vocab_size, self.target_vocab_size)
            self.trainer = DraftTrainer(self.runner, self.runner.model, width, self.adapt_config)
        model = self.trainer.train(examples)
        with self._lock:
            self._pending_model = model

    def _swap_pending(self, sequences: list[Sequence]) -> None:
        with self._lock:
            model, self._pending_model = self._pending_model, None
        if model is None:
            return
        self.runner.model = model
        if self.state is not None:  # the cache holds the old weights' keys and values: read the context again
            self.state = self.runner.new_state(len(sequences))
            self.cached = [self._skipped(seq) for seq in sequences]
