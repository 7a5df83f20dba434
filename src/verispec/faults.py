"""Faults confined to their row (`verispec.batch`): the drafter's rows, and the target's pass retried by parts.

The drafter drafts every row of a batch in one call, and the target reads every row in one pass, so a fault there
arrives without its row's name. This module finds the row where that can be done, and keeps the fault with it:

Drafter (`DraftRows`). Every guard catches any fault (`errors.is_fault`: an Exception, or a native panic; never an
interrupt) and records it in the batch's `faults` as ("drafter.<stage>", error).
  - Restartable drafters (`Traits.restartable`: draft models with caches of their own, prompt lookup, suffix
    decoding, corpus n-grams, the cross-tokenizer draft, composites of these) hold only the rows that draft, a
    subsequence of the batch's rows in order. After a fault in start, propose or commit, the drafter is started
    afresh for each of its rows alone and run as far as the failed stage (start; start and propose; start, propose
    and commit of an empty path), each row's generator left as it was; rows that fail alone leave it and decode
    without drafts (exact: an empty draft is always valid), the others are started afresh together and, after a
    propose fault, drafted again in the same step (after a keep fault they are first started afresh together, and
    alone only if that fails). After an extend fault the rows held before are started afresh
    and the joining rows extended one at a time: those that fail stay out. A continuation fault names its row. If
    even the restart fails, the rows present decode without drafts, and the drafter is started afresh for the rows
    that join next. Restarting a draft model costs it a re-read of the rows' tokens; suffix decoding never adds a running
    row's output on a restart (it joins its store once, when the row leaves: `keep`, `retire_all`).
  - Aligned drafters (`restartable` False: heads, self-speculation on the native runner) have the target's rows and
    read its passes or cache, which cannot be replayed: a fault turns drafting off for every row present (they stay in
    the drafter, asked for nothing), and the drafter is started afresh for all rows when the next rows join, which
    draft. A target pass run in parts (below) leaves them the same way (their features came from one pass).
  - A row whose tokens hold an id the drafter's own model cannot read (`Traits.input_vocab`: a draft model with a
    smaller vocabulary than the target's) never reaches the drafter: it decodes without drafts (not a fault).

Target (`check_inputs`, `split_forward`). Before the pass each row's pending tokens and draft are checked against
the target's vocabulary and context window: a row whose pending tokens fail ends alone ("inputs"); a draft that fails
is dropped and its row stops drafting ("drafter.propose"). If the pass raises where the target's state can be brought
back (`core.protocols.RestorableState`: the torch runners' dynamic cache, row by row or not, and the native GGUF
runner; not the static cache nor llama.cpp), it is restored and the pass run again over halves of its rows, each half
on the state the halves before it left, down to single rows: a row that fails alone ends ("forward"), the others
finish the step. Where it cannot be, every row of the pass ends with the error and the batch starts afresh.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from verispec.core.drafter import EMPTY_DRAFT, PLAIN, Draft, Drafter
from verispec.core.protocols import RestorableState
from verispec.core.sequence import Sequence
from verispec.errors import VerispecError, is_fault

if TYPE_CHECKING:
    from verispec.config import TreeConfig

log = logging.getLogger("verispec.batch")


class DraftRows:
    """The engine's drafter inside one batch, and which of the batch's rows it drafts (see the module docstring).

    `held`: the rows the drafter holds, in its row order (a subsequence of the batch's rows; an aligned drafter's are
    all of them). `off`: ids of rows that draft nothing more in this batch. `known`: the drafter's state is that of
    `held` (False: it is started afresh before its next use, when rows join).
    """

    def __init__(self, drafter: Drafter, faults: list) -> None:
        self.drafter, self.faults = drafter, faults
        self.held: list[Sequence] = []
        self.off: set[int] = set()
        self.known = False
        self.checked: dict[int, int] = {}  # id(seq) -> its tokens checked against the drafter's input vocabulary
        self.target_state = None

    @property
    def active(self) -> Drafter:
        """The drafter while its state is known (`PLAIN`: plain decoding, or until it is started afresh)."""
        return self.drafter if self.known else PLAIN

    @property
    def aligned(self) -> bool:
        return not self.drafter.traits.restartable

    def drafting(self, sequences: list[Sequence]) -> list[bool]:
        """Per batch row: whether it may draft now."""
        if not self.known:
            return [False] * len(sequences)
        held = {id(s) for s in self.held}
        return [id(s) not in self.off and (self.aligned or id(s) in held) for s in sequences]

    # --- membership ------------------------------------------------------------------------------------
    def begin(self, sequences: list[Sequence], target_state, prefill_chunk: int | None) -> None:
        """A fresh batch: these rows, the target's new state."""
        self.held, self.off, self.checked, self.known = [], set(), {}, False
        if self.drafter.traits.plain:
            return
        try:
            self.drafter.restart(prefill_chunk)
        except BaseException as err:
            if not is_fault(err):
                raise
            self._record("restart", err)
        self.target_state = target_state
        self._screen(sequences)
        self._start(sequences)

    def join(self, present: list[Sequence], joining: list[Sequence]) -> None:
        """Rows join at the end of the batch (`present`: the rows before them)."""
        if self.drafter.traits.plain:
            return
        self._screen(joining)
        if not self.known:  # started afresh for every row it can take; an aligned drafter's present rows stay off
            if self.aligned:
                self.off.update(id(s) for s in present)
            self._start(present + joining)
            return
        rows = joining if self.aligned else [s for s in joining if id(s) not in self.off]
        if not rows:
            return
        if not self.held:
            self._start(present + rows)
            return
        try:
            self.drafter.extend(rows)
            self.held = self.held + rows
        except BaseException as err:
            if not is_fault(err):
                raise
            self._extend_fault(err, rows)

    def leave(self, before: list[Sequence], kept: list[int]) -> None:
        """The batch keeps rows `kept` of `before`; the drafter frees the others' rows."""
        if self.drafter.traits.plain:
            return
        stay = {id(before[b]) for b in kept}
        for s in before:
            if id(s) not in stay:
                self.off.discard(id(s))
                self.checked.pop(id(s), None)
        positions = [i for i, s in enumerate(self.held) if id(s) in stay]
        if len(positions) == len(self.held):
            return
        self.held = [self.held[i] for i in positions]
        if self.known:
            self._keep(positions)

    def stop(self, seq: Sequence, stage: str, err: BaseException) -> None:
        """A fault of this row's own in the drafter: the row drafts no more (it leaves the drafter after `commit`)."""
        self._record(stage, err, f"sequence {seq.index} decodes without drafts")
        self.off.add(id(seq))

    # --- the step --------------------------------------------------------------------------------------
    def propose(self, sequences: list[Sequence], depths: list[int], trees: list[TreeConfig] | None,
                first: bool) -> list[Draft]:
        """Each batch row's draft (empty for rows the drafter does not draft); `first`: a row's first step, when a
        drafter with a cache of its own reads the prompt even without drafting."""
        drafts = [EMPTY_DRAFT] * len(sequences)
        if not self.known:
            return drafts
        self._screen([s for s in self.held if id(s) not in self.off])
        self._evict()
        if not self.known:
            return drafts
        rows = self._rows(sequences)
        seqs = [sequences[b] for b in rows]
        wanted = [depths[b] if id(sequences[b]) not in self.off else 0 for b in rows]
        shapes = None if trees is None else [trees[b] for b in rows]
        if not rows or not (any(wanted) or (first and self.drafter.traits.reads_prompt)):
            return drafts
        try:
            out = self.drafter.propose(seqs, wanted, shapes)
        except BaseException as err:
            if not is_fault(err):
                raise
            out = self._propose_fault(err, seqs, wanted, shapes)
            if out is None:
                return drafts
            rows = self._rows(sequences)
        for b, draft in zip(rows, out):
            drafts[b] = draft
        return drafts

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        """The drafter's continuation after row b's forced tokens ([] where it has none); a fault stops the row."""
        if not self.known or id(seq) in self.off:
            return []
        row = b if self.aligned else next((i for i, s in enumerate(self.held) if s is seq), None)
        if row is None:
            return []
        try:
            return self.drafter.continuation(row, seq, after, depth)
        except BaseException as err:
            if not is_fault(err):
                raise
            self.stop(seq, "continuation", err)
            return []

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        """The step's verified drafts and accepted paths, for the rows the drafter holds; then stopped rows leave."""
        if not self.known:
            return
        rows = self._rows(sequences)
        if rows:
            try:
                self.drafter.commit([sequences[b] for b in rows], [drafts[b] for b in rows], [paths[b] for b in rows])
            except BaseException as err:
                if not is_fault(err):
                    raise
                self._restart("commit", err, list(self.held), probe=self._commit_probe)
        self._evict()

    def lost(self) -> None:
        """The target's pass ran in parts: a drafter that reads its features (aligned) lost this step's."""
        if self.known and self.aligned:
            self.off.update(id(s) for s in self.held)
            self.known = False

    # --- faults ----------------------------------------------------------------------------------------
    def _record(self, stage: str, err: BaseException, what: str = "") -> None:
        log.warning("the drafter failed in %s (%s: %s)%s", stage, type(err).__name__, err, f"; {what}" if what else "")
        self.faults.append((f"drafter.{stage}", err))

    def _rows(self, sequences: list[Sequence]) -> list[int]:
        """The batch rows the drafter holds, in its row order."""
        if self.aligned:
            return list(range(len(sequences)))
        where = {id(s): b for b, s in enumerate(sequences)}
        return [where[id(s)] for s in self.held]

    def _screen(self, rows: list[Sequence]) -> None:
        """Rows whose tokens hold ids the drafter's model cannot read draft no more (see `Traits.input_vocab`)."""
        vocab = self.drafter.traits.input_vocab
        if vocab is None:
            return
        for s in rows:
            done = self.checked.get(id(s), 0)
            new = s.tokens[done:] if done <= len(s.tokens) else s.tokens
            self.checked[id(s)] = len(s.tokens)
            if new and (min(new) < 0 or max(new) >= vocab) and id(s) not in self.off:
                log.info("sequence %d holds token ids the drafter cannot read (its vocabulary: %d); it decodes "
                         "without drafts", s.index, vocab)
                self.off.add(id(s))

    def _evict(self) -> None:
        """Rows that stopped drafting leave a restartable drafter."""
        if self.aligned or not any(id(s) in self.off for s in self.held):
            return
        positions = [i for i, s in enumerate(self.held) if id(s) not in self.off]
        self.held = [self.held[i] for i in positions]
        self._keep(positions)

    def _keep(self, positions: list[int]) -> None:
        try:
            self.drafter.keep(positions)
        except BaseException as err:
            if not is_fault(err):
                raise
            self._restart("keep", err, list(self.held))

    def _start(self, rows: list[Sequence]) -> None:
        """Start the drafter afresh for these rows (those it may hold); a fault is confined as in `_restart`."""
        rows = rows if self.aligned else [s for s in rows if id(s) not in self.off]
        try:
            self.drafter.bind_target(self.target_state)
            self.drafter.start(rows)
            self.held, self.known = rows, True
        except BaseException as err:
            if not is_fault(err):
                raise
            self.held = rows
            self._restart("start", err, rows, tried=True)

    def _give_up(self) -> None:
        """Even a restart failed: the rows present decode without drafts; rows that join later start it afresh."""
        self.off.update(id(s) for s in self.held)
        self.held, self.known = ([] if not self.aligned else self.held), False

    def _restart(self, stage: str, err: BaseException, rows: list[Sequence], tried: bool = False,
                 probe=None) -> bool:
        """After a fault at `stage`: an aligned drafter's rows draft no more; a restartable one is started afresh for
        the rows that do not fail alone (`probe`, else start for the row alone). `tried`: starting all of them is what
        failed. True when the drafter holds those rows afresh."""
        self._record(stage, err)
        if self.aligned:
            self._give_up()
            return False
        rows = [s for s in rows if id(s) not in self.off]
        if not tried and probe is None:
            try:  # a fault that no row causes (a keep, say): all of them, afresh
                self.drafter.bind_target(self.target_state)
                self.drafter.start(rows)
                self.held, self.known = rows, True
                return True
            except BaseException as again:
                if not is_fault(again):
                    raise
        for s in rows:
            if not self._alone(s, probe):
                log.warning("sequence %d fails the drafter alone: it decodes without drafts", s.index)
                self.off.add(id(s))
        good = [s for s in rows if id(s) not in self.off]
        try:
            self.drafter.bind_target(self.target_state)
            self.drafter.start(good)
            self.held, self.known = good, True
            return True
        except BaseException as again:
            if not is_fault(again):
                raise
            self.held = good
            self._give_up()
            return False

    def _alone(self, seq: Sequence, probe) -> bool:
        """Whether the drafter, started afresh for this row alone, gets through `probe` (else its start) for it. The
        row's generator is left as it was (a probe's drafts are never verified)."""
        saved = seq.rng.get_state()
        try:
            self.drafter.start([seq])
            if probe is not None:
                probe(seq)
            return True
        except BaseException as err:
            if not is_fault(err):
                raise
            return False
        finally:
            seq.rng.set_state(saved)

    def _propose_fault(self, err: BaseException, seqs: list[Sequence], depths: list[int],
                       trees: list | None) -> list[Draft] | None:
        """Find the rows whose propose fails alone, then draft the others again; None if the drafter is off."""
        plan = {id(s): (d, None if trees is None else trees[i]) for i, (s, d) in enumerate(zip(seqs, depths))}

        def probe(seq: Sequence) -> None:
            depth, tree = plan[id(seq)]
            self.drafter.propose([seq], [max(1, depth)], None if tree is None else [tree])

        if not self._restart("propose", err, seqs, probe=probe):
            return None
        depths = [plan[id(s)][0] for s in self.held]
        trees = None if trees is None else [plan[id(s)][1] for s in self.held]
        try:
            return self.drafter.propose(list(self.held), depths, trees)
        except BaseException as again:
            if not is_fault(again):
                raise
            self._record("propose", again, "the batch's rows decode without drafts")
            self._give_up()
            return None

    def _commit_probe(self, seq: Sequence) -> None:
        drafts = self.drafter.propose([seq], [1])
        self.drafter.commit([seq], drafts, [()])

    def _extend_fault(self, err: BaseException, joining: list[Sequence]) -> None:
        """The rows held before are started afresh, then the joining rows extended one at a time: those that fail
        stay out."""
        self._record("extend", err)
        if self.aligned:
            self.held = self.held + joining
            self._give_up()
            return
        held = list(self.held)
        try:
            self.drafter.bind_target(self.target_state)
            self.drafter.start(held)
            for s in joining:
                try:
                    self.drafter.extend([s])
                    held.append(s)
                except BaseException as again:
                    if not is_fault(again):
                        raise
                    log.warning("sequence %d fails the drafter's extend alone: it decodes without drafts", s.index)
                    self.off.add(id(s))
                    self.drafter.start(held)
            self.held, self.known = held, True
        except BaseException as again:
            if not is_fault(again):
                raise
            self.held = held
            self._give_up()


