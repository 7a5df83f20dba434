"""Choosing K from measured costs: the expected-speedup model of Leviathan et al. (2023), section 3.

With per-token acceptance rate alpha, a step that drafts K tokens yields on average
    E[tokens] = (1 - alpha^(K+1)) / (1 - alpha),
or 1 + alpha_1 (1 - alpha^K) / (1 - alpha) where the first draft position is accepted at its own rate alpha_1 and
each later one at alpha given the one before (`Acceptance`, which the tuner learns). The step costs
(K + h) * c + v(K) target-pass units, where c is one draft token's cost relative to a one-token target pass, h the
draft positions a step computes beyond its K (0 but for a draft that holds tokens back), and v(K) is the cost of a
target pass over K + 1 tokens relative to a one-token pass.
Both are measured on this machine (`measure_costs`), never assumed: on a CPU v(K) grows with K,
on a GPU it stays near 1 for small K. The speedup over plain decoding is E[tokens] / ((K + h) c + v(K));
K = 0 (speculation off) is chosen where no K beats 1.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from verispec.atomic import atomic_write_text
from verispec.core.protocols import Runner
from verispec.core.sequence import StepClock, StepReport
from verispec.core.stopping import DraftStop
from verispec.tree import chain_parents


@dataclass(frozen=True)
class CostProfile:
    """Measured costs, in seconds.

    target_pass: target pass time by number of new tokens (1 .. k_max + 1).
    draft_token: one draft forward pass over one token (0 for drafters that cost ~nothing).
    draft_extra: draft positions a drafting step pays for beyond its K (`Traits.held_back`; h above).
    """

    target_pass: dict[int, float]
    draft_token: float
    draft_extra: float = 0.0

    @property
    def c(self) -> float:
        return self.draft_token / self.target_pass[1]

    def v(self, k: int) -> float:
        widths = sorted(self.target_pass)
        width = min(k + 1, widths[-1])
        return self.target_pass[width] / self.target_pass[1]

    def step_cost(self, k: int) -> float:
        """A step drafting K tokens, in one-token target passes: (K + h) c + v(K)."""
        return (k + self.draft_extra) * self.c + self.v(k)

    def pass_costs(self) -> tuple[float, ...]:
        """v for target passes over 1, 2, ... k_max + 1 tokens (relative to one token), for sizing trees."""
        return tuple(self.target_pass[w] / self.target_pass[1] for w in sorted(self.target_pass))

    @property
    def k_max(self) -> int:
        return max(self.target_pass) - 1


def expected_tokens(alpha: float, k: int, first: float | None = None) -> float:
    """E[tokens per step] drafting K tokens: 1 + alpha_1 (1 - alpha^K) / (1 - alpha), where alpha_1 (`first`, by
    default alpha) is the first draft position's acceptance rate and alpha each later position's given the one before
    it; with one rate for all, (1 - alpha^(K+1)) / (1 - alpha)."""
    first = alpha if first is None else first
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return 1.0 + first * k
    return 1.0 + first * (1.0 - alpha ** k) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, profile: CostProfile, first: float | None = None) -> float:
    """Speedup over plain decoding of drafting K tokens per step (K = 0 gives 1)."""
    if k == 0:
        return 1.0
    return expected_tokens(alpha, k, first) / profile.step_cost(k)


def best_k(alpha: float, profile: CostProfile, first: float | None = None) -> int:
    """The K in 0..k_max with the highest expected speedup (0: speculation does not pay here)."""
    return max(range(profile.k_max + 1), key=lambda k: (expected_speedup(alpha, k, profile, first), -k))


COST_CACHE_FORMAT = 1


class Rate:
    """One acceptance rate from decayed counts: trials accepted and rejected, each observation's counts added after the
    earlier ones are multiplied by `decay` (a window of about 1 / (1 - decay) observations), starting as pseudo-counts
    worth `weight` trials at rate `prior`; every observation is also kept undecayed (`restart`)."""

    def __init__(self, prior: float, weight: float, decay: float) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.accepted, self.rejections = prior * weight, (1 - prior) * weight
        self.total_accepted = self.total_rejections = 0.0

    @property
    def value(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def observe(self, accepted: int, rejected: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejections = self.decay * self.rejections + rejected
        self.total_accepted += accepted
        self.total_rejections += rejected

    def restart(self) -> None:
        """Counts worth the prior's weight at the average rate of everything observed (and the prior)."""
        rate = (self.prior * self.weight + self.total_accepted) / (self.weight + self.total_accepted
                                                                    + self.total_rejections)
        self.accepted, self.rejections = rate * self.weight, (1 - rate) * self.weight


