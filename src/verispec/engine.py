"""The draft / verify / commit loop over a ragged batch of sequences.

One step, for every running sequence at once:
  1. the drafter proposes a draft (`tree.Draft`: up to K tokens deep, their q): a chain, or a tree of
     candidates where the sequence's spec has a `TreeConfig`; a chain is the tree of shape (1, ..., 1);
  2. the target reads [tokens not yet in its cache] + the draft's nodes in one pass (`Runner.forward` with
     the nodes' parents), giving p after the last pending token and after each node;
  3. `rejection.verify` (or `verify_greedy` at temperature 0) walks the draft to an accepted path and the
     recovered or bonus token, per sequence, with that sequence's own generator (a chain in one vectorized
     step, with the same draws);
  4. the target's and the drafter's `commit` keep the accepted path in their caches, tokens are committed
     (stopping exactly at EOS, a stop string or max_new_tokens), and a StepEvent is streamed per sequence.
Sequences advance by their own number of tokens; finished ones leave the batch. In a step where any sequence
drafts a tree, the other drafting sequences draft the tree of shape (1, ..., 1), their chain.

`DecodeBatch` (`verispec.batch`) is that step as an object: sequences join and leave between steps (the server's
continuous batching), a fault stays with the sequence it belongs to, and long prompts can be read in chunks;
`SpeculativeEngine.stream` runs one DecodeBatch until it is empty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from verispec.batch import DecodeBatch
from verispec.config import ConstraintLimits, SamplingConfig, SpecConfig
from verispec.constraints import Grammars, apply_constraint
from verispec.core.drafter import Draft, Drafter
from verispec.core.protocols import Runner
from verispec.core.sequence import Sequence, StepEvent
from verispec.detokenize import IncrementalText
from verispec.errors import VerispecError
from verispec.rejection import Verdict, verify, verify_greedy
from verispec.sampling import greedy_tokens, logits_to_probs, seen_masks, tree_seen_masks
from verispec.tuning import AdaptiveK


class SpeculativeEngine:
    """Runs exact speculative decoding of `target`, drafting with `drafter` (None: plain decoding).

    Args:
        target: the target model's runner.
        drafter: a Drafter, or None for plain target decoding (one token per target pass).
        eos_token_ids: tokens that end a sequence.
        decode: token ids -> text, used for stop strings.
        context_window: the longest sequence (prompt + new tokens) the models accept.
        grammars: makes the `verispec.constraints.Grammars` of the target's tokenizer, the first time a request
            asks for structured output (None: constraints are refused).
    """

    def __init__(
        self,
        target: Runner,
        drafter: Drafter | None,
        eos_token_ids: set[int],
        decode: Callable[[list[int]], str] | None = None,
        context_window: int | None = None,
        grammars: Callable[[], Grammars] | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.context_window = context_window or target.context_window
        self._make_grammars = grammars
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # the server compiles constraints on worker threads
        self.constraint_limits = ConstraintLimits()  # what a constraint may cost (a server sets its own)
        # Observers of every verification, called as observer(seq, draft, p, verdict, uniforms) with the
        # Draft, its Verdict, p (N + 1 rows of (V,): a (N + 1, V) tensor for a chain, rows made on demand for
        # a tree; one-hot at the argmax at temperature 0) and the N uniforms `verify` drew (None at
        # temperature 0). `tracer` is the slot of verispec.trace; `observers` holds the others (online
        # adaptation). With none set the loop stays bare. Observers only read: they never draw from seq.rng.
        self.tracer: Callable | None = None
        self.observers: list[Callable] = []
        # Where the target's logits are (a GPU for the static runner on CUDA): sampling and verification run there,
        # from per-sequence generators made there. Seeded draws on a GPU differ from the CPU's (another generator).
        self.device: torch.device = getattr(target, "device", torch.device("cpu"))

    def make_sequences(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig],
        spec: SpecConfig,
        seeds: list[int | None] | int | None,
    ) -> list[Sequence]:
        """Check prompts against the vocabulary and context window and make one Sequence per prompt.

        The target's vocabulary: an id outside it is refused (a VerispecError). An id inside it that the drafter's own
        model cannot read (a draft with a smaller vocabulary) is not: the batch keeps that row away from the drafter,
        and it decodes without drafts (`verispec.faults.DraftRows`), as does a row that later commits such an id.

        `sampling`: one config for all prompts or one per prompt; `seeds` as in `stream`.
        """
        if not prompts:
            raise VerispecError("no prompts given")
        if spec.tree is not None:
            self.check_tree_support()
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
            rng = torch.Generator(device=self.device)  # draws happen where the target's logits are
            rng.manual_seed(seed) if seed is not None else rng.seed()
            room = self.context_window - len(prompt)
            seq = Sequence(i, list(prompt), len(prompt), cfg, rng, min(spec.max_new_tokens, room), spec)
            if cfg.constraint is not None:
                seq.constraint = self.grammars().start(cfg.constraint)
            sequences.append(seq)
        return sequences

    def grammars(self) -> Grammars:
        """The constraint compiler for the target's tokenizer (made on first use: ~1 s for a large vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self._make_grammars is None:
                    raise VerispecError("structured output needs the target's tokenizer: this engine was built without one")
                self._grammars = self._make_grammars()
            self._grammars.limits = self.constraint_limits
            return self._grammars

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of key/value cache one sequence of `tokens` tokens holds, in the target and the drafter."""
        return self.target.cache_bytes(tokens) + (self.drafter.cache_bytes(tokens) if self.drafter is not None else 0)

    def check_tree_support(self) -> None:
        """Raise a VerispecError unless this engine's target and drafter can run tree speculation."""
        if self.drafter is None:
            raise VerispecError("tree speculation needs a drafter that builds trees (a draft model or 'ngram'); "
                                "this decoder decodes plainly")
        if not isinstance(self.target, Runner):
            raise VerispecError("tree speculation needs a target backend with tree passes "
                                "(`core.protocols.Runner`: forward with the nodes' parents, then commit)")
        if not self.drafter.supports_trees:
            raise VerispecError(f"the '{self.drafter.name}' drafter cannot draft trees here "
                                "(a chain-only drafter)")

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
        batch = DecodeBatch(self, tuner)
        batch.add(self.make_sequences(prompts, sampling, spec, seeds))
        while batch:
            results = batch.step()
            for _, seq in results:
                if seq.error is not None:  # a library call fails loudly (the server ends only that request)
                    raise VerispecError(f"sequence {seq.index} failed: {type(seq.error).__name__}: {seq.error}") \
                        from seq.error
            yield from results

    def generate(self, prompts: list[list[int]], sampling=SamplingConfig(), spec=SpecConfig(), seeds=None,
                 tuner: AdaptiveK | None = None) -> list[Sequence]:
        """Decode a batch to the end; returns the finished sequences in prompt order."""
        done: dict[int, Sequence] = {}
        for _, seq in self.stream(prompts, sampling, spec, seeds, tuner):
            if seq.finish_reason is not None:
                done[seq.index] = seq
        return [done[i] for i in sorted(done)]

    def _verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> Verdict:
        """logits: (N + 1, V) target logits at the root and after each node."""
        cfg = seq.sampling
        seen = None
        if cfg.repetition_penalty != 1.0:
            context = torch.tensor(seq.tokens, dtype=torch.long)
            seen = (seen_masks(context, draft.tokens, logits.shape[-1]) if draft.is_chain else
                    tree_seen_masks(context, draft.tokens, draft.tree.parents, logits.shape[-1]))  # (N + 1, V)
        if seq.constraint is not None:  # p restricted to what the constraint allows after each node's path
            allowed = seq.constraint.node_masks(draft.tokens.tolist(), draft.tree.parents.tolist())  # (N + 1, V)
            logits = apply_constraint(logits, allowed)  # (N + 1, V)
        watchers = self.observers if self.tracer is None else [self.tracer, *self.observers]
        if cfg.greedy:
            target_argmax = greedy_tokens(logits, cfg, seen)  # (N + 1,)
            verdict = verify_greedy(target_argmax, draft)
            if watchers:  # at temperature 0, p is one-hot at the target's argmax
                p = (torch.nn.functional.one_hot(target_argmax, logits.shape[-1]).float() if draft.is_chain else
                     _OneHotRows(target_argmax, logits.shape[-1]))  # (N + 1, V); a tree's made row by row
                for watch in watchers:
                    watch(seq, draft, p, verdict, None)
            return verdict
        # a chain's rows all at once; a tree's when the walk reaches them (it reads the root and its path only)
        p = logits_to_probs(logits, cfg, seen) if draft.is_chain else _ProbabilityRows(logits, cfg, seen)  # (N+1, V)
        if not watchers:
            return verify(p, draft, seq.rng)
        verdict, u = verify(p, draft, seq.rng, return_uniforms=True)
        for watch in watchers:
            watch(seq, draft, p, verdict, u)
        return verdict

    def _commit(self, seq: Sequence, accepted: tuple[int, ...], verdict: Verdict) -> StepEvent:
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


class _ProbabilityRows:
    """p = logits_to_probs(logits) row by row, on demand: a tree walk reads the root and its accepted
    path only, so the other rows (a top-p sort over the vocabulary each) are never made.

    logits: (N + 1, V); seen: (N + 1, V) or None. p[i] -> (V,).
    """

    def __init__(self, logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None) -> None:
        self.logits, self.config, self.seen = logits, config, seen

    def __getitem__(self, i: int) -> torch.Tensor:
        seen = None if self.seen is None else self.seen[i : i + 1]
        return logits_to_probs(self.logits[i : i + 1], self.config, seen)[0]


class _OneHotRows:
    """p at temperature 0 for a tracer, row by row: one-hot at the target's argmax (a tree's full
    (N + 1, V) one-hot matrix would be large). target_argmax: (N + 1,). p[i] -> (V,)."""

    def __init__(self, target_argmax: torch.Tensor, vocab: int) -> None:
        self.target_argmax, self.vocab = target_argmax, vocab

    def __getitem__(self, i: int) -> torch.Tensor:
        row = torch.zeros(self.vocab)  # (V,)
        row[int(self.target_argmax[i])] = 1.0
        return row