# --- the target's pass -----------------------------------------------------------------------------------
def check_inputs(vocab: int, window: int, sequences: list[Sequence], pending: list[list[int]], drafts: list[Draft],
                 nodes: list[list[int]]) -> tuple[dict[int, VerispecError], dict[int, VerispecError]]:
    """Before the target's pass: rows whose pending tokens it cannot read (ids outside its vocabulary of `vocab`,
    positions past `window`), and rows whose draft (`nodes`: its tokens) it cannot (the same for the draft's nodes).
    Returns ({row: error}, {row: error})."""
    rows, bad_drafts = {}, {}
    for b, (s, read, d, tokens) in enumerate(zip(sequences, pending, drafts, nodes)):
        if read and (min(read) < 0 or max(read) >= vocab):
            rows[b] = VerispecError(f"sequence {s.index} holds token ids outside the target's vocabulary "
                                    f"(size {vocab})")
        elif s.target_cached + len(read) > window:
            rows[b] = VerispecError(f"sequence {s.index} runs past the target's context window ({window} tokens)")
        elif tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            bad_drafts[b] = VerispecError(f"the draft of sequence {s.index} holds token ids outside the target's "
                                          f"vocabulary (size {vocab})")
        elif tokens and s.target_cached + len(read) + d.tree.depth > window:
            bad_drafts[b] = VerispecError(f"the draft of sequence {s.index} runs past the target's context window "
                                          f"({window} tokens)")
    return rows, bad_drafts


