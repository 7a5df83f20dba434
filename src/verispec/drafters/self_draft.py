"""Self-speculation: the target drafts for itself with some sublayers skipped (Draft & Verify, SWIFT, LayerSkip).

The draft is the target minus a `SkipSet` (`verispec.models.skip`): no second model, no second tokenizer,
no weights of its own. It drafts like a draft model (`DraftModelDrafter`: chains, trees, lookup first,
`--auto-k` with its cost c measured like any draft's); only its runner and its cache differ.

Which cache entries the draft reads and writes (native runner). The draft's state is a view of the
target's caches, made afresh each step (`SkipRunner.view`): the same arrays, lengths of its own.
- Committed columns (before the target's committed length): the draft reads the target's keys and values
  at the layers it runs, and never writes them. They are not what the draft would have computed for those
  tokens (its skipped sublayers change every later layer's input), but the draft needs no cache of its own
  and no pass over the prompt; it is the same choice Draft & Verify makes. Any q is exact as long as each
  draft token is drawn from the q reported with it, and that holds whatever the draft reads.
- Columns from the committed length on: scratch. Within a step the draft writes there the keys and values
  of the tokens it reads (the pending token, then its drafts) and reads them back for its next drafts. The
  target's verification pass writes every column past its committed length before any query reads it
  (each layer writes its new tokens' entries, then attends), so none of the draft's entries reaches the
  target's distributions, with one exception made on purpose: the layers before the first skipped one ran
  in full on the same tokens at the same columns, so the verification pass may start those tokens at that
  layer from the draft's hidden state (LayerSkip's reuse; `NativeRunner` checks the match bit for bit:
  same cache, column, token, position and attention, see `_Resume`).
- Nothing to roll back: a rejected draft leaves the target's length and committed columns as they were,
  and the draft keeps nothing between steps but its skip sets. `commit` never touches the caches (a tree
  commit would copy draft entries over columns the target has just committed); the view is dropped.
A row whose target has not read its prompt yet drafts nothing that step: drafting would first run the
draft over the whole prompt, most of a target pass, for one step's drafts.

Torch runner: the draft keeps a cache of its own (`skipping_module`, run by a `ModelRunner`: a transformers
cache cannot be viewed column by column), read from the prompt through the draft's layers and rolled back
like a draft model's. The skip set is then fixed for the run.

On-the-fly choice of the skip set (`SelfDraftConfig.retune`, SWIFT-style, native runner): one
`SkipChooser` per row picks each step's set from that row's verified steps (see `self_retune`); rows with
different sets run as separate passes, so a row drafts the same whatever batch it is in.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from verispec.config import PromptLookupConfig, SelfDraftConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft
from verispec.core.sequence import Sequence
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.self_retune import SkipChooser, SublayerCosts
from verispec.errors import VerispecError
from verispec.models.skip import SkipSet, check_skippable
from verispec.models.runners.skipping import SkipRunner, skipping_module


class SelfDrafter(DraftModelDrafter):
    """Draft with the target itself, some sublayers skipped.

    Args:
        target: the target's runner (native or torch).
        skip: the sublayers the draft skips (each row's starting set when re-tuning).
        config: on-the-fly choice of the skip set (native runner only).
        lookup: "lookup first" n-gram sizes, as for a draft model (None: off).
    """

    name = "self"
    traits = replace(DraftModelDrafter.traits, adaptive=False)  # adaptation trains draft weights: it has none

    def __init__(self, target, skip: SkipSet, config: SelfDraftConfig = SelfDraftConfig(),
                 lookup: PromptLookupConfig | None = None) -> None:
        self.shared = check_skippable(target) == "native"  # the draft reads the target's own cache
        if self.shared:
            runner = SkipRunner(target, skip)
        else:
            if config.retune:
                raise VerispecError("choosing the skip set while decoding (--self-retune) needs the native runner "
                                    "(--backend native): the torch draft keeps its own cache for one fixed set")
            from verispec.models.runners.hf import ModelRunner

            if target.device.type != "cpu":
                raise VerispecError("self-speculation runs on the CPU runners; this target is on "
                                    f"{target.device}: use --device cpu")
            runner = ModelRunner(skipping_module(target.model, skip))
        super().__init__(runner, target.vocab_size, lookup)
        self.target = target
        self.skip = skip
        self.config = config
        self.costs = SublayerCosts.of(target) if config.retune else None
        self.choosers: list[SkipChooser] = []  # per row, when re-tuning
        self.skips: list[SkipSet] = []  # per row: the set of the step being drafted
        self.target_state = None
        # on the native runner its rows are views of the target's own rows (`Traits.restartable`); the torch draft
        # keeps a cache of its own, read from the rows' tokens like a draft model's
        self.traits = replace(self.traits, restartable=not self.shared)

    def bind_target(self, state) -> None:
        self.target_state = state

    # ------------------------------------------------------------------ rows

    def start(self, sequences: list[Sequence]) -> None:
        if not self.shared:
            return super().start(sequences)
        self.choosers, self.skips, self.cached = [], [], []
        self.extend(sequences)

    def extend(self, sequences: list[Sequence]) -> None:
        if not self.shared:
            return super().extend(sequences)
        for _ in sequences:
            if self.config.retune:
                self.choosers.append(SkipChooser(self.skip, self.costs, self.config))
            self.skips.append(self.skip)
            self.cached.append(0)

    def keep(self, rows: list[int]) -> None:
        if not self.shared:
            return super().keep(rows)
        self.skips = [self.skips[r] for r in rows]
        self.cached = [self.cached[r] for r in rows]
        if self.choosers:
            self.choosers = [self.choosers[r] for r in rows]

    # ------------------------------------------------------------------ drafting

    def _view(self, sequences: list[Sequence], limits: list[int]) -> list[int]:
        """Make this step's view of the target's caches; returns the limits with prompt rows at 0."""
        if self.target_state is None:
            raise VerispecError("the self drafter drafts from the target's cache: bind_target() first")
        if self.choosers:
            self.skips = [chooser.choose() for chooser in self.choosers]
        limits = [0 if len(seq.tokens) - seq.target_cached > 1 else n for seq, n in zip(sequences, limits)]
        for seq, row, n in zip(sequences, self.target_state.rows, limits):
            row.reserve(len(seq.tokens) + n + 1)  # the view writes into the target's arrays, never a copy
        self.state = self.runner.view(self.target_state, self.skips)
        # A row that drafts nothing reads nothing: its pending tokens are the target's to read.
        self.cached = [seq.target_cached if n else len(seq.tokens) for seq, n in zip(sequences, limits)]
        return limits

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        if not self.shared:
            return super().propose(sequences, depths, trees)
        depths = self._view(sequences, depths)
        if not any(depths):
            self.drafted_trees = trees is not None
            self.fed, self.stop_keys, self.tree_slots = [0] * len(sequences), [], [[] for _ in sequences]
            return [EMPTY_DRAFT] * len(sequences)
        return super().propose(sequences, depths, trees)

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        if not self.shared:
            return super().commit(sequences, drafts, paths)
        for b, (draft, path) in enumerate(zip(drafts, paths)):
            if not self.drafted_trees and b < len(self.stop_keys) and self.stop_keys[b]:
                self.calibration.observe(self.stop_keys[b], len(path))
            if self.choosers:
                self.choosers[b].observe(draft.tree.depth if len(draft) else 0, len(path))
        self.fed, self.stop_keys, self.tree_slots, self.state = [], [], [], None

    def adapt(self, examples: list) -> None:
        raise VerispecError("the self drafter has no weights of its own to train (--adapt); "
                            "--self-retune re-chooses its skip set instead")

    def check_adaptable(self, config=None) -> None:
        self.adapt([])

    @property
    def switches(self) -> int:
        """Skip-set changes made while decoding, over every row so far."""
        return sum(chooser.switches for chooser in self.choosers)
