"""What each row of a batch drafts this step, and the drafts: the first part of the engine's step.

A step's plan (`plan_step`) says, per row of a `DecodeBatch`: whether it still reads its prompt in chunks, what shape
it drafts (a chain of depth K, or a tree; the tuner's K or the row's own), and whether something cheaper than the
drafter drafts for it: the tokens its constraint forces, or its request's predicted output. `draft` then asks the
drafter for the rest (`faults.DraftRows`, which keeps a drafter's fault with the row that caused it) and cuts each
deterministic chain before the first token its row's constraint forbids. Every draft made here is exact to verify: the
target's pass and the rejection rule decide what is kept (`verispec.engine.SpeculativeEngine.step`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verispec.batch import DecodeBatch
from verispec.config import TreeConfig
from verispec.constraints import MAX_FORCED
from verispec.core.drafter import EMPTY_DRAFT, Draft
from verispec.core.sequence import Sequence
from verispec.core.stopping import DraftStop
from verispec.errors import is_fault
from verispec.tree import TreeCosts

log = logging.getLogger("verispec.plan")


@dataclass(frozen=True)
class StepPlan:
    """One step's plan for the batch's rows (index b: row b).

    prefilling: rows still reading their prompt a chunk a step (they draft and commit nothing).
    trees: every row's tree where some row drafts one this step (a chain row the tree of shape (1, ..., 1)); None:
        chains.
    depths: the depth each row's drafter drafts to (0: none; forced and predicted rows' drafts come from elsewhere).
    asked: the depth each row could have drafted to (a forced row's lookup guess after its forced run is that long).
    forced: row -> the tokens its constraint forces (drafted for free).
    predicted: row -> its predicted output's chain (`core.prediction`).
    first: some row makes its first output this step (a drafter with a cache reads its prompt then).
    """

    prefilling: list[bool]
    trees: list[TreeConfig] | None
    depths: list[int]
    asked: list[int]
    forced: dict[int, list[int]]
    predicted: dict[int, list[int]]
    first: bool


def plan_step(batch: DecodeBatch) -> StepPlan:
    """The plan of the batch's next step (the draft stops and dynamic trees' costs are set on the rows here, as one
    step's values)."""
    prefilling = batch.prefilling()
    trees, asked = _shapes(batch, prefilling)
    forced = _forced(batch, prefilling)
    predicted = _predicted(batch, prefilling, forced)
    depths = [0 if b in forced or b in predicted else d for b, d in enumerate(asked)]
    # a drafter with a cache of its own reads each prompt in the row's first step even when nothing is drafted then
    # (the tuner's K is 0): a later probe then costs a step's catch-up, not the whole prompt after the first output
    first = any(s.num_generated == 0 and not pre for s, pre in zip(batch.sequences, prefilling))
    return StepPlan(prefilling, trees, depths, asked, forced, predicted, first)


def draft(batch: DecodeBatch, plan: StepPlan) -> list[Draft]:
    """Every row's draft for this step: the drafter's, a forced run (followed by the drafter's guess of what comes
    after it), or the predicted output's chain; deterministic chains cut at their row's constraint."""
    rows = batch.sequences
    drafts = batch.draft_rows.propose(rows, plan.depths, plan.trees, plan.first)
    for b, tokens in plan.forced.items():
        drafts[b] = Draft(torch.tensor(after_forced(batch, b, tokens, plan.asked[b]), dtype=torch.long))
    for b, tokens in plan.predicted.items():
        drafts[b] = Draft(torch.tensor(tokens, dtype=torch.long))
    return [within_constraint(s, d) for s, d in zip(rows, drafts)]


def _shapes(batch: DecodeBatch, prefilling: list[bool]) -> tuple[list[TreeConfig] | None, list[int]]:
    """What each row drafts this step: (trees, depths) for the drafter's `propose`.

    Chains (trees None) unless some row drafts a tree; then every drafting row drafts one, a chain row the tree of
    shape (1, ..., 1). A depth is at most K (the tuner's, or the row's own; a tuned dynamic tree's, at most the
    tuner's tree depth) and never more than the tokens left after this step's own token; 0 for rows that draft
    nothing."""
    active, tuner, drafter = batch.sequences, batch.tuner, batch.drafter
    left = [s.max_new_tokens - s.num_generated - 1 for s in active]
    drafts = batch.draft_rows.drafting(active)
    drafting = [s.drafting and d and not pre for s, d, pre in zip(active, drafts, prefilling)]
    if drafter.traits.plain or not any(d and s.spec.tree is not None for s, d in zip(active, drafting)):
        rows = len(active)
        k = None
        if tuner is not None:  # a drafter that sizes its own drafts gets the costs and the longest K
            sizes = not drafter.traits.plain and drafter.size_drafts(tuner.costs(rows))
            k = tuner.profile.k_max if sizes else tuner.k(drafter.traits.stops_chains, rows)
        tuned_stop = None if tuner is None else tuner.draft_stop(rows)  # from measured costs
        for s in active:
            s.draft_stop = tuned_stop or (DraftStop.fixed(s.spec.draft_stop) if s.spec.draft_stop > 0 else None)
        return None, [min(s.spec.num_draft_tokens if k is None or not s.tuned else k, n) if d else 0
                      for s, n, d in zip(active, left, drafting)]
    trees = [s.spec.tree_or_chain for s in active]
    depths = [min(t.depth(s.spec.num_draft_tokens), n) if d else 0 for s, t, n, d in zip(active, trees, left, drafting)]
    costs = None
    if tuner is not None:  # dynamic trees keep only the nodes that pay for their share of the pass
        profile = tuner.costs(len(active))
        sized = [d > 0 and s.tuned and t.budget is not None for s, t, d in zip(active, trees, depths)]
        if not drafter.size_drafts(profile) and any(sized):  # and the depths that pay for their draft passes (0:
            depth = tuner.k(rows=len(active), tree=True)  # this step drafts none), unless the drafter sizes its own
            depths = [min(d, depth) if z else d for d, z in zip(depths, sized)]
        costs = profile.pass_costs()  # measured widths bound the tree: wider passes were never timed
    for s, t, d in zip(active, trees, depths):
        s.tree_costs = (TreeCosts(min(t.budget, len(costs) - 1), costs, d * profile.c)
                        if costs is not None and t.budget is not None and s.tuned else None)
    return trees, depths


def _forced(batch: DecodeBatch, prefilling: list[bool]) -> dict[int, list[int]]:
    """Rows whose constraint forces their next tokens, with those tokens (at most MAX_FORCED, and never past the
    tokens left after this step's own). Only while speculating: with no drafter a row decodes plainly."""
    if batch.drafter.traits.plain:
        return {}
    forced = {}
    drafting = batch.draft_rows.drafting(batch.sequences)
    for b, (s, pre, d) in enumerate(zip(batch.sequences, prefilling, drafting)):
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


def _predicted(batch: DecodeBatch, prefilling: list[bool], forced: dict[int, list[int]]) -> dict[int, list[int]]:
    """Rows whose predicted output (`core.prediction`) drafts this step, with its chain: it replaces the drafter's draft
    for the row (any deterministic draft is exact), never a constraint's forced run, and never goes past the tokens
    left after this step's own."""
    predicted = {}
    for b, (s, pre) in enumerate(zip(batch.sequences, prefilling)):
        if s.prediction is None or pre or b in forced:
            continue
        left = s.max_new_tokens - s.num_generated - 1
        tokens = s.prediction.draft(s.generated, min(s.spec.prediction_depth, left)) if left > 0 else []
        if tokens:
            predicted[b] = tokens
    return predicted


def after_forced(batch: DecodeBatch, b: int, tokens: list[int], depth: int) -> list[int]:
    """Row b's forced tokens, followed (where the drafter has deterministic continuations and the row drafts this step)
    by the drafter's guess of what follows them: one chain verified in one pass. The guess is optional: a fault in it
    leaves the forced run alone."""
    if batch.drafter.traits.plain or depth <= 0:
        return tokens
    seq = batch.sequences[b]
    left = seq.max_new_tokens - seq.num_generated - 1 - len(tokens)
    return tokens + batch.draft_rows.continuation(b, seq, tokens, min(depth, left))[: max(left, 0)]


def within_constraint(seq: Sequence, draft: Draft) -> Draft:
    """A deterministic chain cut before its first token the row's constraint forbids: that token has p = 0 and would be
    rejected, and the recovered token would come from p itself (the residual of a one-hot q at a token of probability
    0), as the bonus token after the cut chain does; so the cut changes nothing but the pass's width. A sampled draft
    is never cut by its value (that would not be exact)."""
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
