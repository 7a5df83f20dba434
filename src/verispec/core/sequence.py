"""The per-sequence state the engine and drafters share, and what one step did for a sequence (`StepEvent`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.sampling import Processors
from verispec.stats import GenerationStats

if TYPE_CHECKING:
    from verispec.constraints import ConstraintState
    from verispec.core.prediction import PredictionFollower
    from verispec.core.stopping import DraftStop
    from verispec.detokenize import IncrementalText
    from verispec.tree import TreeCosts


@dataclass
class Sequence:
    """One prompt being decoded.

    index: position in the caller's batch.
    tokens: prompt followed by the tokens committed so far.
    prompt_len: number of prompt tokens at the start of `tokens`.
    sampling: this sequence's sampling settings (p and q are both processed with them).
    rng: this sequence's own generator, so its output does not depend on the batch around it.
    max_new_tokens: this sequence's limit (spec.max_new_tokens, cut to the context window).
    spec: K, stop strings and EOS handling for this sequence.
    drafting: False decodes this sequence plainly (no drafts, one token per target pass) in any batch.
    tuned: a batch's auto-tuner may choose this sequence's K (False: spec.num_draft_tokens, as its request asked).
    target_cached: how many of `tokens` the target's KV cache holds.
    draft_stop: where this step's draft chain stops early (set by the engine each step from
        spec.draft_stop or an auto-tuner's costs; None: the drafter drafts its budget). See core.stopping.
    tree_costs: this step's measured costs for the row's dynamic tree (set by the engine each step from an
        auto-tuner's costs; None: the tree keeps its budget's nodes). See tree.TreeCosts.
    finish_reason: None while running, then "eos", "stop" or "length" ("cancelled" when removed early, "error"
        when a fault in this sequence's own work ended it: see `error`).
    error: the exception that ended the sequence (finish_reason "error"), else None.
    text: the generated text, decoded incrementally where stop strings are scanned (see verispec.detokenize).
    constraint: where the answer stands in its structured-output constraint (sampling.constraint; None: none).
    scope: whose shared drafter state this sequence may read and add to (a server's tenant, named by its API key
        under `--suffix-scope key`: the suffix store keeps each scope's outputs apart); None: the shared state.
    prediction: where the answer stands in its request's predicted output, which drafts for it while it follows
        (`core.prediction`; None: no prediction).
    logprobs: the target's log-probability of each generated token, with its likeliest alternatives, where
        `spec.logprobs` asks for them (`TokenLogprob`; None otherwise).
    prompt_logprobs: the same for each prompt token after the first, where `spec.prompt_logprobs` asks for them
        (filled before the sequence decodes: `engine.SpeculativeEngine.score_prompt`; None otherwise).
    processors: the processor chain of `sampling`, built with the sequence (`sampling.Processors`): the verifier and
        the drafters process p and q and take the greedy branch through it.
    """

    index: int
    tokens: list[int]
    prompt_len: int
    sampling: SamplingConfig
    rng: torch.Generator
    max_new_tokens: int
    spec: SpecConfig = field(default_factory=SpecConfig)
    drafting: bool = True
    tuned: bool = True
    target_cached: int = 0
    draft_stop: DraftStop | None = None
    tree_costs: TreeCosts | None = None
    finish_reason: str | None = None
    text_end: int | None = None  # where a stop string cut the text, if one did
    error: BaseException | None = None
    text: IncrementalText | None = None
    constraint: ConstraintState | None = None
    scope: str | None = None
    prediction: PredictionFollower | None = None
    logprobs: list[TokenLogprob] | None = None  # one per generated token where spec.logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first (spec.prompt_logprobs)
    stats: GenerationStats = field(default_factory=GenerationStats)
    processors: Processors = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.processors = Processors(self.sampling, self.prompt_len)
        if self.spec.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one committed token, and of the likeliest tokens at its place.

    token, logprob: the token and its log-probability (see `SpecConfig.logprobs_mode` for which distribution).
    top: (token, logprob) of the `SpecConfig.logprobs` likeliest tokens there, likeliest first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepEvent:
    """What one step committed for one sequence.

    sequence: index in the caller's batch.
    accepted: draft tokens the target accepted (all committed unless the sequence ended inside them);
        for a tree, the tokens of the accepted path.
    token: the recovered token (bonus=False) or the bonus token (bonus=True).
    committed: tokens appended to the output this step, after any EOS / stop / length cut.
    finish_reason: None while the sequence runs on; "eos", "stop" or "length" at its end; "error" when a fault
        ended it (`Sequence.error`; committed and token are then empty and -1).
    forced: the draft was the tokens a structured-output constraint forces (free drafts), not the drafter's.
    """

    sequence: int
    accepted: tuple[int, ...]
    token: int
    bonus: bool
    committed: tuple[int, ...]
    finish_reason: str | None
    forced: bool = False


@dataclass(frozen=True)
class StepClock:
    """What one batch step cost and read, for an observer that learns costs from decoding (the auto-tuner:
    `tuning.KTuner.observe_step`).

    draft_seconds: the drafter's proposing, forced runs and constraint cuts included.
    pass_seconds: the target's one pass over every row.
    pass_tokens: tokens that pass read, every row's.
    depth: the deepest draft asked of the drafter (0: no row drafted).
    first: some row took its first step (a drafter with a cache of its own read that row's whole prompt).
    prefilling: some row still reads its prompt in chunks (the pass is not a decoding pass).
    calm: no fault was absorbed in the step (a step that recovered from one is not timed).
    """

    draft_seconds: float
    pass_seconds: float
    pass_tokens: int
    depth: int
    first: bool
    prefilling: bool
    calm: bool


@dataclass(frozen=True)
class RowOutcome:
    """One row's verification in a step, as the step's observers see it (`StepReport`).

    seq: the row's sequence.
    drafted: the nodes its draft held; depth: the draft's depth (a chain's is its length).
    accepted: of them accepted; bonus: the step's last token came from p after the last one.
    source: who drafted: "drafter", "forced" (a constraint's forced run, `forced` tokens of it) or "predicted" (the
        request's predicted output).
    """

    seq: Sequence
    drafted: int
    depth: int
    accepted: int
    bonus: bool
    source: str = "drafter"
    forced: int = 0


@dataclass(frozen=True)
class StepReport:
    """What one batch step did, handed to the step's observers once it has committed (`DecodeBatch.observers`: the
    sequences' counters, `step.count_step`, and the auto-tuner, `tuning.KTuner.observe_report`).

    clock: its costs; rows: every row verified in it; trees: some row drafted a tree.
    """

    clock: StepClock
    rows: tuple[RowOutcome, ...]
    trees: bool
