"""Verify and commit: what one step does with a batch's drafts once the target's pass has scored them.

`StepRules` holds what a step needs besides the models: the tokens that end a sequence, the detokenizer for stop
strings, and the observers of every verification (the tracer, online adaptation). `verispec.engine` runs the step
(draft, one target pass, `verify_rows` / `verify_one`, the target's commit, `commit`) on a `verispec.batch.DecodeBatch`,
which knows the engine only as `StepParts`.

Verification of a batch (`verify_rows`): the rows that decode greedily with a chain draft and nothing between the
logits and the argmax (no repetition penalty, no constraint, no observer) are verified together, from one argmax over
the whole pass and one read of the device for every such row; every other row goes through `verify_one`, the rule of
`verispec.rejection` with the row's own generator. Both give the verdict `rejection.verify_greedy` gives the row
alone (tests/test_step.py checks them against each other), and a row whose logits cannot be read (NaN, +inf) is left
to `verify_one`, which fails that row alone.

A sampled row's p is made row by row as the walk reads it (the root, then each accepted node: k + 1 rows of N + 1 when
the k-th draft is rejected), not for the whole pass at once: on a CPU a softmax over the vocabulary streams memory, and
stacking the rows of several sequences into one call was slower than one sequence at a time (their rows fall out of
the cache between the passes of the processing), so the saving is in the rows never made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from verispec.constraints import apply_constraint
from verispec.core.drafter import Draft, Drafter
from verispec.core.protocols import Runner
from verispec.core.sequence import Sequence, StepEvent, StepReport, TokenLogprob
from verispec.detokenize import IncrementalText
from verispec.rejection import Verdict, verify, verify_greedy
from verispec.sampling import Processors

if TYPE_CHECKING:
    from verispec.core.prefix import PrefixStore


class StepRules:
    """How a step verifies a row's draft and commits its tokens.

    Args:
        eos_token_ids: tokens that end a sequence.
        decode: token ids -> text, used for stop strings (None: stop strings are not scanned).
    """

    def __init__(self, eos_token_ids: set[int], decode: Callable[[list[int]], str] | None = None) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        # Observers of every verification, called as observer(seq, draft, p, verdict, uniforms) with the
        # Draft, its Verdict, p (N + 1 rows of (V,): a (N + 1, V) tensor for a chain, rows made on demand for
        # a tree; one-hot at the argmax at temperature 0) and the N uniforms `verify` drew (None at
        # temperature 0). `tracer` is the slot of verispec.trace; `observers` holds the others (online
        # adaptation). With none set the step stays bare. Observers only read: they never draw from seq.rng.
        self.tracer: Callable | None = None
        self.observers: list[Callable] = []

    def _watchers(self) -> list[Callable]:
        return self.observers if self.tracer is None else [self.tracer, *self.observers]

    # --- verification ------------------------------------------------------------------------------
    def batched(self, seq: Sequence, draft: Draft) -> bool:
        """Whether this row's verdict comes from the batch's one argmax: greedy, a chain, nothing processing its
        logits, no observer."""
        chain = seq.processors
        return (chain.greedy and draft.is_chain and not chain.penalised and seq.constraint is None
                and self.tracer is None and not self.observers)

    def verify_rows(self, rows: list[int], sequences: list[Sequence], drafts: list[Draft],
                    logits: torch.Tensor) -> dict[int, Verdict]:
        """The verdicts of the batched rows among `rows` (`batched`), from one argmax over the pass.

        logits: (B, M, V) the target's pass, row b's logits at [b, : len(drafts[b]) + 1]. Rows left out of the answer
        (not batched, or with logits no argmax can be taken of) are verified by `verify_one`."""
        if not rows or not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            return {}
        width = max(len(drafts[b]) for b in rows) + 1
        chosen = logits[:, :width]  # (B, W, V) a view: every row of the pass is read once, no copy
        if len(rows) < logits.shape[0]:
            chosen = chosen[torch.tensor(rows, dtype=torch.long, device=logits.device)]  # (R, W, V)
        top, best = chosen.float().max(dim=-1)  # (R, W) each: the largest logit and its first id, in one sweep
        best_of = torch.where(torch.isfinite(top), best, -1).tolist()  # the one read of the device; -1: NaN or inf
        verdicts = {}
        for r, b in enumerate(rows):
            n = len(drafts[b])
            if min(best_of[r][: n + 1]) < 0:  # NaN or +inf: `verify_one` refuses it for this row alone
                continue
            tokens = drafts[b].tokens.tolist()
            accepted = next((i for i in range(n) if tokens[i] != best_of[r][i]), n)
            verdicts[b] = Verdict(tuple(range(accepted)), best_of[r][accepted], bonus=accepted == n)
        return verdicts

    def verify_one(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> Verdict:
        """One row's verdict. logits: (N + 1, V) target logits at the root and after each node."""
        chain = seq.processors
        seen = chain.seen_rows(seq.tokens, draft.tokens, None if draft.is_chain else draft.tree.parents,
                               logits.shape[-1])  # (N + 1, V) or None
        if seq.constraint is not None:  # p restricted to what the constraint allows after each node's path
            allowed = seq.constraint.node_masks(draft.tokens.tolist(), draft.tree.parents.tolist())  # (N + 1, V)
            logits = apply_constraint(logits, allowed)  # (N + 1, V)
        watchers = self._watchers()
        if chain.greedy:
            target_argmax = chain.target(logits, seen)  # (N + 1,)
            verdict = verify_greedy(target_argmax, draft)
            if watchers:  # at temperature 0, p is one-hot at the target's argmax
                p = (torch.nn.functional.one_hot(target_argmax, logits.shape[-1]).float() if draft.is_chain else
                     _OneHotRows(target_argmax, logits.shape[-1]))  # (N + 1, V); a tree's made row by row
                for watch in watchers:
                    watch(seq, draft, p, verdict, None)
            return verdict
        # p's rows when the walk reaches them: it reads the root and the accepted path's rows only, so a chain whose
        # k-th draft is rejected makes k + 1 of its N + 1 rows (each row's bits are the same made alone or with the
        # others: `sampling.row_sums`). Observers read the whole of a chain's p, made at once.
        if not watchers:
            return verify(_ProbabilityRows(logits, chain, seen), draft, seq.rng)
        p = chain.target(logits, seen) if draft.is_chain else _ProbabilityRows(logits, chain, seen)  # (N + 1, V)
        verdict, u = verify(p, draft, seq.rng, return_uniforms=True)
        for watch in watchers:
            watch(seq, draft, p, verdict, u)
        return verdict

    # --- log-probabilities ---------------------------------------------------------------------------
    def logprobs(self, seq: Sequence, draft: Draft, verdict: Verdict, logits: torch.Tensor) -> list[TokenLogprob]:
        """The target's log-probabilities of the tokens this step may commit for the row (the accepted path's tokens,
        then the recovered or bonus token), each with its `seq.spec.logprobs` likeliest tokens; before `commit` (a
        constraint's masks are those of this step). logits: (N + 1, V) at the root and after each node.

        Each row is read alone ((1, V) at a time): a token's numbers are those plain decoding reports for it, bit for
        bit where the runner's logits are (the native runner's are in any pass)."""
        spec, chain = seq.spec, seq.processors
        rows = [0, *(slot + 1 for slot in verdict.path)]  # the logits row before each token: the root, then its parent
        tokens = [*draft.path_tokens(verdict.path), verdict.token]
        processed = spec.logprobs_mode == "processed"
        seen = allowed = None
        if processed:
            seen = chain.seen_rows(seq.tokens, draft.tokens, None if draft.is_chain else draft.tree.parents,
                                   logits.shape[-1])  # (N + 1, V) or None
            if seq.constraint is not None:
                allowed = seq.constraint.node_masks(draft.tokens.tolist(), draft.tree.parents.tolist())  # (N + 1, V)
        out = []
        for row, token in zip(rows, tokens):
            x = logits[row : row + 1].float()  # (1, V)
            if not processed:
                logp = raw_logprobs(x)  # (V,)
            else:
                if allowed is not None:
                    x = apply_constraint(x, allowed[row : row + 1])
                if chain.greedy:
                    logp = torch.full((x.shape[-1],), float("-inf"))  # (V,) one-hot at the draw
                    logp[int(chain.target(x, None if seen is None else seen[row : row + 1])[0])] = 0.0
                else:
                    logp = torch.log(chain.target(x, None if seen is None else seen[row : row + 1])[0])  # (V,)
            out.append(token_logprob(logp, token, spec.logprobs))
        return out

    # --- commit --------------------------------------------------------------------------------------
    def commit(self, seq: Sequence, accepted: tuple[int, ...], verdict: Verdict) -> StepEvent:
        """Append the accepted tokens and the recovered / bonus token, stopping at EOS, a stop string or the length."""
        spec = seq.spec
        scan = bool(spec.stop) and self.decode is not None
        committed: list[int] = []
        for token in (*accepted, verdict.token):
            seq.tokens.append(token)
            committed.append(token)
            if seq.constraint is not None:
                seq.constraint.advance((token,))
            if scan and self._hit_stop_string(seq):
                break
            if spec.stop_at_eos and token in self.eos_token_ids:
                seq.finish_reason = "eos"
                break
            if seq.constraint is not None and seq.constraint.finished:
                # complete: only the end-of-sequence token is allowed, so the constrained p is one-hot there and
                # plain decoding would draw it next; it is committed now, without a pass
                end = seq.constraint.end_token()
                if end is not None and seq.num_generated < seq.max_new_tokens:
                    seq.tokens.append(end)
                    committed.append(end)  # (the matcher, stopped, takes nothing more)
                seq.finish_reason = "eos" if end in self.eos_token_ids and committed[-1] == end else "stop"
                break
            if seq.num_generated >= seq.max_new_tokens:
                seq.finish_reason = "length"
                break
        seq.stats.new_tokens = seq.num_generated
        return StepEvent(seq.index, accepted, verdict.token, verdict.bonus, tuple(committed), seq.finish_reason)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """After one more token: does the text now hold a stop string? Then the sequence ends there, its text cut
        before the first one (`text_end`). Only the text the token added is scanned (with the longest stop string's
        length less one before it, where a match may have begun), and it is decoded incrementally, so a step costs
        the same however long the answer (`verispec.detokenize`)."""
        assert self.decode is not None
        if seq.text is None:
            seq.text = IncrementalText(self.decode)
        text = seq.text
        before = len(text.text)
        if not text.update(seq.generated):
            return False
        stops = seq.spec.stop
        start = max(0, before - max(len(s) for s in stops) + 1)
        found = [i for i in (text.text.find(s, start) for s in stops) if i >= 0]
        if not found:
            return False
        seq.finish_reason, seq.text_end = "stop", min(found)
        return True