def checkpoint(state):
    """What brings the target's state back to now after a pass that raised (None: it cannot be brought back)."""
    return state.checkpoint() if isinstance(state, RestorableState) else None


def split_forward(target, state, point, error: BaseException, inputs: list[list[int]], wanted: list[int],
                  parents: list[list[int]]) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
    """The pass again after it raised `error`: the state restored to `point`, then passes over halves of the rows that
    read something, each on the state the ones before it left, halved again where one raises (restored first), down
    to single rows. Returns each row's logits ((max(1, wanted[b]), V), None for a row that failed alone) and the rows
    that failed alone with their errors. A restore that fails raises."""
    state.restore(point)
    logits: list[torch.Tensor | None] = [None] * len(inputs)
    failed: dict[int, BaseException] = {}

    def run(group: list[int]) -> None:
        mark, members = state.checkpoint(), set(group)
        try:
            out = target.forward(state, [inputs[b] if b in members else [] for b in range(len(inputs))],
                                 [wanted[b] if b in members else 0 for b in range(len(inputs))],
                                 [parents[b] if b in members else [] for b in range(len(inputs))])
        except BaseException as err:
            if not is_fault(err):
                raise
            state.restore(mark)
            if len(group) == 1:
                failed[group[0]] = err
                return
            half = len(group) // 2
            run(group[:half])
            run(group[half:])
            return
        for b in group:
            logits[b] = out[b]

    rows = [b for b, tokens in enumerate(inputs) if tokens]
    if len(rows) == 1:  # the pass was this row's alone: it failed alone
        return logits, {rows[0]: error}
    half = len(rows) // 2
    for group in (rows[:half], rows[half:]):
        if group:
            run(group)
    return logits, failed
