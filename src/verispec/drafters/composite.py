"""The right drafter each step: free lookups (suffix decoding, prompt lookup, corpus n-grams) and one costly drafter
(a draft model, a head, self-speculation) behind one `Drafter`, chosen per row and per step.

`--draft suffix+qwen2.5-coder-0.5b-instruct` (or `ngram+eagle`, `suffix+ngram+self`, ...): every step, each row
drafts with whichever source promises the most tokens per second, or not at all.

    free member f with a draft of L tokens this step: value E[tokens](alpha_f, k_f) / v(k_f), k_f <= L the best K for
        alpha_f at no drafting cost;
    the costly member m: value E[tokens](alpha_m, k_m) / (v(k_m) + k_m c_m), k_m its best K;
    no drafting: value 1.

alpha is each member's acceptance (accepted drafts in a row until the first rejection; two rates, the first
position's and each later one's, decayed as in `tuning.KTuner`: `tuning.Acceptance`). A lookup's chain is scored
against the tokens each step commits whether or not it was chosen (`matched`: the verification's own outcome at
temperature 0, an unbiased estimate when sampling), so a lookup that loses to the model keeps up-to-date rates;
the costly member learns from the steps it drafts. c_m is the costly member's seconds per drafted position timed on
its own steps (median of its last ones, so a busy second does not stick) over a one-token target pass, and v(k) a
(k + 1)-token target pass over a one-token one, both as the batch measures them (`tuning.KTuner.costs`).
Without `--auto-k` every row takes the first free member with a draft, else the costly member at the row's K. A
costly member that is off drafts one token on probe steps (16 steps after it went off, the gap doubling after a
rejected probe) so that a rising acceptance turns it back on. Within a tree step (a static shape or a budget) the
same choice is made and the chosen member grows its own tree. The copied branch beside a model branch in one tree is
a draft model's or EAGLE head's "lookup first" (`--draft-lookup`).

Exactness: the choice for a step is made before any of the step's draft tokens is drawn, from the members' free
drafts (a function of the committed context: deterministic drafters), the acceptance counts of steps already
verified, measured seconds and step counters; never from the step's own verification or random draws. Each row's
draft then carries the q of the member that drew it, so verification is the ordinary exact rule
(`tests/test_composite.py` runs the chi-square harness through the engine with the choice switching).

Members keep their own state: every member's `commit` sees every row's verified draft, except that a member reading
only tokens (a draft model, lookups) sees an empty draft for rows it did not draft (it fed none of their nodes to its
cache); heads and self-speculation read the target's pass and see the real one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from verispec.config import TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, Drafter, Traits
from verispec.core.sequence import Sequence
from verispec.errors import VerispecError
from verispec.tuning import Acceptance, CostProfile, _timed, next_probe_gap

PROBE_EVERY, PROBE_MAX = 16, 128  # steps between probes of a costly member that is off (as tuning.KTuner)
READ_TOKENS = 64  # tokens of the pass that times a costly member's catch-up reading
NONE = -1  # a row's choice: no drafting this step


def is_free(drafter: Drafter) -> bool:
    """Whether a drafter drafts at no measured cost: no model runner and no timed head (lookups)."""
    return drafter.runner is None and type(drafter).token_cost is Drafter.token_cost


class MemberRecord(Acceptance):
    """One member's acceptance (`tuning.Acceptance`, as the tuner's) and, for a costly member, its seconds per drafted
    position and probe state."""

    def __init__(self, prior: float = 0.6, weight: float = 4.0, decay: float = 0.95) -> None:
        super().__init__(prior, weight, decay)
        self.seconds: deque[float] = deque(maxlen=9)
        self.steps_off, self.probe_gap, self.probing = 0, PROBE_EVERY, False
        self.drafted = 0  # rows x steps this member's draft was chosen for (reporting)

    def observe(self, accepted: int, rejected: bool) -> None:
        """A step's drafts accepted in a row, and whether a rejection ended them (False: all accepted, or the
        count was cut short); a probe's outcome spaces the next."""
        super().observe(accepted, rejected)
        if self.probing:
            self.probing = False
            self.probe_gap = next_probe_gap(self.probe_gap, accepted, PROBE_EVERY, PROBE_MAX)

    def restart(self) -> None:
        """Decoding starts afresh: the member's average rate so far at the prior's weight, the probe clock's first gap
        (as `tuning.KTuner.restart`)."""
        super().restart()
        self.steps_off, self.probe_gap, self.probing = 0, PROBE_EVERY, False