class Acceptance:
    """A drafter's acceptance, learned from each step's chain, as two rates (`expected_tokens`): alpha_1, the first
    draft position's, and alpha, each later position's given that the one before it was accepted.

    A chain's drafts are accepted in a row until the first rejection; the first position is one trial, and each later
    one reached is another (the maximum-likelihood rate of each is its accepted / trials). One pooled rate misled
    the tuner: on a coding prompt at temperature 0.7 the first position was accepted 0.55 of the time and later ones
    0.75, and while speculation was off only one-token probes fed the pooled rate, which then saw the first position
    alone. Each rate's counts decay per observation of its own position (`Rate`).
    """

    def __init__(self, prior: float = 0.6, weight: float = 4.0, decay: float = 0.95) -> None:
        self.first = Rate(prior, weight, decay)
        self.later = Rate(prior, weight, decay)

    @property
    def alpha(self) -> float:
        """Each later position's acceptance rate given the one before."""
        return self.later.value

    @property
    def first_alpha(self) -> float:
        return self.first.value

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.alpha, k, self.first_alpha)

    def best_k(self, profile: CostProfile) -> int:
        return best_k(self.alpha, profile, self.first_alpha)

    def observe(self, accepted: int, rejected: bool) -> None:
        """A chain's drafts accepted in a row, and whether a rejection ended them (False: all accepted, or the count
        was cut short)."""
        if accepted or rejected:
            self.first.observe(int(accepted > 0), int(accepted == 0))
        if accepted > 1 or (accepted and rejected):
            self.later.observe(accepted - 1, int(rejected))

    def restart(self) -> None:
        """Decoding starts afresh (`KTuner.restart`): each rate becomes the prior's weight at its average so far."""
        self.first.restart()
        self.later.restart()


