"""A running batch: sequences join and leave between steps, and a fault stays with whoever it belongs to.

`DecodeBatch` holds what the engine's step (`SpeculativeEngine.step`: draft, one target pass, verify, commit) runs
over: the rows (membership, between steps: the server's continuous batching, `SpeculativeEngine.stream`'s fixed batch),
the prompts read in chunks, the prefixes reused, and the guards that keep a fault with whoever it belongs to. It does
not know the order of a step; the engine does not know how a fault is kept.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from verispec.config import check_tree_request
from verispec.core.drafter import EMPTY_DRAFT, Draft, Drafter
from verispec.core.protocols import PrefixState
from verispec.core.sequence import Sequence, StepEvent, StepReport
from verispec.errors import VerispecError, is_fault
from verispec.faults import DraftRows, check_inputs, checkpoint, split_forward
from verispec.step import count_step

if TYPE_CHECKING:
    from verispec.step import StepParts
    from verispec.tuning import KTuner

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
        engine: supplies the target, the drafter and the prefix store (`step.StepParts`: a `SpeculativeEngine`).
        tuner: if given, chooses K each step for every drafting sequence instead of `seq.spec`.
        prefill_chunk: prompt tokens a row reads per step while others decode (None: a prompt in one step).
    """

    def __init__(self, engine: StepParts, tuner: KTuner | None = None,
                 prefill_chunk: int | None = None) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise VerispecError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.engine = engine
        self.tuner = tuner
        # what the step reports to once it has committed (`core.sequence.StepReport`): the rows' counters, the tuner
        self.observers: list[Callable[[StepReport], None]] = [count_step]
        if tuner is not None:
            self.observers.append(tuner.observe_report)
        self.prefill_chunk = prefill_chunk
        self.sequences: list[Sequence] = []
        self.state = None  # the target's KV state; None while the batch is empty
        self.faults: list[tuple[str, BaseException]] = []  # (stage, exception) of the faults the batch absorbed
        self.draft_rows = DraftRows(engine.drafter, self.faults)  # the drafter and the rows it drafts
        self._joined: dict[int, float] = {}  # id(sequence) -> when it joined (perf_counter)
        self._copies: bool | None = None  # whether the target's states copy rows (`shares_prompts`); None: not asked

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
        """The engine's prefix store where this batch can use it: the target's state copies rows, and the drafter follows
        a row that joins with its prompt's first positions cached (`Traits.follows_prefixes`); else None."""
        store = self.engine.prefixes
        if store is None or not isinstance(self.state, PrefixState) or not self.drafter.traits.follows_prefixes:
            return None
        return store

    def shares_prompts(self) -> bool:
        """Whether a row can start from the cache another row kept of the same prompt (`verispec.core.prefix`): the store is
        on, the drafter reads only tokens, and the target's rows copy. The server then lets the second of two rows
        with one prompt (a request's n choices) join once the first has read it, rather than read it twice."""
        if self.engine.prefixes is None or not self.drafter.traits.chunked_prefill:
            return False  # (a head follows a stored prefix, but holds no entries of a prompt read a step ago)
        if self._copies is None:
            try:
                state = self.state if self.state is not None else self.engine.target.new_state(0)
                self._copies = isinstance(state, PrefixState)
            except BaseException as err:  # a runner without empty states: no sharing, nothing else lost
                if not is_fault(err):
                    raise
                self._copies = False
        return self._copies

    def _reuse(self, first_row: int, joining: list[Sequence]) -> None:
        """Joining rows start from the longest stored prefix of their prompts (`verispec.core.prefix`); reuse is optional,
        so a fault in it leaves the row to read its whole prompt."""
        store = self._store()
        if store is None:
            return
        for b, seq in enumerate(joining, start=first_row):
            try:  # as far as the drafter can follow (an EAGLE head: as far as its own store reaches)
                seq.target_cached = store.take(self.state, b, seq.tokens, self.drafter.prefix_limit(seq))
            except BaseException as err:
                if not is_fault(err):
                    raise
                log.warning("sequence %d: no prefix reused (%s: %s)", seq.index, type(err).__name__, err)
            seq.stats.cached_tokens = seq.target_cached

    def keep_prefixes(self, rows: list[int]) -> None:
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

    def reset(self) -> None:
        """Forget every row (their sequences are left as they are: the caller ends them) and start afresh: a fresh
        cache and drafter state at the next `add`."""
        self.sequences, self.state, self._joined = [], None, {}
        self.draft_rows = DraftRows(self.engine.drafter, self.faults)

    def cancel(self, seq: Sequence) -> None:
        """Remove a running sequence now; its cache rows are freed and its finish_reason is "cancelled"."""
        row = next(b for b, s in enumerate(self.sequences) if s is seq)
        seq.finish_reason = "cancelled"
        self._drop([row])

    # --- the step's parts (the step itself is the engine's: `SpeculativeEngine.step`) ----------------
    def prefilling(self) -> list[bool]:
        """Rows that still have more prompt to read than one chunk."""
        chunk = self.prefill_chunk
        if chunk is None or not self.drafter.traits.chunked_prefill:
            return [False] * len(self.sequences)
        return [len(s.tokens) - s.target_cached > chunk for s in self.sequences]

    def pending(self, seq: Sequence, prefilling: bool) -> list[int]:
        """The tokens the target reads for this row now: a chunk of its prompt, or everything not yet cached."""
        end = seq.target_cached + self.prefill_chunk if prefilling else len(seq.tokens)
        return seq.tokens[seq.target_cached : end]

    def check(self, pending: list[list[int]], drafts: list[Draft], nodes: list[list[int]]) -> set[int]:
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

    def forward(self, inputs: list[list[int]], wanted: list[int], parents: list[list[int]], failed: set[int]):
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
                raise TargetFault("forward", err) from err
            log.warning("the target's pass failed (%s: %s); it runs again by parts", type(err).__name__, err)
            self.faults.append(("target.forward", err))
            error = err
        try:
            logits, alone = split_forward(target, self.state, point, error, inputs, wanted, parents)
        except BaseException as err:
            if not is_fault(err):
                raise
            raise TargetFault("forward", err) from err
        self.draft_rows.lost()  # drafters that read the pass's features got only its last part's
        for b, err in alone.items():
            self._ended(self.sequences[b], "forward", err)
            failed.add(b)
        return logits

    # --- faults --------------------------------------------------------------------------------------
    def row(self, seq: Sequence, stage: str, work):
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

    def target(self, stage: str, work):
        """Run the target's batched work; a fault there ends the whole batch (its cache is in no known state)."""
        try:
            return work()
        except BaseException as err:
            if not is_fault(err):
                raise
            raise TargetFault(stage, err) from err

    def fail_all(self, stage: str, err: BaseException) -> list[tuple[StepEvent, Sequence]]:
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
    def finish_step(self, events: list, draft_seconds: float, target_seconds: float) -> list[tuple[StepEvent, Sequence]]:
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
        self.keep_prefixes([b for b, s in enumerate(active) if s.finish_reason in ("eos", "stop", "length")])
        try:
            self._drop([b for b, s in enumerate(active) if s.finish_reason is not None])
        except BaseException as err:  # the cache could not drop the rows: start afresh
            if not is_fault(err):
                raise
            return [*events, *failed, *self.fail_all("select", err)]
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


class TargetFault(Exception):
    """The target's batched work failed at `stage` with `error`."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error