def matched(draft: list[int], committed: list[int]) -> tuple[int, bool]:
    """How a deterministic chain would have fared against the tokens a step committed: its leading tokens equal to
    them, and whether a difference was seen. At temperature 0 that is the verification's own outcome; when sampling,
    a one-hot draft x is accepted with probability p(x), the chance that the target's token is x, so the counts are
    an unbiased estimate of acceptance (cut short where the committed tokens end)."""
    n = 0
    while n < len(draft) and n < len(committed) and draft[n] == committed[n]:
        n += 1
    return n, n < len(draft) and n < len(committed)


class CompositeDrafter(Drafter):
    """Free members first in the spec's order, at most one costly member (see the module docstring)."""

    name = "composite"

    def __init__(self, members: list[Drafter], names: list[str] | None = None, learn_costs: bool = True) -> None:
        """`names`: how each member is reported (its class's name by default); `learn_costs` False keeps the costly
        member's cost at what the batch's profile says (a test's fixed profile) instead of timing its steps."""
        if len(members) < 2:
            raise VerispecError("a composite drafter needs at least two drafters")
        costly = [m for m in members if not is_free(m)]
        if len(costly) > 1:
            raise VerispecError("a composite drafter takes one drafter with a cost of its own (a draft model, a head "
                                f"or self); got {len(costly)}")
        self.members = list(members)
        self.names = list(names) if names is not None else [m.name for m in members]
        self.free = [i for i, m in enumerate(members) if is_free(m)]
        self.costly = next((i for i, m in enumerate(members) if not is_free(m)), None)
        self.records = [MemberRecord() for _ in members]
        self.learn_costs = learn_costs
        self.costs: CostProfile | None = None  # the batch's measured costs this step (None: no --auto-k)
        self.draft_token: float | None = None  # the costly member's seconds per position, as first measured
        self.chosen: list[int] = []  # per row, the last propose's choice (a member index, or NONE)
        self.read_token: float | None = None  # seconds the costly member takes to read one token of a long catch-up
        self.free_drafts: dict[int, list[Draft]] = {}  # the last propose's drafts of each free member, per row
        self.name = "+".join(self.names)

    # --- what the batch reads -----------------------------------------------------------------------
    @property
    def runner(self):  # `--auto-k` times the costly member's own runner (tuning.measure_costs)
        return None if self.costly is None else self.members[self.costly].runner

    def token_cost(self) -> float | None:
        return None if self.costly is None else self.members[self.costly].token_cost()

    @property
    def traits(self) -> Traits:
        """Its members' together, read from them each time (a member's can depend on a setting made after it was
        built: an EAGLE head's argmax)."""
        members = [m.traits for m in self.members]
        limits = [t.input_vocab for t in members if t.input_vocab is not None]
        return Traits(trees=all(t.trees for t in members), chunked_prefill=all(t.chunked_prefill for t in members),
                      follows_prefixes=all(t.follows_prefixes for t in members),
                      restartable=all(t.restartable for t in members), input_vocab=min(limits) if limits else None)

    def cache_bytes(self, tokens: int) -> int:
        return sum(m.cache_bytes(tokens) for m in self.members)

    def size_drafts(self, costs: CostProfile | None) -> bool:
        self.costs = costs
        if costs is not None and self.draft_token is None:
            self.draft_token = costs.draft_token
            self.read_token = self._measure_reading() if self.learn_costs else 0.0
        return costs is not None

    def _measure_reading(self) -> float:
        """Seconds per token the costly member takes to catch up on READ_TOKENS tokens at once (timed as
        `tuning.measure_costs` times passes: a warm-up, then the median of 3), for members that read tokens into a
        cache of their own (a draft model); 0 for the others, and where the member's runner cannot be timed alone
        (self-speculation reads the target's cache)."""
        member = self.members[self.costly] if self.costly is not None else None
        runner = None if member is None else member.runner
        if runner is None or not member.traits.catches_up:
            return 0.0
        tokens = [[(i * 7919) % runner.vocab_size for i in range(READ_TOKENS)]]

        def read():
            runner.forward(runner.new_state(1), tokens, [1])

        try:
            read()  # warm-up
            return _timed(read, 3) / READ_TOKENS
        except Exception:  # the charge is an estimate: without it the member's reading is not charged
            return 0.0

    def _lag(self, b: int, seq: Sequence) -> int:
        """Tokens of row b the costly member has not read yet (0 for members that read the target's own pass)."""
        return self.members[self.costly].unread(b, seq)

    # --- rows ------------------------------------------------------------------------------------------
    def start(self, sequences: list[Sequence]) -> None:
        for m in self.members:
            m.start(sequences)

    def restart(self, prefill_chunk: int | None = None) -> None:
        super().restart(prefill_chunk)
        for m in self.members:
            m.restart(prefill_chunk)
        for record in self.records:  # new text: see `tuning.KTuner.restart`
            record.restart()

    def bind_target(self, state) -> None:
        for m in self.members:
            m.bind_target(state)

    def extend(self, sequences: list[Sequence]) -> None:
        for m in self.members:
            m.extend(sequences)

    def keep(self, rows: list[int]) -> None:
        for m in self.members:
            m.keep(rows)

    def retire_all(self) -> None:
        for m in self.members:
            m.retire_all()

    def reuse_prefixes(self, budget_bytes: int) -> None:
        for m in self.members:
            m.reuse_prefixes(budget_bytes)

    def prefix_limit(self, seq: Sequence) -> int | None:
        limits = [limit for limit in (m.prefix_limit(seq) for m in self.members) if limit is not None]
        return min(limits) if limits else None

    def flush_store(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all([m.flush_store(max(0.0, deadline - time.monotonic())) for m in self.members])

    # --- the choice ------------------------------------------------------------------------------------
    def _profile(self, member: int) -> CostProfile | None:
        """Costs for a member's step: the batch's pass costs with the member's own drafting cost (0 for a free one)."""
        if self.costs is None:
            return None
        draft = 0.0
        if member == self.costly:
            seconds = self.records[member].seconds
            draft = statistics.median(seconds) if seconds else (self.draft_token or 0.0)
        extra = self.members[member].traits.held_back if member == self.costly else 0
        return CostProfile(self.costs.target_pass, draft, float(extra))

    def _value(self, member: int, cap: int, catch_up: float = 0.0) -> tuple[float, int]:
        """(expected speedup over plain decoding, K) of drafting up to `cap` tokens with `member` this step;
        `catch_up`: the share of a one-token target pass this step is charged for the member's reading first."""
        profile = self._profile(member)
        if profile is None or cap <= 0:
            return (0.0, 0)
        record = self.records[member]
        k = min(record.best_k(profile), cap)
        if k == 0:
            return (1.0, 0)
        value = record.expected_tokens(k) / (profile.step_cost(k) + catch_up)
        return (value, k) if value > 1.0 else (1.0, 0)

    def _catch_up(self, b: int, seq: Sequence, k: int) -> float:
        """The costly member's reading of row b's unread tokens (the whole prompt, the first time), charged to each of
        the steps it may draft for the rest of the row's answer: a one-off read pays where the member is chosen for
        long, not for one step. In one-token target passes."""
        lag = self._lag(b, seq)
        if not lag or not self.read_token:
            return 0.0
        steps = max(1.0, (seq.max_new_tokens - seq.num_generated) / self.records[self.costly].expected_tokens(k))
        return lag * self.read_token / self.costs.target_pass[1] / steps

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        B = len(sequences)
        chosen, drafts = [NONE] * B, [EMPTY_DRAFT] * B
        self.free_drafts = {}
        for i in self.free:  # lookups cost nothing to ask: every row's best-valued free draft is its candidate
            self.free_drafts[i] = out = self.members[i].propose(sequences, depths, trees)
            for b, draft in enumerate(out):
                if len(draft) and (chosen[b] == NONE or self._value(i, len(draft)) > self._value(chosen[b], len(drafts[b]))):
                    chosen[b], drafts[b] = i, draft
        probe = self.costly is not None and self._probe_due()
        costly_k = [0] * B
        probed = False
        for b in range(B):
            if depths[b] <= 0:
                continue
            if self.costs is None:  # no measured costs: the costly member drafts wherever no lookup did
                costly_k[b] = depths[b] if chosen[b] == NONE and self.costly is not None else 0
                continue
            value, k = (1.0, 0) if self.costly is None else self._value(self.costly, depths[b])
            if k:  # and with its catch-up on the row's unread tokens
                value, k = self._value(self.costly, depths[b], self._catch_up(b, sequences[b], k))
            if k == 0 and probe and self._lag(b, sequences[b]) <= READ_TOKENS:
                value, k = 1.0, 1  # one token, so that a rising acceptance can turn the member back on (never at
                # the price of reading a long prompt)
                probed = True
            if chosen[b] != NONE:
                own, own_k = self._value(chosen[b], len(drafts[b]))
                if own_k and own >= value:
                    if trees is None and own_k < len(drafts[b]):
                        drafts[b] = Draft(drafts[b].tokens[:own_k])  # a deterministic chain, cut by count
                    continue
                if not k:
                    chosen[b], drafts[b] = NONE, EMPTY_DRAFT  # the lookup does not pay and nothing else drafts
                    continue
            costly_k[b] = k
        if any(costly_k):
            # not timed where it first reads a row's prompt or catches up at a probe after steps off: one-offs that,
            # charged to a step's few positions, kept it off for good. Its catch-up after a lookup's steps is timed:
            # rows that switch between members pay it again and again (measured with the SmolLM2 draft behind
            # suffix decoding: leaving it out made the model look cheaper than it is, 1.27x plain decoding against
            # suffix decoding's own 1.52x)
            steady = not probed and all(k == 0 or sequences[b].num_generated > 0 for b, k in enumerate(costly_k))
            start = time.perf_counter()
            out = self.members[self.costly].propose(sequences, costly_k, trees)
            if steady:
                self._timed(time.perf_counter() - start, max(costly_k))
            for b, k in enumerate(costly_k):
                if k:
                    chosen[b], drafts[b] = self.costly, out[b]
        for b, i in enumerate(chosen):
            if i != NONE:
                self.records[i].drafted += 1
        self.chosen = chosen
        return drafts

    def _probe_due(self) -> bool:
        """Count a step on the costly member's probe clock (only while it does not pay); True where a probe is due.
        A probe stays due until a step drafts with the member (see `MemberRecord.observe`)."""
        record = self.records[self.costly]
        if self.costs is None or self._value(self.costly, self.costs.k_max)[1] > 0:
            record.steps_off, record.probing = 0, False
            return False
        if not record.probing:
            record.steps_off += 1
            if record.steps_off >= record.probe_gap:
                record.steps_off, record.probing = 0, True
        return record.probing

    def _timed(self, seconds: float, positions: int) -> None:
        if self.learn_costs and positions > 0 and seconds > 0:
            self.records[self.costly].seconds.append(seconds / (positions + self.members[self.costly].traits.held_back))

    # --- after verification ------------------------------------------------------------------------------
    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        chosen = self.chosen if len(self.chosen) == len(drafts) else [NONE] * len(drafts)
        for b, (seq, draft, path) in enumerate(zip(sequences, drafts, paths)):
            if chosen[b] == self.costly and self.costly is not None and len(draft):
                self.records[self.costly].observe(len(path), len(path) < draft.tree.depth)
            committed = seq.tokens[len(seq.tokens) - len(path) - 1 :]  # this step's accepted tokens and the last one
            for i, out in self.free_drafts.items():  # each lookup's chain, drafted or not, against what was committed
                if b < len(out) and len(out[b]) and out[b].is_chain:
                    self.records[i].observe(*matched(out[b].tokens.tolist(), committed))
                elif i == chosen[b] and len(draft):  # a tree: its verified outcome
                    self.records[i].observe(len(path), len(path) < draft.tree.depth)
        for i, member in enumerate(self.members):
            if member.traits.chunked_prefill:  # reads tokens only: it fed nothing of another member's draft
                own = [d if c == i else EMPTY_DRAFT for d, c in zip(drafts, chosen)]
                member.commit(sequences, own, [p if c == i else () for p, c in zip(paths, chosen)])
            else:
                member.commit(sequences, drafts, paths)
        self.chosen, self.free_drafts = [], {}

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        for i in self.free:
            found = self.members[i].continuation(b, seq, after, depth)
            if found:
                return found
        return []

    def shares(self) -> dict[str, int]:
        """How many row steps each member drafted so far, by name."""
        return {name: record.drafted for name, record in zip(self.names, self.records)}
