"""What a generation measured: passes, drafted / accepted / recovered / bonus tokens, time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Counters for one sequence (or, merged, for several).

    Terms: each step emits accepted draft tokens plus one recovered token (after a rejection)
    or one bonus token (when every draft was accepted).

    target_forward_passes: target passes this sequence took part in (the first also reads the prompt).
    draft_tokens: draft tokens proposed and verified (for trees: nodes).
    accepted_tokens: draft tokens the target accepted.
    accepted_per_position[i]: how often the draft token at position i (0-based) was accepted;
    drafted_per_position[i]: how often a draft token was proposed at position i. For trees, positions
    are depths: how often the accepted path reached depth i + 1, and how often the tree had that depth.
    mean_accepted_length: accepted draft tokens per target pass (tokens per target pass, less the
    recovered or bonus token each pass adds).
    new_tokens: tokens committed to the output.
    wall_seconds: time from the start of the batch to this sequence's end; draft_seconds and
    target_seconds split it (the rest is verification and bookkeeping).
    forced_tokens: accepted drafts that a structured-output constraint forced (drafted for free; also counted in
    draft_tokens / accepted_tokens).
    accepted_prediction_tokens / rejected_prediction_tokens: drafts taken from the request's predicted output
    (`core.prediction`) that the target accepted / did not (also counted in draft_tokens / accepted_tokens).
    cached_tokens: prompt tokens not read again, their cache taken from an earlier request's (`verispec.core.prefix`).
    """

    target_forward_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    new_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    forced_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    cached_tokens: int = 0

    def record(self, num_drafted: int, num_accepted: int, bonus: bool, depth: int | None = None) -> None:
        """One target pass: num_drafted draft tokens (tree nodes), num_accepted of them accepted.

        depth: for a tree, its depth (positions are depths; a chain's depth is num_drafted).
        """
        depth = num_drafted if depth is None else depth
        self.target_forward_passes += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.bonus_tokens += int(bonus)
        self.recovered_tokens += int(not bonus)
        for name, upto in (("drafted_per_position", depth), ("accepted_per_position", num_accepted)):
            counts = getattr(self, name)
            counts.extend([0] * (depth - len(counts)))
            for i in range(upto):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "target_forward_passes": self.target_forward_passes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "recovered_tokens": self.recovered_tokens,
            "bonus_tokens": self.bonus_tokens,
            "new_tokens": self.new_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "wall_seconds": round(self.wall_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "forced_tokens": self.forced_tokens,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "cached_tokens": self.cached_tokens,
        }

    @classmethod
    def merge(cls, many: list[GenerationStats]) -> GenerationStats:
        """Sum counters; wall time is the longest (sequences of a batch run side by side)."""
        out = cls()
        for s in many:
            for name in ("target_forward_passes", "draft_tokens", "accepted_tokens", "recovered_tokens",
                         "bonus_tokens", "new_tokens", "forced_tokens", "accepted_prediction_tokens",
                         "rejected_prediction_tokens", "cached_tokens"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            for name in ("accepted_per_position", "drafted_per_position"):
                mine, theirs = getattr(out, name), getattr(s, name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            out.wall_seconds = max(out.wall_seconds, s.wall_seconds)
            out.draft_seconds = max(out.draft_seconds, s.draft_seconds)
            out.target_seconds = max(out.target_seconds, s.target_seconds)
        return out
