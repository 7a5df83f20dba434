"""A running batch: sequences join and leave between steps, and a fault stays with whoever it belongs to.

`DecodeBatch` is one step of the engine (draft, verify, commit; see `verispec.engine`) over a batch that changes
between steps: the server's continuous batching, and `SpeculativeEngine.stream` for a fixed batch.

Faults. A shared batch must not let one sequence's fault take the others with it. Every guard absorbs any fault
(`errors.is_fault`: an Exception, or a native extension's panic, which derives from BaseException; an interrupt or an
exit goes through) and records it in `faults` as (stage, exception):
  - a fault in one sequence's own work (verifying its drafts, sampling its token, committing, its stop strings)
    ends that sequence alone, with finish_reason "error" and the exception in `Sequence.error`; the others'
    steps go on as if it had finished;
  - a fault in the drafter (which drafts every row in one call) stops drafting for the row that causes it only:
    the drafter is brought back to a known state and the row found by running it for each row alone; that row
    decodes plainly, which is exact (an empty draft is always a valid draft), the others draft on in the same step,
    and rows that join later draft. Drafters that read the target's own passes (heads, self-speculation on the
    native runner) cannot be replayed: there the rows present decode plainly and the drafter is started afresh
    when rows join. A row whose tokens the drafter's own model cannot read (a smaller draft vocabulary) never
    reaches it. See `verispec.faults.DraftRows`;
  - a fault in the target's pass: rows whose pending tokens or drafts the target cannot read are caught before the
    pass (the row ends alone, "inputs"; a bad draft is dropped and its row stops drafting). If the pass raises and
    the target's state can be brought back to before it (the torch runners' dynamic cache and the native GGUF
    runner; not the static cache nor llama.cpp), the pass is run again by halves of its rows: a row that fails
    alone ends ("forward"), the others finish the step. Otherwise, or where the cache fails in a commit or a row
    selection, every sequence in the batch ends with that error and the batch starts afresh; sequences not yet
    admitted are untouched. See `verispec.faults.split_forward`.

Chunked prefill (`prefill_chunk`). A joining sequence's prompt is read `prefill_chunk` tokens per step, in the same
pass as the other rows' drafts, so a long prompt delays the others' next token by one chunk's share of a pass
rather than by the whole prompt. A row still reading its prompt drafts nothing and commits nothing; it yields no
event until its first token. Drafters that read the target's own features or cache (heads, self-speculation) need
the prompt's pass whole, so there the prompt is read in one step as before (`Traits.chunked_prefill`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from verispec.config import TreeConfig, check_tree_request
from verispec.constraints import MAX_FORCED
from verispec.core.drafter import EMPTY_DRAFT, Draft, Drafter
from verispec.core.protocols import PrefixState
from verispec.core.sequence import Sequence, StepClock, StepEvent, TokenLogprob
from verispec.core.stopping import DraftStop
from verispec.errors import VerispecError, is_fault
from verispec.faults import DraftRows, check_inputs, checkpoint, split_forward
from verispec.tree import TreeCosts

if TYPE_CHECKING:
    from verispec.step import StepParts
    from verispec.tuning import AdaptiveK

log = logging.getLogger("verispec.batch")


class DecodeBatch:
    """A running batch that sequences join (`add`) and leave (`cancel`, by finishing, or by a fault) between steps.

    Row b of the target's KV state belongs to `sequences[b]`; the drafter holds the rows that draft, in the same order
    (`draft_rows`, a `faults.DraftRows`). A joining sequence gets empty rows and its prompt is read by the target in
    its first steps, together with the others' drafts. Each
    sequence keeps its own sampling settings, generator, spec (K, stop strings, max_new_tokens) and acceptance,
    so its tokens do not depend on the batch around it. The engine's drafter holds one batch's state: one
    DecodeBatch per engine is live at a time.

    Args:
        engine: supplies the target, the drafter and the step's rules (`step.StepParts`: a `SpeculativeEngine`).
        tuner: if given, chooses K each step for every drafting sequence instead of `seq.spec`.
        prefill_chunk: prompt tokens a row reads per step while others decode (None: a prompt in one step).
    """

    def __init__(self, engine: StepParts, tuner: AdaptiveK | None = None,
                 prefill_chunk: int | None = None) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise VerispecError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.engine = engine
        self.tuner = tuner
        self.prefill_chunk = prefill_chunk
        self.sequences: list[Sequence] = []
        self.state = None  # the target's KV state; None while the batch is empty
        self.faults: list[tuple[str, BaseException]] = []  # (stage, exception) of the faults the batch absorbed
        self.draft_rows = DraftRows(engine.drafter, self.faults)  # the drafter and the rows it drafts
        self._joined: dict[int, float] = {}  # id(sequence) -> when it joined (perf_counter)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def drafter(self) -> Drafter:
        """The engine's drafter while it drafts in this batch (`PLAIN`: plain decoding, or until it is started
        afresh)."""
        return self.draft_rows.active

    # --- membership --------------------------------------------------------------------------------
    def add(self, sequences: list[Sequence]) -> None:
        """Admit new sequences (from `engine.make_sequences`) at the end of the batch.

        All or nothing: if the target's or the drafter's state cannot take them, the batch is left as it was
        (or, if even that fails, emptied with its sequences ended by the error) and the exception is raised."""
        if not sequences:
            return
        if self.tuner is not None:
            for s in sequences:
                check_tree_request(s.spec.tree, True, auto_k=s.tuned)
        if not self.sequences:
            if self.tuner is not None:
                self.tuner.restart()  # new text: the last request's ending does not decide this start
            self.state = self.engine.target.new_state(len(sequences))
            self.draft_rows.begin(list(sequences), self.state, self.prefill_chunk)  # a fresh batch drafts again
        else:
            rows = len(self.sequences)
            self.state.extend(len(sequences))
            self.draft_rows.join(self.sequences, list(sequences))
            if self.state.batch_size != rows + len(sequences):  # pragma: no cover - a runner broke its contract
                raise VerispecError("the target's state did not take the joining rows")
        self._reuse(len(self.sequences), sequences)
        now = time.perf_counter()
        self._joined.update((id(s), now) for s in sequences)
        self.sequences = self.sequences + list(sequences)

    # --- prefix reuse ------------------------------------------------------------------------------
    def _store(self):
        """The engine's prefix store where this batch can use it: the target's state copies rows, and the drafter reads
        only tokens (heads and self-speculation read the target's own prompt pass); else None."""
        store = self.engine.prefixes
        if store is None or not isinstance(self.state, PrefixState) or not self.drafter.traits.chunked_prefill:
            return None
        return store

    def _reuse(self, first_row: int, joining: list[Sequence]) -> None:
        """Joining rows start from the longest stored prefix of their prompts (`verispec.prefix`); reuse is optional,
        so a fault in it leaves the row to read its whole prompt."""
        store = self._store()
        if store is None:
            return
        for b, seq in enumerate(joining, start=first_row):
            try:
                seq.target_cached = store.take(self.state, b, seq.tokens)
            except BaseException as err:
                if not is_fault(err):
                    raise
                log.warning("sequence %d: no prefix reused (%s: %s)", seq.index, type(err).__name__, err)
            seq.stats.cached_tokens = seq.target_cached

    def _keep_prefixes(self, rows: list[int]) -> None:
        """Store these rows' caches (finished rows, and rows that just read their whole prompt) for later requests."""
        store = self._store()
        if store is None:
            return
        for b in rows:
            seq = self.sequences[b]
            try:
                store.keep(self.state, b, seq.tokens[: seq.target_cached])
            except BaseException as err:  # optional: nothing is lost but the reuse
                if not is_fault(err):
                    raise
                log.warning("sequence %d: its cache was not kept for reuse (%s: %s)", seq.index, type(err).__name__, err)

    def cancel(self, seq: Sequence) -> None:
        """Remove a running sequence now; its cache rows are freed and its finish_reason is "cancelled"."""
        row = next(b for b, s in enumerate(self.sequences) if s is seq)
        seq.finish_reason = "cancelled"
        self._drop([row])

    # --- one step ------------------------------------------------------------------------------------
    def step(self) -> list[tuple[StepEvent, Sequence]]:
        """Draft, verify and commit once for every sequence; finished ones (and failed ones) leave the batch.

        Returns (event, sequence) for every sequence that committed tokens or ended this step, in row order
        (a row still reading its prompt has no event yet)."""
        if not self.sequences:
            return []
        try:
            return self._step()
        except _TargetFault as fault:
            return self._fail_all(fault.stage, fault.error)

    def _prefilling(self) -> list[bool]:
        """Rows that still have more prompt to read than one chunk."""
        chunk = self.prefill_chunk
        if chunk is None or not self.drafter.traits.chunked_prefill:
            return [False] * len(self.sequences)
        return [len(s.tokens) - s.target_cached > chunk for s in self.sequences]

    def _pending(self, seq: Sequence, prefilling: bool) -> list[int]:
        """The tokens the target reads for this row now: a chunk of its prompt, or everything not yet cached."""
        end = seq.target_cached + self.prefill_chunk if prefilling else len(seq.tokens)
        return seq.tokens[seq.target_cached : end]

    def _shapes(self, prefilling: list[bool]) -> tuple[list[TreeConfig] | None, list[int]]:
        """What each row drafts this step: (trees, depths) for the drafter's `propose`.

        Chains (trees None) unless some row drafts a tree; then every drafting row drafts one, a chain row the
        tree of shape (1, ..., 1). A depth is at most K (the tuner's, or the row's own) and never more than the
        tokens left after this step's own token; 0 for rows that draft nothing."""
        active = self.sequences
        left = [s.max_new_tokens - s.num_generated - 1 for s in active]
        drafter = self.drafter
        drafts = self.draft_rows.drafting(active)
        drafting = [s.drafting and d and not pre for s, d, pre in zip(active, drafts, prefilling)]
        if drafter.traits.plain or not any(d and s.spec.tree is not None for s, d in zip(active, drafting)):
            rows = len(active)
            k = None
            if self.tuner is not None:  # a drafter that sizes its own drafts gets the costs and the longest K
                sizes = not drafter.traits.plain and drafter.size_drafts(self.tuner.costs(rows))
                k = self.tuner.profile.k_max if sizes else self.tuner.k(drafter.traits.stops_chains, rows)
            tuned_stop = None if self.tuner is None else self.tuner.draft_stop(rows)  # from measured costs
            for s in active:
                s.draft_stop = tuned_stop or (DraftStop.fixed(s.spec.draft_stop) if s.spec.draft_stop > 0 else None)
            return None, [min(s.spec.num_draft_tokens if k is None or not s.tuned else k, n) if d else 0
                          for s, n, d in zip(active, left, drafting)]
        trees = [s.spec.tree_or_chain for s in active]
        depths = [min(t.depth(s.spec.num_draft_tokens), n) if d else 0
                  for s, t, n, d in zip(active, trees, left, drafting)]
        costs = None
        if self.tuner is not None:  # dynamic trees keep only the nodes that pay for their share of the pass
            profile = self.tuner.costs(len(active))
            drafter.size_drafts(profile)
            costs = profile.pass_costs()  # measured widths bound the tree: wider passes were never timed
        for s, t, d in zip(active, trees, depths):
            s.tree_costs = (TreeCosts(min(t.budget, len(costs) - 1), costs, d * profile.c)
                            if costs is not None and t.budget is not None and s.tuned else None)
        return trees, depths

    def _forced(self, prefilling: list[bool]) -> dict[int, list[int]]:
        """Rows whose constraint forces their next tokens, with those tokens (at most MAX_FORCED, and never past the
        tokens left after this step's own). Only while speculating: with no drafter a row decodes plainly."""
        if self.drafter.traits.plain:
            return {}
        forced = {}
        drafting = self.draft_rows.drafting(self.sequences)
        for b, (s, pre, d) in enumerate(zip(self.sequences, prefilling, drafting)):
            if s.constraint is not None and s.drafting and d and not pre:
                try:
                    tokens = s.constraint.forced(min(MAX_FORCED, s.max_new_tokens - s.num_generated - 1))
                except BaseException as err:  # free drafts are optional: the row drafts as usual
                    if not is_fault(err):
                        raise
                    log.warning("sequence %d: no forced tokens (%s: %s)", s.index, type(err).__name__, err)
                    tokens = []
                if tokens:
                    forced[b] = tokens
        return forced

    def _predicted(self, prefilling: list[bool], forced: dict[int, list[int]]) -> dict[int, list[int]]:
        """Rows whose predicted output (`core.prediction`) drafts this step, with its chain: it replaces the drafter's
        draft for the row (any deterministic draft is exact), never a constraint's forced run, and never goes past the
        tokens left after this step's own."""
        predicted = {}
        for b, (s, pre) in enumerate(zip(self.sequences, prefilling)):
            if s.prediction is None or pre or b in forced:
                continue
            left = s.max_new_tokens - s.num_generated - 1
            tokens = s.prediction.draft(s.generated, min(s.spec.prediction_depth, left)) if left > 0 else []
            if tokens:
                predicted[b] = tokens
        return predicted

    def _after_forced(self, b: int, tokens: list[int], depth: int) -> list[int]:
        """A row's forced tokens, followed (where the drafter has deterministic continuations and the row drafts this
        step) by the drafter's guess of what follows them: one chain verified in one pass. The guess is optional: a
        fault in it leaves the forced run alone."""
        if self.drafter.traits.plain or depth <= 0:
            return tokens
        left = self.sequences[b].max_new_tokens - self.sequences[b].num_generated - 1 - len(tokens)
        return tokens + self.draft_rows.continuation(b, self.sequences[b], tokens, min(depth, left))[: max(left, 0)]

    def _within_constraint(self, seq: Sequence, draft: Draft) -> Draft:
        """A deterministic chain cut before its first token the row's constraint forbids: that token has p = 0 and
        would be rejected, and the recovered token would come from p itself (the residual of a one-hot q at a token of
        probability 0), as the bonus token after the cut chain does; so the cut changes nothing but the pass's width.
        A sampled draft is never cut by its value (that would not be exact)."""
        if seq.constraint is None or draft.q is not None or not draft.is_chain or not len(draft):
            return draft
        try:
            keep = seq.constraint.valid_prefix(draft.tokens.tolist())
        except BaseException as err:  # the cut is optional: the draft is verified whole
            if not is_fault(err):
                raise
            log.warning("sequence %d: draft not checked against its constraint (%s: %s)", seq.index,
                        type(err).__name__, err)
            return draft
        return draft if keep == len(draft) else Draft(draft.tokens[:keep]) if keep else EMPTY_DRAFT

    def _step(self) -> list[tuple[StepEvent, Sequence]]:
        active, rules, absorbed = self.sequences, self.engine.rules, len(self.faults)
        prefilling = self._prefilling()
        trees, depths = self._shapes(prefilling)
        t0 = time.perf_counter()
        forced = self._forced(prefilling)  # row -> tokens its constraint forces: drafted for free
        predicted = self._predicted(prefilling, forced)  # row -> its predicted output's chain
        depths_before, depths = depths, [0 if b in forced or b in predicted else d for b, d in enumerate(depths)]
        # a drafter with a cache of its own reads each prompt in the row's first step even when nothing is drafted
        # then (the tuner's K is 0): a later probe then costs a step's catch-up, not the whole prompt after the first
        # output
        first = any(s.num_generated == 0 and not pre for s, pre in zip(active, prefilling))
        drafts = self.draft_rows.propose(active, depths, trees, first)
        for b, tokens in forced.items():  # the forced run, then a lookup's guess of what follows it
            drafts[b] = Draft(torch.tensor(self._after_forced(b, tokens, depths_before[b]), dtype=torch.long))
        for b, tokens in predicted.items():
            drafts[b] = Draft(torch.tensor(tokens, dtype=torch.long))
        drafts = [self._within_constraint(s, d) for s, d in zip(active, drafts)]
        t1 = time.perf_counter()
        # One pass: each row's pending tokens, then its draft's nodes; logits after the last pending token and
        # after each node (none for a row still reading its prompt). Rows the target cannot read end before it.
        pending = [self._pending(s, pre) for s, pre in zip(active, prefilling)]
        nodes = [d.tokens.tolist() for d in drafts]
        failed = self._check(pending, drafts, nodes)
        inputs = [[] if b in failed else p + n for b, (p, n) in enumerate(zip(pending, nodes))]
        wanted = [0 if pre or b in failed else len(d) + 1 for b, (d, pre) in enumerate(zip(drafts, prefilling))]
        parents = [d.tree.parents.tolist() for d in drafts]
        logits = self._forward(inputs, wanted, parents, failed)  # per row: (>= len(d) + 1, V)
        t2 = time.perf_counter()
        if self.tuner is not None:  # costs measured while decoding (what the tuner learns from: `observe_step`)
            self.tuner.observe_step(StepClock(t1 - t0, t2 - t1, sum(len(i) for i in inputs), max(depths, default=0),
                                              first, any(prefilling), calm=len(self.faults) == absorbed))
        verdicts = self._verify(drafts, logits, prefilling, failed)
        paths = [v.path if v is not None else () for v in verdicts]
        self._target("commit", lambda: self.engine.target.commit(self.state, [list(p) for p in paths]))
        events, prompted = [], []
        for b, (s, d, v, pre, read) in enumerate(zip(active, drafts, verdicts, prefilling, pending)):
            if b in failed:  # ended before or in the pass: nothing of it is in the cache, and it leaves below
                continue
            if pre:
                s.target_cached += len(read)
                continue
            if v is None:  # the row failed: its drafts are out of the cache, and it leaves below
                continue
            if s.num_generated == 0:
                prompted.append(b)  # its whole prompt is in the cache now: kept for requests that share it
            s.target_cached = len(s.tokens) + v.num_accepted
            s.stats.record(len(d), v.num_accepted, v.bonus, depth=d.tree.depth)
            if b in forced:
                s.stats.forced_tokens += min(v.num_accepted, len(forced[b]))
            elif b in predicted:
                s.stats.accepted_prediction_tokens += v.num_accepted
                s.stats.rejected_prediction_tokens += len(d) - v.num_accepted
            elif self.tuner is not None and trees is None and len(d):
                self.tuner.observe(len(d), v.num_accepted)
            entries = None
            if s.logprobs is not None:  # before the commit: a constraint's masks are this step's
                entries = self._row(s, "logprobs", lambda b=b, s=s, d=d, v=v: rules.logprobs(s, d, v, logits[b][: len(d) + 1]))
                if entries is None:  # the row failed: it leaves below
                    continue
            event = self._row(s, "commit", lambda s=s, d=d, v=v: rules.commit(s, d.path_tokens(v.path), v))
            if event is not None and entries is not None:
                # a constraint's end token committed without a pass (the only token it allows) has probability 1
                s.logprobs.extend(entries[: len(event.committed)] +
                                  [TokenLogprob(t, 0.0) for t in event.committed[len(entries):]])
            if event is not None and s.prediction is not None:
                s.prediction.observe(len(d) if b in predicted else 0, v.num_accepted, list(event.committed))
            if event is not None and b in forced:
                event = replace(event, forced=True)
            if event is not None:
                events.append((event, s))
        # the drafts verified, forced and cut ones included: a head keeps the target's features at the accepted path's
        # positions, and a draft model keeps only the nodes it fed itself (none for a forced row)
        self.draft_rows.commit(active, drafts, paths)
        self._keep_prefixes([b for b in prompted if active[b].finish_reason is None])
        return self._finish_step(events, t1 - t0, t2 - t1)

    def _verify(self, drafts: list[Draft], logits, prefilling: list[bool], failed: set[int]) -> list:
        """Each row's Verdict (None for a row reading its prompt, or ended): the greedy chain rows from one argmax over
        the pass, the others one by one (`step.StepRules`); a fault in a row's own verification ends that row alone."""
        rules, active = self.engine.rules, self.sequences
        rows = [b for b, (s, d, pre) in enumerate(zip(active, drafts, prefilling))
                if not pre and b not in failed and rules.batched(s, d)]
        try:
            together = rules.verify_rows(rows, active, drafts, logits)
        except BaseException as err:  # the rows are verified one by one, where a fault finds its row
            if not is_fault(err):
                raise
            together = {}
        return [None if pre or b in failed else together[b] if b in together else
                self._row(s, "verify", lambda b=b, s=s, d=d: rules.verify_one(s, d, logits[b][: len(d) + 1]))
                for b, (s, d, pre) in enumerate(zip(active, drafts, prefilling))]

    def _check(self, pending: list[list[int]], drafts: list[Draft], nodes: list[list[int]]) -> set[int]:
        """Rows the target cannot read end now ("inputs"); drafts it cannot read are dropped (`drafts` and `nodes`
        changed in place) and their rows stop drafting. Returns the rows that ended."""
        target = self.engine.target
        window = target.context_window or self.engine.context_window
        bad_rows, bad_drafts = check_inputs(target.vocab_size, window, self.sequences, pending, drafts, nodes)
        for b, err in bad_drafts.items():
            drafts[b], nodes[b] = EMPTY_DRAFT, []
            self.draft_rows.stop(self.sequences[b], "propose", err)
        for b, err in bad_rows.items():
            self._ended(self.sequences[b], "inputs", err)
            drafts[b], nodes[b] = EMPTY_DRAFT, []
        return set(bad_rows)

    def _forward(self, inputs: list[list[int]], wanted: list[int], parents: list[list[int]], failed: set[int]):
        """The target's pass; per row, its logits. If it raises where the state can be brought back to before it, it
        runs again by halves of its rows, and rows that fail alone end ("forward", added to `failed`)."""
        target = self.engine.target
        point = checkpoint(self.state)
        try:
            return target.forward(self.state, inputs, wanted, parents)  # (B, M, V): row b at [b]
        except BaseException as err:
            if not is_fault(err):
                raise
            if point is None:
                raise _TargetFault("forward", err) from err
            log.warning("the target's pass failed (%s: %s); it runs again by parts", type(err).__name__, err)
            self.faults.append(("target.forward", err))
            error = err
        try:
            logits, alone = split_forward(target, self.state, point, error, inputs, wanted, parents)
        except BaseException as err:
            if not is_fault(err):
                raise
            raise _TargetFault("forward", err) from err
        self.draft_rows.lost()  # drafters that read the pass's features got only its last part's
        for b, err in alone.items():
            self._ended(self.sequences[b], "forward", err)
            failed.add(b)
        return logits

    # --- faults --------------------------------------------------------------------------------------
    def _row(self, seq: Sequence, stage: str, work):
        """Run one row's own work; a fault ends that row alone (finish_reason "error") and returns None."""
        try:
            return work()
        except BaseException as err:
            if not is_fault(err):
                raise
            self._ended(seq, stage, err)
            return None

    def _ended(self, seq: Sequence, stage: str, err: BaseException) -> None:
        """This row ends with a fault of its own (it leaves the batch at the end of the step)."""
        log.warning("sequence %d failed in %s: %s: %s", seq.index, stage, type(err).__name__, err)
        self.faults.append((stage, err))
        seq.finish_reason, seq.error = "error", err

    def _target(self, stage: str, work):
        """Run the target's batched work; a fault there ends the whole batch (its cache is in no known state)."""
        try:
            return work()
        except BaseException as err:
            if not is_fault(err):
                raise
            raise _TargetFault(stage, err) from err

    def _fail_all(self, stage: str, err: BaseException) -> list[tuple[StepEvent, Sequence]]:
        """End every sequence of the batch with this error and start afresh."""
        log.error("the target failed in %s (%s: %s); the %d sequences of the batch are ended", stage,
                  type(err).__name__, err, len(self.sequences))
        self.faults.append((f"target.{stage}", err))
        events = []
        for s in self.sequences:
            s.finish_reason, s.error = "error", err
            events.append((StepEvent(s.index, (), -1, False, (), "error"), s))
        self.sequences, self.state, self._joined = [], None, {}
        return events

    # --- bookkeeping ---------------------------------------------------------------------------------
    def _finish_step(self, events: list, draft_seconds: float, target_seconds: float) -> list[tuple[StepEvent, Sequence]]:
        """Account the step's time to every sequence, drop the finished and failed ones, add failure events."""
        active = self.sequences
        now = time.perf_counter()
        for s in active:
            s.stats.wall_seconds = now - self._joined[id(s)]
            s.stats.draft_seconds += draft_seconds
            s.stats.target_seconds += target_seconds
        reported = {id(s) for _, s in events}
        failed = [(StepEvent(s.index, (), -1, False, (), "error"), s) for s in active
                  if s.finish_reason == "error" and id(s) not in reported]
        self._keep_prefixes([b for b, s in enumerate(active) if s.finish_reason in ("eos", "stop", "length")])
        try:
            self._drop([b for b, s in enumerate(active) if s.finish_reason is not None])
        except BaseException as err:  # the cache could not drop the rows: start afresh
            if not is_fault(err):
                raise
            return [*events, *failed, *self._fail_all("select", err)]
        order = {id(s): b for b, s in enumerate(active)}
        return sorted([*events, *failed], key=lambda pair: order[id(pair[1])])

    def _drop(self, rows: list[int]) -> None:
        """Remove these rows from the batch, the target's cache and the drafter's state."""
        if not rows:
            return
        gone = set(rows)
        for b in gone:
            del self._joined[id(self.sequences[b])]
        keep = [b for b in range(len(self.sequences)) if b not in gone]
        before, self.sequences = self.sequences, [self.sequences[b] for b in keep]
        if not self.sequences:
            self.state = None  # frees the whole cache; the next add starts a fresh one
        else:
            self.state.select(torch.tensor(keep, dtype=torch.long))
        self.draft_rows.leave(before, keep)  # the drafter frees its rows too


class _TargetFault(Exception):
    """The target's batched work failed at `stage` with `error`."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error
