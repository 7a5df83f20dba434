"""Medusa drafting: the heads read the target's final hidden state of the last verified position.

After a step, the target's verification pass has computed the hidden state h at the position whose
distribution gave the step's recovered or bonus token (the runner keeps its pass's final hidden states,
`features`, aligned with its logits): head k then guesses the token k + 1 places after that committed
token. The next step drafts from h with no target pass and no cache of its own: draft token x_k is drawn
from head k's distribution q_k (processed like p: temperature, top-k, top-p, repetition penalty over the
context and the drafts before it), and q_k is what verification divides by. q_k does not look at
x_1..x_(k-1); it is still the distribution x_k was drawn from given everything the step knew, which is all
Leviathan et al.'s rule needs, so the output is exactly the target's at any temperature (Medusa's own
"typical acceptance" is not). Trees: depth d's children come from head d, the same distribution under every
parent (`TreeGrowth`: top tokens, or samples with or without replacement, with their q).

A sequence drafts nothing until the target has read its prompt (there is no h before that).

Online adaptation (`--adapt`, `drafters.head_adapt`): the final states of the committed positions are logged
in windows, a copy of the heads trains on them, and the new heads draft from the next step on.
"""

from __future__ import annotations

import time

import torch

from verispec.config import AdaptConfig, TreeConfig
from verispec.core.drafter import EMPTY_DRAFT, Draft, RowStates, Traits
from verispec.core.protocols import FeatureRunner
from verispec.core.sequence import Sequence
from verispec.drafters.drawing import constrained_logits, draw_token, penalty_seen
from verispec.drafters.head_adapt import AdaptiveHead, HeadAdaptation, HeadTrainer, medusa_loss
from verispec.drafters.tree_growth import TreeGrowth
from verispec.errors import VerispecError
from verispec.models.heads.medusa import MedusaHeads


class MedusaDrafter(AdaptiveHead, RowStates):
    """Draft with Medusa heads on the target's own hidden states.

    Args:
        target: the target's runner (it keeps its passes' final hidden states once this drafter starts).
        heads: the heads, fitted to the target's hidden size and vocabulary (`models.heads.medusa.load_medusa`).
    """

    name = "medusa"
    # its rows are the target's, from its own passes; a reused prefix changes nothing: it reads the last position only
    traits = Traits(trees=True, adaptive=True, restartable=False, follows_prefixes=True)
    head_attribute = "heads"

    def __init__(self, target, heads: MedusaHeads) -> None:
        if not isinstance(target, FeatureRunner):
            raise VerispecError(f"Medusa heads read the target's hidden states; the '{type(target).__name__}' "
                                "runner does not give them (use --backend native or torch)")
        self.target, self.heads = target, heads
        self.vocab_size = target.vocab_size
        self.rows: list[torch.Tensor | None] = []  # per row: (E,) the last verified position's final state
        target.keep_features = True

    def new_row(self, seq: Sequence) -> None:
        return None  # no state until the target's first pass over its prompt

    def start(self, sequences: list[Sequence]) -> None:
        super().start(sequences)
        self._rows_started(len(sequences))

    def extend(self, sequences: list[Sequence]) -> None:
        super().extend(sequences)
        self._rows_started(len(sequences), add=True)

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self._rows_kept(rows)

    # --- online adaptation -----------------------------------------------------------------------
    def check_adaptable(self, config: AdaptConfig | None = None) -> None:
        """Start logging the target's final states for online adaptation (`drafters.head_adapt`)."""
        from verispec.models.heads.shipped import lm_head_rows

        config = config or AdaptConfig()

        def trainer() -> HeadTrainer:  # a tied head learns against the target's LM head rows, read once
            tied = self.heads.tied_rows
            rows = lm_head_rows(self.target, torch.arange(tied)) if tied else None
            return HeadTrainer(self.heads, medusa_loss(rows), lambda heads: heads, config)

        self.adaptation = HeadAdaptation(config, trainer)
        self.adaptation.rows(len(self.rows))

    @torch.inference_mode()
    def token_cost(self) -> float:
        """One drafted token: one head on one hidden state, its logits and q (median of 7)."""
        saved = self.rows
        self.rows = [torch.zeros(self.heads.hidden)]
        times = []
        for _ in range(8):
            start = time.perf_counter()
            torch.softmax(self._head_logits([1])[1][0], -1)
            times.append(time.perf_counter() - start)
        self.rows = saved
        return sorted(times[1:])[3]

    def _head_logits(self, caps: list[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """Per row, how many heads it drafts with (at most caps[b]; 0 before the target has read its prompt),
        and row -> (count, V) logits of those heads on its hidden state."""
        limits = [min(n, self.heads.num_heads) if self.rows[b] is not None else 0 for b, n in enumerate(caps)]
        rows, count = [b for b, n in enumerate(limits) if n], max(limits, default=0)
        if not rows:
            return limits, {}
        lm_head = (lambda x: self.target.head_logits(x, self.heads.tied_rows)) if self.heads.tied_rows else None
        with torch.inference_mode():
            out = self.heads(torch.stack([self.rows[b] for b in rows]), count, lm_head)  # (R, count, V)
        return limits, {b: out[i, :, : self.vocab_size] for i, b in enumerate(rows)}

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig] | None = None) -> list[Draft]:
        self._swap()
        if trees is not None:
            return self._propose_tree(sequences, trees, depths)
        limits, logits = self._head_logits(depths)
        drafts = []
        for b, seq in enumerate(sequences):
            if not limits[b]:
                drafts.append(EMPTY_DRAFT)
                continue
            tokens, q_rows = [], []
            for k in range(limits[b]):
                head_logits = constrained_logits(logits[b][k : k + 1], seq, tokens)  # (1, V)
                if head_logits is None:  # the constraint allows nothing this head can write: the chain ends
                    break
                token, q = draw_token(head_logits, seq, tokens)
                tokens.append(token)
                if q is not None:
                    q_rows.append(q)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(q_rows) if q_rows else None)
                          if tokens else EMPTY_DRAFT)
        return drafts

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        # the verification pass's logits for row b: after its pending tokens' last (index 0), then after node n
        # (index 1 + n); the recovered or bonus token came from the path's end
        self._take(sequences, [[0, *(1 + node for node in path)] for path in paths])

    def _take(self, sequences: list[Sequence], kept: list[list[int]]) -> None:
        """kept[b]: the indices in row b's features of the positions the step committed (the last one drafts next)."""
        features = self.target.features  # (B, M, E)
        if features is None:
            raise VerispecError("the target kept no hidden states for the Medusa heads")
        self.rows = [features[b, index[-1]].clone() for b, index in enumerate(kept)]
        if self.adaptation is not None:
            self.adaptation.log(sequences, [features[b, index] for b, index in enumerate(kept)])

    def _propose_tree(self, sequences: list[Sequence], trees: list[TreeConfig], depths: list[int]) -> list[Draft]:
        depths, logits = self._head_logits(depths)
        drafts = []
        for b, seq in enumerate(sequences):
            if not depths[b]:
                drafts.append(EMPTY_DRAFT)
                continue
            growth = TreeGrowth(trees[b], depths[b], seq.sampling, seq.rng, self.vocab_size, seq.constraint,
                                seq.tree_costs)
            growth.add_children(-1, logits[b][0], penalty_seen(seq, [], logits[b].shape[-1]))
            for depth in range(1, depths[b]):
                for node in growth.to_expand(depth):
                    growth.add_children(node, logits[b][depth], penalty_seen(seq, growth.path(node), logits[b].shape[-1]))
            drafts.append(growth.finish()[0])
        return drafts