def count_step(report: StepReport) -> None:
    """A step's observer (`DecodeBatch.observers`, always there): each verified row's counters (`GenerationStats`)."""
    for row in report.rows:
        stats = row.seq.stats
        stats.record(row.drafted, row.accepted, row.bonus, depth=row.depth)
        if row.source == "forced":
            stats.forced_tokens += min(row.accepted, row.forced)
        elif row.source == "predicted":
            stats.accepted_prediction_tokens += row.accepted
            stats.rejected_prediction_tokens += row.drafted - row.accepted


def raw_logprobs(x: torch.Tensor) -> torch.Tensor:
    """The target's raw log-probabilities at one place: (1, V) float32 logits -> (V,) log-softmax. Every reported
    raw log-probability (generated tokens, the prompt's) comes from here, one row at a time, so the numbers are the
    same whatever pass the row came from (bit for bit where the runner's logits are)."""
    return torch.log_softmax(x, dim=-1)[0]


def token_logprob(logp: torch.Tensor, token: int, top: int | None) -> TokenLogprob:
    """A token's entry from the (V,) log-probabilities at its place, with the `top` likeliest (None or 0: none)."""
    likeliest = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.shape[0]))  # ties: torch's order
        likeliest = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), likeliest)


class StepParts(Protocol):
    """What a batch needs of the engine that drives it (`verispec.engine.SpeculativeEngine`)."""

    target: Runner
    drafter: Drafter
    context_window: int
    prefixes: PrefixStore | None


class _ProbabilityRows:
    """p = the chain's target rows, row by row, on demand: the walk reads the root and its accepted path only,
    so the other rows (a softmax over the vocabulary each, a top-p sort) are never made.

    logits: (N + 1, V); seen: (N + 1, V) or None. p[i] -> (V,).
    """

    def __init__(self, logits: torch.Tensor, chain: Processors, seen: torch.Tensor | None) -> None:
        self.logits, self.chain, self.seen = logits, chain, seen
        self.device = logits.device

    def __getitem__(self, i: int) -> torch.Tensor:
        seen = None if self.seen is None else self.seen[i : i + 1]
        return self.chain.target(self.logits[i : i + 1], seen)[0]


class _OneHotRows:
    """p at temperature 0 for a tracer, row by row: one-hot at the target's argmax (a tree's full
    (N + 1, V) one-hot matrix would be large). target_argmax: (N + 1,). p[i] -> (V,)."""

    def __init__(self, target_argmax: torch.Tensor, vocab: int) -> None:
        self.target_argmax, self.vocab = target_argmax, vocab

    def __getitem__(self, i: int) -> torch.Tensor:
        row = torch.zeros(self.vocab)  # (V,)
        row[int(self.target_argmax[i])] = 1.0
        return row
