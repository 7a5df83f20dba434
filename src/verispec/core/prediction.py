"""Predicted outputs: a sequence's draft follows text the client expects the answer to repeat (OpenAI's `prediction`,
typically the file being edited), realigning after the answer departs from it, as prompt lookup does over a prompt.

A prediction's draft is a deterministic chain (q one-hot), so verifying it is exact whatever it holds: the answer is
the target's, only the number of passes changes. `PredictionFollower` keeps, per sequence, where in the prediction
the answer stands (`at`: the index of the predicted token expected next, None once the answer has departed from it)
and how long a chain it drafts next (`depth`: back to 2 after a rejection, doubled after each chain accepted whole,
up to the spec's `prediction_depth`, so a prediction that no longer fits costs narrow passes, not wide ones).

Realigning: once the answer has departed, the last `MATCH` tokens it committed are looked up in the prediction (an
index of its `MATCH`-grams, made once); the first occurrence at or after where the answer last stood wins (an edit
inserts or replaces some lines, then the rest of the file follows), else the first anywhere.
"""

from __future__ import annotations

from bisect import bisect_left

MATCH = 3  # tokens of the answer's end that realign it with the prediction
MIN_DEPTH = 2  # a chain's length after a rejection


class PredictionFollower:
    """Where one answer stands in its prediction, and the chain it drafts next.

    Args:
        tokens: the prediction's token ids (non-empty).
        max_depth: the longest chain one step drafts from it (>= 1).
    """

    def __init__(self, tokens: list[int], max_depth: int) -> None:
        self.tokens = list(tokens)
        self.max_depth = max(1, int(max_depth))
        self.depth = self.max_depth
        self.at: int | None = 0  # the answer starts where the prediction does
        self.last = 0  # where the answer last stood in the prediction (realigning prefers what follows it)
        self._index: dict[tuple[int, ...], list[int]] | None = None

    def draft(self, generated: list[int], depth: int) -> list[int]:
        """The predicted tokens to draft after `generated` (the answer so far), at most `depth` (and this follower's
        own depth) long; [] where the answer stands nowhere in the prediction."""
        if self.at is None:
            self.at = self._realign(generated)
            self.last = self.last if self.at is None else self.at
        if self.at is None:
            return []
        return self.tokens[self.at : self.at + min(depth, self.depth)]

    def observe(self, drafted: int, accepted: int, committed: list[int]) -> None:
        """After a step: `drafted` predicted tokens were verified (0 where the step's draft was not the prediction's),
        `accepted` of them accepted; `committed` the tokens the step added to the answer."""
        if drafted:
            self.depth = min(self.max_depth, 2 * self.depth) if accepted == drafted else MIN_DEPTH
        for token in committed:
            if self.at is None:
                break
            if self.at < len(self.tokens) and self.tokens[self.at] == token:
                self.at += 1
                self.last = self.at
            else:
                self.at = None  # departed: realigned from the answer's end when a draft is next asked for

    def _realign(self, generated: list[int]) -> int | None:
        """The index after the prediction's occurrence of the answer's last MATCH tokens (see the module doc)."""
        if len(generated) < MATCH or len(self.tokens) <= MATCH:
            return None
        if self._index is None:
            index: dict[tuple[int, ...], list[int]] = {}
            for i in range(len(self.tokens) - MATCH + 1):
                index.setdefault(tuple(self.tokens[i : i + MATCH]), []).append(i)
            self._index = index
        found = self._index.get(tuple(generated[-MATCH:]))
        if not found:
            return None
        after = bisect_left(found, self.last - MATCH)
        start = found[after] if after < len(found) else found[0]
        return start + MATCH if start + MATCH < len(self.tokens) else None
