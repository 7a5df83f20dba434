"""Where a draft chain stops: dynamic draft length from calibrated draft confidence.

A step that drafts tokens x_1..x_n gains x_s only if x_1..x_s are all accepted, and pays for every
draft pass and for the width of the target pass. So a chain should stop where the probability that
all its drafts so far are accepted,
    P_s = a_1 * a_2 * ... * a_s,   a_i = P(x_i accepted | x_1..x_{i-1} accepted),
no longer pays for what the next token costs (SpecDec++, Huang et al. 2024; EAGLE-2 grows trees by
the same product). a_i is estimated from the draft's own confidence in x_i, calibrated online
(`AcceptanceCalibration`): a tiny draft's q is far from calibrated (measured on the distilled draft:
tokens drafted at q in [0.1, 0.2) were accepted 10% of the time, at q >= 0.9 82%), and a copied token
(lookup first) has q one-hot whatever its chance.

Exactness: where a chain stops depends only on the draft, the context and earlier steps' outcomes,
never on this step's verification, so every output token is still distributed as the target's p
(Leviathan et al. hold for any draft length chosen before verification). Only speed changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Model-drafted tokens are binned by the draft's probability of the token (q(x)) into this many
# equal bins; copied tokens by how long the match they were copied after is (the context's suffix
# against the earlier occurrence, see `prompt_lookup.lookup_match`), in bins that widen with length:
# a copy after a 20-token verbatim match (an answer quoting its article) is a different bet from one
# after a repeated bigram.
CONFIDENCE_BINS = 10
COPY_PRIOR = 0.35  # prior mean acceptance of a copied token (measured: 0.37 over 1,023 copies of the distilled draft)
COPY_BINS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # a match of length m falls in the bin of the largest edge <= m


@dataclass(frozen=True)
class DraftStop:
    """Per-position thresholds on P_s for one step's chain (position s = 1..K).

    keep[s - 1]: x_s is proposed only if P_s >= keep[s - 1] (its expected gain pays for widening the
        target pass by one token).
    go_on[s - 1]: x_{s + 1} is drafted only if P_s >= go_on[s - 1] (even a certain x_{s + 1} gains at
        most P_s, and costs a draft pass plus a wider target pass).
    Positions past the tuples' ends use their last entries.
    """

    keep: tuple[float, ...]
    go_on: tuple[float, ...]

    @classmethod
    def fixed(cls, threshold: float) -> DraftStop:
        """Stop where P_s falls below `threshold` (SpecConfig.draft_stop); that token is not proposed."""
        return cls((threshold,), (threshold,))

    @classmethod
    def from_costs(cls, c: float, pass_costs: tuple[float, ...]) -> DraftStop:
        """Thresholds from measured costs in target-pass units: c, one draft token; pass_costs[n], a target
        pass over n + 1 tokens (see `verispec.tuning.CostProfile`). Widening the pass from s to s + 1
        tokens costs dv_s = pass_costs[s] - pass_costs[s - 1]."""
        dv = tuple(max(b - a, 0.0) for a, b in zip(pass_costs, pass_costs[1:]))  # dv[s - 1]: adding x_s
        if not dv:
            return cls((0.0,), (c,))
        return cls(dv, tuple(c + dv[min(s, len(dv) - 1)] for s in range(1, len(dv) + 1)))

    def keep_at(self, s: int) -> float:
        return self.keep[min(s, len(self.keep)) - 1]

    def go_on_at(self, s: int) -> float:
        return self.go_on[min(s, len(self.go_on)) - 1]


@dataclass
class AcceptanceCalibration:
    """Running estimate of a_i by where a draft token came from: P(accepted | source, bin, greedy or not).

    Keys are ("model", bin of q(x)) or ("copy", bin of the match length), each with a Beta prior worth
    `prior_weight` observations at mean: the bin's centre for model tokens, COPY_PRIOR for copies.
    Greedy and sampled decoding keep separate counts (their acceptance rules differ). A key seen fewer
    than `min_observations` times is proposed whatever its estimate (`explore`): otherwise a key whose
    prior lies under the threshold would never be tested, and so never learned.
    """

    prior_weight: float = 4.0
    min_observations: int = 8
    counts: dict[tuple, list[float]] = field(default_factory=dict)  # key -> [accepted, observed]

    @staticmethod
    def model_key(confidence: float, greedy: bool) -> tuple:
        return ("model", min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1), greedy)

    @staticmethod
    def copy_key(match: int, greedy: bool) -> tuple:
        """The key of a token copied after a match `match` tokens long (its bin: the largest COPY_BINS edge <= match)."""
        return ("copy", max((edge for edge in COPY_BINS if edge <= match), default=COPY_BINS[0]), greedy)

    def _prior(self, key: tuple) -> float:
        return (key[1] + 0.5) / CONFIDENCE_BINS if key[0] == "model" else COPY_PRIOR

    def estimate(self, key: tuple) -> float:
        accepted, observed = self.counts.get(key, (0.0, 0.0))
        return (accepted + self.prior_weight * self._prior(key)) / (observed + self.prior_weight)

    def expected(self, q: torch.Tensor) -> float:
        """E_{x ~ q}[a(x)] for sampled model drafts: the chance that a token about to be drawn from q
        (V,) is accepted, before it is drawn."""
        table = torch.tensor([self.estimate(self.model_key((i + 0.5) / CONFIDENCE_BINS, False))
                              for i in range(CONFIDENCE_BINS)])  # (CONFIDENCE_BINS,)
        bins = (q * CONFIDENCE_BINS).long().clamp_(max=CONFIDENCE_BINS - 1)  # (V,)
        return float((q * table[bins]).sum())

    def proposes(self, p_all: float, threshold: float, key: tuple | None = None, q: torch.Tensor | None = None) -> bool:
        """Whether the next draft is proposed: P_s = p_all * a_s reaches the threshold, or its key is still
        being explored. A copied or greedy token is a function of the context, so a_s may be its own
        estimate (`key`); a sampled token's may not (proposing x only where q(x) is high would propose from
        another distribution than the q the verifier is given), so then a_s is the expected estimate under
        q (V,), read before the token is drawn, and exploration follows q's most likely token."""
        if key is None:
            key = self.model_key(float(q.max()), False)
            return p_all * self.expected(q) >= threshold or self.explore(key)
        return p_all * self.estimate(key) >= threshold or self.explore(key)

    def explore(self, key: tuple) -> bool:
        """Whether too few outcomes of this key were seen to trust its estimate below a threshold."""
        return self.counts.get(key, (0.0, 0.0))[1] < self.min_observations

    def observe(self, keys: list[tuple], num_accepted: int) -> None:
        """One step's chain: its first num_accepted tokens were accepted, the next (if any) rejected;
        tokens after a rejection were never tested and teach nothing."""
        for i, key in enumerate(keys[: num_accepted + 1]):
            counts = self.counts.setdefault(key, [0.0, 0.0])
            counts[0] += float(i < num_accepted)
            counts[1] += 1.0


def chain_length(keys: list[tuple], stop: DraftStop, calibration: AcceptanceCalibration) -> int:
    """How many tokens of a deterministic chain (a copied continuation, one calibration key per token) to
    propose under `stop`: each token is a function of the context, so the rule may read its own key."""
    p_all = 1.0
    for s, key in enumerate(keys, 1):
        if not calibration.proposes(p_all, stop.keep_at(s), key):
            return s - 1
        p_all *= calibration.estimate(key)
        if p_all < stop.go_on_at(s):
            return s
    return len(keys)