def next_probe_gap(gap: int, accepted: int, every: int, most: int) -> int:
    """Steps to the next probe after one that had `accepted` drafts accepted: half the gap after an accepted probe,
    twice it after a rejected one, kept within [every, most] (`KTuner`, the composite's costly member)."""
    return min(most, max(every, gap // 2 if accepted else gap * 2))


def cached_costs(key: str, measure, directory: Path) -> CostProfile:
    """The cost profile measured before on this machine under `key` (what was measured: models, threads, CPU), or
    `measure()` now, kept in `directory` for the next process. A start profile only: `PassClock` corrects it from
    the passes it times while decoding, so a profile measured on a busier day does not stick. An unreadable file is
    measured again."""
    path = directory / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("format") == COST_CACHE_FORMAT and saved.get("key") == key:
            return CostProfile({int(w): float(t) for w, t in saved["target_pass"].items()}, float(saved["draft_token"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    profile = measure()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": COST_CACHE_FORMAT, "key": key, "draft_token": profile.draft_token,
                                            "target_pass": {str(w): t for w, t in profile.target_pass.items()}}))
    except OSError:  # a read-only cache: measured again next time
        pass
    return profile


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_costs(target: Runner, draft: Runner | None, k_max: int = 8, context: int = 64,
                  repeats: int = 3) -> CostProfile:
    """Time target passes over 1..k_max+1 new tokens and one draft token, after a warm-up each."""
    vocab = min(target.vocab_size, draft.vocab_size) if draft is not None else target.vocab_size
    prompt = [[(i * 7919) % vocab for i in range(context)]]
    state = target.new_state(1)
    target.forward(state, prompt, [1])
    passes = {}
    for width in range(1, k_max + 2):
        tokens = [[(11 + i) % vocab for i in range(width)]]

        def one_pass(tokens=tokens, width=width):  # a chain of `width` draft nodes, dropped again
            target.forward(state, tokens, [width], [list(chain_parents(width))])
            target.commit(state, [[]])

        one_pass()  # warm-up: the first pass of a new shape pays for kernel set-up
        passes[width] = _timed(one_pass, repeats)
    draft_cost = 0.0
    if draft is not None:
        dstate = draft.new_state(1)
        draft.forward(dstate, prompt, [1])

        def one_draft():  # a draft token fed back to the draft, a node of its chain
            draft.forward(dstate, [[11 % vocab]], [1], [[-1]])
            draft.commit(dstate, [[]])

        one_draft()
        draft_cost = _timed(one_draft, repeats)
    return CostProfile(passes, draft_cost)


class PassClock:
    """Target pass costs measured while decoding, by the tokens a pass reads (all its rows together).

    It starts from the profile measured once at start (one row) and learns from every decoding pass: a width with
    `min_samples` recent passes costs the median of its last `window`; any other costs the start profile's
    figure (beyond its widest pass, the widest's cost per token times the tokens: an upper bound where cost grows
    less than linearly) times the median ratio of observed to predicted cost over the last passes of any width.
    Medians, so a busy second does not stick: a slow start profile is corrected within a few passes, a slow
    stretch within `window` passes of its end.
    """

    def __init__(self, profile: CostProfile, window: int = 9, min_samples: int = 3) -> None:
        self.base = profile
        self.window, self.min_samples = window, min_samples
        self.samples: dict[int, deque[float]] = {}  # tokens in the pass -> its last seconds
        self.ratios: deque[float] = deque(maxlen=4 * window)  # observed / predicted, last passes of any width
        self.scale = 1.0  # their median, kept as they change: read for every width of every step's choice

    def predicted(self, tokens: int) -> float:
        widest = max(self.base.target_pass)
        if tokens in self.base.target_pass:
            return self.base.target_pass[tokens]
        return self.base.target_pass[widest] * tokens / widest

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        self.samples.setdefault(tokens, deque(maxlen=self.window)).append(seconds)
        self.ratios.append(seconds / self.predicted(tokens))
        self.scale = statistics.median(self.ratios)

    def cost(self, tokens: int) -> float:
        own = self.samples.get(tokens)
        if own is not None and len(own) >= self.min_samples:
            return statistics.median(own)
        return self.predicted(tokens) * self.scale


@dataclass
class KTuner:
    """Picks K each step from the cost profile and running estimates of acceptance (`Acceptance`: the first draft
    position's rate and each later one's). The counts decay by `decay` per observation (a window of about
    1 / (1 - decay) steps) so K follows the text being written; they start as pseudo-counts worth `prior_weight`
    tokens at rate `prior`.

    While speculation is off, a probe step drafts one token so that a rising acceptance rate can switch
    it back on. The first probe comes `probe_every` steps after speculation went off; each rejected probe
    doubles the gap to the next (up to `probe_max` steps) and each accepted one halves it (down to
    `probe_every`): a rejected probe widens the target pass for nothing, and on hardware where a pass over
    two tokens costs ~1.8 one-token passes (llama.cpp's kernels on a 2-core CPU) a fixed 1-in-16 probe
    cost ~5% of plain decoding speed. For a free drafter (measured draft cost 0: prompt lookup, n-grams) a
    probe stays pending until a step drafts something (prompt lookup drafts only where the context repeats
    itself, and until then probing costs nothing); a draft model's probe that drafted nothing (its chain
    stopped at once) is over, since every probe step runs the draft.

    Acceptance is a property of the text being written, so decoding that starts afresh (`restart`: a batch that
    was empty takes new requests) starts from this drafter's average over everything it has drafted, weighted as
    the prior, and probes on the usual clock: the last request's ending (a stretch the draft could not follow, which
    may have switched speculation off and spaced the probes out to `probe_max` steps) does not decide the next
    request's start. Measured with the cross-tokenizer SmolLM2 draft at temperature 0.7 over Spec-Bench's
    categories in turn: code editing after retrieval prompts drafted at 1.01 tokens a target pass without it.

    Dynamic trees (`--tree-budget`) are sized the same way: their depth is chosen each step (`k(tree=True)`) from a
    second `Acceptance`, `tree_acceptance`, learned from the trees' accepted paths (a tree's depth is its draft
    passes, and its first position, having several candidates, is accepted more often than a chain's), so that a
    costly draft does not run every depth of the configured tree on every step: measured on the 2-core Zen 4 with
    the 0.5B draft, a fixed depth of 4 spent 57-62% of the time drafting, 0.79-0.83x plain decoding on general
    text (tuned: 31%, 1.19x).

    stop_drafts: chains (of a draft model or prompt lookup) stop early where their calibrated confidence
    no longer pays for the next token's costs (`draft_stop`), and K is then only their cap (`k`). Off by
    default: measured here it did not beat this K choice alone (1.25x against 1.30x plain decoding on the
    torch route, 0.97x both on llama.cpp's kernels; see README, "Dynamic draft length").
    """

    profile: CostProfile
    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.95
    probe_every: int = 16
    probe_max: int = 128
    stop_drafts: bool = False
    acceptance: Acceptance | None = field(default=None)  # built from prior, prior_weight and decay
    tree_acceptance: Acceptance | None = field(default=None)  # dynamic trees' accepted paths, built the same way
    steps_off: int = field(default=0)
    probe_gap: int = field(default=0)  # steps between probes now (0: probe_every)
    probing: bool = field(default=False)  # a probe was asked for and nothing has been drafted since
    learn_costs: bool = True  # False: `profile` stays the costs (a profile given by hand, in a test say)
    clock: PassClock | None = field(default=None)  # target pass costs measured while decoding
    draft_seconds: deque = field(default_factory=lambda: deque(maxlen=9))  # last steps' seconds per draft position
    drafted: bool = field(default=False)  # the last step observed drafted (`observe_step`)

    def __post_init__(self) -> None:
        if not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"need 1 <= probe_every <= probe_max, got {self.probe_every} and {self.probe_max}")
        self.probe_gap = self.probe_gap or self.probe_every
        self.acceptance = self.acceptance or Acceptance(self.prior, self.prior_weight, self.decay)
        self.tree_acceptance = self.tree_acceptance or Acceptance(self.prior, self.prior_weight, self.decay)
        self.clock = self.clock or PassClock(self.profile)

    def costs(self, rows: int = 1) -> CostProfile:
        """The costs now, for a batch of `rows` rows: v(K) is a pass over rows x (K + 1) tokens against one over
        `rows` tokens (so speculation shrinks as a batch's plain pass fills the machine), c a draft position's
        seconds against the latter; both from what decoding measured (`PassClock`, the draft's last steps)."""
        widths = range(1, self.profile.k_max + 2)
        passes = {w: self.clock.cost(rows * w) for w in widths}
        draft = self.profile.draft_token
        if draft > 0 and self.draft_seconds:  # a free drafter (measured 0) stays free
            draft = statistics.median(self.draft_seconds)
        return CostProfile(passes, draft, self.profile.draft_extra)

    def observe_pass(self, tokens: int, seconds: float) -> None:
        """A decoding pass of the target over `tokens` tokens (all rows) took `seconds`."""
        if self.learn_costs:
            self.clock.observe(tokens, seconds)

    def observe_report(self, report: StepReport) -> None:
        """A step's observer (`DecodeBatch.observers`): its costs (`observe_step`), then each chain its drafter drafted
        (`observe`; a constraint's forced run and a predicted output are not the drafter's, and in a step with trees
        the rows' outcomes say nothing of a chain's K: they teach the trees' depth, `tree_acceptance`)."""
        self.observe_step(report.clock)
        for row in report.rows:
            if row.source == "drafter" and row.drafted:
                if report.trees:
                    self.observe(row.depth, row.accepted, tree=True)
                else:
                    self.observe(row.drafted, row.accepted)

    def observe_step(self, clock: StepClock) -> None:
        """A batch step's measured costs (`observe_report` reads them once a step). Decoding passes only: a step where
        a row still reads its prompt, or that recovered from a fault, teaches nothing. A drafting step's cost is
        taken only where the step before drafted too, and not in a row's first step: after steps with speculation
        off (a probe), or in a row's first step, a drafter with a cache of its own first reads every token it skipped
        (the prompt, the first time), a one-off that, charged to this step's few positions, made one draft token
        look 8x its cost and kept speculation off for good."""
        if clock.calm and not clock.prefilling:
            self.observe_pass(clock.pass_tokens, clock.pass_seconds)
            if self.drafted and clock.depth and not clock.first:
                self.observe_draft(clock.depth, clock.draft_seconds)
        self.drafted = clock.depth > 0

    def observe_draft(self, positions: int, seconds: float) -> None:
        """The drafter took `seconds` to draft `positions` positions deep (all rows at once), plus the positions it
        holds back (`CostProfile.draft_extra`)."""
        if self.learn_costs and positions > 0 and seconds > 0:
            self.draft_seconds.append(seconds / (positions + self.profile.draft_extra))

    @property
    def alpha(self) -> float:
        """Each later draft position's acceptance rate given the one before (`Acceptance`)."""
        return self.acceptance.alpha

    @property
    def first_alpha(self) -> float:
        """The first draft position's acceptance rate."""
        return self.acceptance.first_alpha

    def k(self, stops_chains: bool = False, rows: int = 1, tree: bool = False) -> int:
        """K for the next step of a batch of `rows` rows, from the costs measured so far (`costs`); while
        speculation is off, 1 on probe steps (see the class docstring), else 0. With `tree`, a dynamic tree's depth,
        from `tree_acceptance` (its pass is costed as a chain's of that depth: the tree's own pruning, from the
        same costs, then keeps only the nodes that pay for their width).
        With `stop_drafts`, K is the longest measured chain whenever speculation pays at all: where each
        chain stops is then the stopping rule's call, token by token, rather than this average's. For a free
        drafter whose chains honour the rule (`stops_chains`: prompt lookup; measured draft cost 0) it is
        so always: the rule then also decides whether a step drafts at all (a copy after a long verbatim match
        may pay where the average copy does not), at no cost where it drafts nothing."""
        if self.stop_drafts and stops_chains and self.profile.draft_token == 0 and not tree:
            return self.profile.k_max  # a free drafter's chains are gated one by one, by their own calibration
        k = (self.tree_acceptance if tree else self.acceptance).best_k(self.costs(rows))
        if k > 0:
            self.steps_off, self.probe_gap, self.probing = 0, self.probe_every, False
            return self.profile.k_max if self.stop_drafts and not tree else k
        if self.probing:
            if self.profile.draft_token == 0:
                return 1
            self.probing = False
        self.steps_off += 1
        if self.steps_off >= self.probe_gap:
            self.steps_off, self.probing = 0, True
            return 1
        return 0

    def draft_stop(self, rows: int = 1) -> DraftStop | None:
        """The per-position stopping thresholds that the measured costs give (None with stop_drafts off)."""
        if not self.stop_drafts:
            return None
        costs = self.costs(rows)
        return DraftStop.from_costs(costs.c, costs.pass_costs())

    def restart(self) -> None:
        """Decoding starts afresh (see the class docstring): the counts become the prior's weight at the drafter's
        average rates so far, and the probe clock its first gap."""
        self.acceptance.restart()
        self.tree_acceptance.restart()
        self.steps_off, self.probe_gap, self.probing = 0, self.probe_every, False

    def observe(self, num_drafted: int, num_accepted: int, tree: bool = False) -> None:
        """One step's outcome (num_drafted > 0; a tree's: its depth and accepted path): the acceptance counts, and
        the probe gap after a probe."""
        (self.tree_acceptance if tree else self.acceptance).observe(num_accepted, num_accepted < num_drafted)
        if self.probing:
            self.probing = False
            self.probe_gap = next_probe_gap(self.probe_gap, num_accepted, self.probe_every, self.probe_max)
