"""The draft / verify / commit loop over a ragged batch of sequences.

One step, for every running sequence at once:
  1. the drafter proposes up to K draft tokens (and their q);
  2. the target scores [tokens not yet in its cache] + drafts in one forward pass, giving n+1 p's;
  3. `rejection.verify` (or `verify_greedy` at temperature 0) decides accepted tokens and the
     recovered or bonus token, per sequence, with that sequence's own generator;
  4. rejected drafts are rolled back out of the target's and the drafter's caches, tokens are
     committed (stopping exactly at EOS, a stop string or max_new_tokens), and a StepEvent is
     streamed per sequence.
Sequences advance by their own number of tokens; finished ones leave the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter
from verispec.errors import VerispecError
from verispec.models.runner import ModelRunner
from verispec.rejection import Verdict, verify, verify_greedy
from verispec.sampling import greedy_tokens, logits_to_probs, seen_masks
from verispec.sequence import Sequence
from verispec.tuning import AdaptiveK


@dataclass(frozen=True)
class StepEvent:
    """What one step committed for one sequence.

    sequence: index in the caller's batch.
    accepted: draft tokens the target accepted (all committed unless the sequence ended inside them).
    token: the recovered token (bonus=False) or the bonus token (bonus=True).
    committed: tokens appended to the output this step, after any EOS / stop / length cut.
    finish_reason: None while the sequence runs on; "eos", "stop" or "length" at its end.
    """

    sequence: int
    accepted: tuple[int, ...]
    token: int
    bonus: bool
    committed: tuple[int, ...]
    finish_reason: str | None


class SpeculativeEngine:
    """Runs exact speculative decoding of `target`, drafting with `drafter` (None: plain decoding).

    Args:
        target: the target model's runner.
        drafter: a Drafter, or None for plain target decoding (one token per target pass).
        eos_token_ids: tokens that end a sequence.
        decode: token ids -> text, used for stop strings.
        context_window: the longest sequence (prompt + new tokens) the models accept.
    """

    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        eos_token_ids: set[int],
        decode: Callable[[list[int]], str] | None = None,
        context_window: int | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.context_window = context_window or target.context_window
        # Optional observer of every verification (see verispec.trace); None keeps the loop bare.
        self.tracer: Callable | None = None

    def make_sequences(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig],
        spec: SpecConfig,
        seeds: list[int | None] | int | None,
    ) -> list[Sequence]:
        if not prompts:
            raise VerispecError("no prompts given")
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if seeds is None or isinstance(seeds, int):
            seeds = [None if seeds is None else seeds + i for i in range(len(prompts))]
        if len(samplings) != len(prompts) or len(seeds) != len(prompts):
            raise VerispecError("one sampling config and one seed per prompt are needed")
        sequences = []
        for i, (prompt, cfg, seed) in enumerate(zip(prompts, samplings, seeds)):
            if len(prompt) == 0:
                raise VerispecError(f"prompt {i} is empty: at least one token is needed")
            if len(prompt) >= self.context_window:
                raise VerispecError(
                    f"prompt {i} has {len(prompt)} tokens, but the context window is {self.context_window} tokens"
                )
            if any(t < 0 or t >= self.target.vocab_size for t in prompt):
                raise VerispecError(f"prompt {i} holds token ids outside the vocabulary (size {self.target.vocab_size})")
            rng = torch.Generator()
            rng.manual_seed(seed) if seed is not None else rng.seed()
            room = self.context_window - len(prompt)
            sequences.append(Sequence(i, list(prompt), len(prompt), cfg, rng, min(spec.max_new_tokens, room)))
        return sequences

    def stream(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seeds: list[int | None] | int | None = None,
        tuner: AdaptiveK | None = None,
    ) -> Iterator[tuple[StepEvent, Sequence]]:
        """Decode a batch, yielding (event, sequence) after every step for every running sequence.

        `seeds`: one per prompt, or an int s (prompt i gets s + i), or None (fresh entropy).
        `tuner`: chooses K each step from measured costs and acceptance (then `spec.num_draft_tokens`
        is unused); the output distribution does not depend on K.
        """
        sequences = self.make_sequences(prompts, sampling, spec, seeds)
        state = self.target.new_state(len(sequences))
        if self.drafter is not None:
            self.drafter.start(sequences)
        active = list(sequences)
        start = time.perf_counter()
        draft_seconds = target_seconds = 0.0
        while active:
            # At most K drafts, and never more than the tokens left after this step's own token.
            k = spec.num_draft_tokens if tuner is None else tuner.k()
            budgets = [min(k, s.max_new_tokens - s.num_generated - 1) for s in active]
            t0 = time.perf_counter()
            if self.drafter is not None and any(budgets):
                drafts = self.drafter.propose(active, budgets)
            else:
                drafts = [EMPTY_DRAFT] * len(active)
            t1 = time.perf_counter()
            inputs = [s.tokens[s.target_cached :] + d.tokens.tolist() for s, d in zip(active, drafts)]
            logits = self.target.forward(state, inputs, [len(d) + 1 for d in drafts])  # (B, M, V)
            t2 = time.perf_counter()
            verdicts = [self._verify(s, d, logits[b, : len(d) + 1]) for b, (s, d) in enumerate(zip(active, drafts))]
            self.target.rollback(state, [len(d) - v.num_accepted for d, v in zip(drafts, verdicts)])
            draft_seconds += t1 - t0
            target_seconds += t2 - t1
            events = []
            for s, d, v in zip(active, drafts, verdicts):
                s.target_cached = len(s.tokens) + v.num_accepted
                s.stats.record(len(d), v.num_accepted, v.bonus)
                if tuner is not None and len(d):
                    tuner.observe(len(d), v.num_accepted)
                events.append(self._commit(s, d, v, spec))
            if self.drafter is not None:
                self.drafter.commit(active, drafts, [v.num_accepted for v in verdicts])
            now = time.perf_counter()
            for s, event in zip(active, events):
                s.stats.wall_seconds, s.stats.draft_seconds, s.stats.target_seconds = now - start, draft_seconds, target_seconds
                yield event, s
            keep = [b for b, s in enumerate(active) if s.finish_reason is None]
            if len(keep) < len(active):
                active = [active[b] for b in keep]
                if active:
                    state.select(torch.tensor(keep, dtype=torch.long))
                    if self.drafter is not None:
                        self.drafter.keep(keep)

    def generate(self, prompts: list[list[int]], sampling=SamplingConfig(), spec=SpecConfig(), seeds=None,
                 tuner: AdaptiveK | None = None) -> list[Sequence]:
        """Decode a batch to the end; returns the finished sequences in prompt order."""
        done: dict[int, Sequence] = {}
        for _, seq in self.stream(prompts, sampling, spec, seeds, tuner):
            if seq.finish_reason is not None:
                done[seq.index] = seq
        return [done[i] for i in sorted(done)]

    def _verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> Verdict:
        """logits: (n + 1, V) target logits at the draft positions and the bonus position."""
        cfg = seq.sampling
        seen = None
        if cfg.repetition_penalty != 1.0:
            seen = seen_masks(torch.tensor(seq.tokens, dtype=torch.long), draft.tokens, logits.shape[-1])  # (n+1, V)
        if cfg.greedy:
            target_argmax = greedy_tokens(logits, cfg, seen)  # (n + 1,)
            verdict = verify_greedy(target_argmax, draft.tokens)
            if self.tracer is not None:  # at temperature 0, p is one-hot at the target's argmax
                self.tracer(seq, draft, torch.nn.functional.one_hot(target_argmax, logits.shape[-1]).float(), verdict, None)
            return verdict
        p = logits_to_probs(logits, cfg, seen)  # (n + 1, V)
        if self.tracer is None:
            return verify(p, draft.tokens, draft.q, seq.rng)
        verdict, u = verify(p, draft.tokens, draft.q, seq.rng, return_uniforms=True)
        self.tracer(seq, draft, p, verdict, u)
        return verdict

    def _commit(self, seq: Sequence, draft: Draft, verdict: Verdict, spec: SpecConfig) -> StepEvent:
        accepted = tuple(draft.tokens[: verdict.num_accepted].tolist())
        committed: list[int] = []
        for token in (*accepted, verdict.token):
            seq.tokens.append(token)
            committed.append(token)
            if spec.stop_at_eos and token in self.eos_token_ids:
                seq.finish_reason = "eos"
                break
            if seq.num_generated >= seq.max_new_tokens:
                seq.finish_reason = "length"
                break
        if spec.stop and self.decode is not None:
            committed = self._apply_stop_strings(seq, committed, spec.stop)
        seq.stats.new_tokens = seq.num_generated
        return StepEvent(seq.index, accepted, verdict.token, verdict.bonus, tuple(committed), seq.finish_reason)

    def _apply_stop_strings(self, seq: Sequence, committed: list[int], stops: tuple[str, ...]) -> list[int]:
        """End the sequence at the first stop string; keep the fewest tokens whose text contains it."""
        assert self.decode is not None
        text = self.decode(seq.generated)
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            return committed
        generated = seq.generated
        first = len(generated) - len(committed)
        for keep in range(max(first, 1), len(generated) + 1):
            prefix_text = self.decode(generated[:keep])
            found = [i for i in (prefix_text.find(s) for s in stops) if i >= 0]
            if found:
                del seq.tokens[seq.prompt_len + keep :]
                seq.finish_reason = "stop"
                seq.text_end = min(found)
                return committed[: keep - first]
        return committed
