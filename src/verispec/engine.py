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

Tree steps (a sequence's spec has a `TreeConfig`): the drafter proposes a tree of candidates, the
target reads the pending tokens and the whole tree in one pass (`ModelRunner.forward_tree`),
`rejection.verify_tree` (or `verify_tree_greedy`) walks it to an accepted path plus a recovered or
bonus token, and `commit_tree` keeps only that path in the caches. In a step where any sequence
drafts a tree, the other drafting sequences draft the tree of shape (1, ..., 1), their chain.

`DecodeBatch` is that step as an object: sequences join and leave between steps (the server's
continuous batching); `SpeculativeEngine.stream` runs one DecodeBatch until it is empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter
from verispec.drafters.stopping import DraftStop
from verispec.errors import VerispecError
from verispec.models.runner import ModelRunner
from verispec.rejection import TreeVerdict, Verdict, verify, verify_greedy, verify_tree, verify_tree_greedy
from verispec.sampling import greedy_tokens, logits_to_probs, seen_masks, tree_seen_masks
from verispec.sequence import Sequence
from verispec.tree import EMPTY_TREE_DRAFT, TreeDraft
from verispec.tuning import AdaptiveK


@dataclass(frozen=True)
class StepEvent:
    """What one step committed for one sequence.

    sequence: index in the caller's batch.
    accepted: draft tokens the target accepted (all committed unless the sequence ended inside them);
        for a tree, the tokens of the accepted path.
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
        # Observers of every verification, called as observer(seq, draft, p, verdict, uniforms) with
        # p: (n + 1, V) (one-hot at the argmax at temperature 0) and uniforms None at temperature 0.
        # `tracer` is the slot of verispec.trace; `observers` holds the others (online adaptation).
        # The tracer also sees tree steps, with a TreeDraft, a TreeVerdict, p whose rows p[i] are made
        # on demand ((V,) each, N + 1 of them) and the N uniforms of `verify_tree`, and so do the
        # `observers`. With none set the loop stays bare. Observers only read: they never draw from seq.rng.
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
            sequences.append(Sequence(i, list(prompt), len(prompt), cfg, rng, min(spec.max_new_tokens, room), spec))
        return sequences

    def check_tree_support(self) -> None:
        """Raise a VerispecError unless this engine's target and drafter can run tree speculation."""
        if self.drafter is None:
            raise VerispecError("tree speculation needs a drafter that builds trees (a draft model or 'ngram'); "
                                "this decoder decodes plainly")
        if not hasattr(self.target, "forward_tree"):
            raise VerispecError("tree speculation needs a target backend with tree passes (`forward_tree`)")
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
            yield from batch.step()

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
        watchers = self.observers if self.tracer is None else [self.tracer, *self.observers]
        if cfg.greedy:
            target_argmax = greedy_tokens(logits, cfg, seen)  # (n + 1,)
            verdict = verify_greedy(target_argmax, draft.tokens)
            if watchers:  # at temperature 0, p is one-hot at the target's argmax
                p = torch.nn.functional.one_hot(target_argmax, logits.shape[-1]).float()  # (n + 1, V)
                for watch in watchers:
                    watch(seq, draft, p, verdict, None)
            return verdict
        p = logits_to_probs(logits, cfg, seen)  # (n + 1, V)
        if not watchers:
            return verify(p, draft.tokens, draft.q, seq.rng)
        verdict, u = verify(p, draft.tokens, draft.q, seq.rng, return_uniforms=True)
        for watch in watchers:
            watch(seq, draft, p, verdict, u)
        return verdict

    def _verify_tree(self, seq: Sequence, draft: TreeDraft, logits: torch.Tensor) -> TreeVerdict:
        """logits: (N + 1, V) target logits at the root and after each node."""
        cfg = seq.sampling
        seen = None
        if cfg.repetition_penalty != 1.0:
            context = torch.tensor(seq.tokens, dtype=torch.long)
            seen = tree_seen_masks(context, draft.tokens, draft.tree.parents, logits.shape[-1])  # (N + 1, V)
        watchers = self.observers if self.tracer is None else [self.tracer, *self.observers]
        if cfg.greedy:
            target_argmax = greedy_tokens(logits, cfg, seen)  # (N + 1,)
            verdict = verify_tree_greedy(target_argmax, draft.tree, draft.tokens)
            for watch in watchers:  # at temperature 0, p is one-hot at the target's argmax
                watch(seq, draft, _OneHotRows(target_argmax, logits.shape[-1]), verdict, None)
            return verdict
        p = _ProbabilityRows(logits, cfg, seen)  # (N + 1, V), rows made when the walk reaches them
        if not watchers:
            return verify_tree(p, draft.tree, draft.tokens, draft.q, draft.siblings, seq.rng)
        verdict, u = verify_tree(p, draft.tree, draft.tokens, draft.q, draft.siblings, seq.rng, return_uniforms=True)
        for watch in watchers:
            watch(seq, draft, p, verdict, u)
        return verdict

    def _commit(self, seq: Sequence, accepted: tuple[int, ...], verdict: Verdict | TreeVerdict) -> StepEvent:
        """Append the accepted tokens and the recovered / bonus token, stopping at EOS, a stop string or the length."""
        spec = seq.spec
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


class DecodeBatch:
    """A running batch that sequences join (`add`) and leave (`cancel`, or by finishing) between steps.

    This is the step API under `SpeculativeEngine.stream` and the server's continuous batching.
    Row b of the target's KV state and of the drafter's state belongs to `sequences[b]`; a joining
    sequence gets empty rows and its prompt is read by the target in its first step, together with
    its first drafts. Each sequence keeps its own sampling settings, generator, spec (K, stop
    strings, max_new_tokens) and acceptance, so its tokens do not depend on the batch around it.
    The engine's drafter holds one batch's state: one DecodeBatch per engine is live at a time.

    Args:
        engine: supplies the target, the drafter and the stopping rules.
        tuner: if given, chooses K each step for every drafting sequence instead of `seq.spec`.
    """

    def __init__(self, engine: SpeculativeEngine, tuner: AdaptiveK | None = None) -> None:
        self.engine = engine
        self.tuner = tuner
        self.sequences: list[Sequence] = []
        self.state = None  # the target's KV state; None while the batch is empty
        self._joined: dict[int, float] = {}  # id(sequence) -> when it joined (perf_counter)

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequences: list[Sequence]) -> None:
        """Admit new sequences (from `engine.make_sequences`) at the end of the batch."""
        if not sequences:
            return
        if self.tuner is not None and any(s.spec.tree is not None and s.spec.tree.budget is None for s in sequences):
            raise VerispecError("auto-tuning sizes chains and dynamic trees (--tree-budget) from measured costs; "
                                "a static tree shape cannot be auto-tuned")
        drafter = self.engine.drafter
        if not self.sequences:
            self.state = self.engine.target.new_state(len(sequences))
            if drafter is not None:
                drafter.bind_target(self.state)
                drafter.start(sequences)
        else:
            self.state.extend(len(sequences))
            if drafter is not None:
                drafter.extend(sequences)
        now = time.perf_counter()
        self._joined.update((id(s), now) for s in sequences)
        self.sequences = self.sequences + list(sequences)

    def cancel(self, seq: Sequence) -> None:
        """Remove a running sequence now; its cache rows are freed and its finish_reason is "cancelled"."""
        row = next(b for b, s in enumerate(self.sequences) if s is seq)
        seq.finish_reason = "cancelled"
        self._drop([row])

    def step(self) -> list[tuple[StepEvent, Sequence]]:
        """Draft, verify and commit once for every sequence; finished ones leave the batch.

        Returns (event, sequence) for every sequence that was in the batch, in row order.
        """
        active, engine = self.sequences, self.engine
        if not active:
            return []
        if engine.drafter is not None and any(s.drafting and s.spec.tree is not None for s in active):
            return self._tree_step()
        # At most K drafts, and never more than the tokens left after this step's own token.
        k = None if self.tuner is None else self.tuner.k(getattr(engine.drafter, "stops_chains", False))
        budgets = [min(s.spec.num_draft_tokens if k is None else k, s.max_new_tokens - s.num_generated - 1)
                   if s.drafting else 0 for s in active]
        tuned_stop = None if self.tuner is None else self.tuner.draft_stop()  # thresholds from measured costs
        for s in active:
            s.draft_stop = tuned_stop or (DraftStop.fixed(s.spec.draft_stop) if s.spec.draft_stop > 0 else None)
        t0 = time.perf_counter()
        if engine.drafter is not None and any(budgets):
            drafts = engine.drafter.propose(active, budgets)
        else:
            drafts = [EMPTY_DRAFT] * len(active)
        t1 = time.perf_counter()
        inputs = [s.tokens[s.target_cached :] + d.tokens.tolist() for s, d in zip(active, drafts)]
        logits = engine.target.forward(self.state, inputs, [len(d) + 1 for d in drafts])  # (B, M, V)
        t2 = time.perf_counter()
        verdicts = [engine._verify(s, d, logits[b, : len(d) + 1]) for b, (s, d) in enumerate(zip(active, drafts))]
        engine.target.rollback(self.state, [len(d) - v.num_accepted for d, v in zip(drafts, verdicts)])
        events = []
        for s, d, v in zip(active, drafts, verdicts):
            s.target_cached = len(s.tokens) + v.num_accepted
            s.stats.record(len(d), v.num_accepted, v.bonus)
            if self.tuner is not None and len(d):
                self.tuner.observe(len(d), v.num_accepted)
            events.append(engine._commit(s, tuple(d.tokens[: v.num_accepted].tolist()), v))
        if engine.drafter is not None:
            engine.drafter.commit(active, drafts, [v.num_accepted for v in verdicts])
        return self._finish_step(events, t1 - t0, t2 - t1)

    def _tree_step(self) -> list[tuple[StepEvent, Sequence]]:
        """`step` when some sequence drafts a tree; the others draft their chain as a tree of shape (1, ..., 1)."""
        active, engine = self.sequences, self.engine
        trees = [s.spec.tree_or_chain for s in active]
        # The tree's depth, never more than the tokens left after this step's own token.
        depths = [min(t.depth(s.spec.num_draft_tokens), s.max_new_tokens - s.num_generated - 1) if s.drafting else 0
                  for s, t in zip(active, trees)]
        if self.tuner is not None:  # dynamic trees keep only the nodes that pay for their share of the pass
            profile = self.tuner.profile
            costs = profile.pass_costs()  # measured widths bound the tree: wider passes were never timed
            trees = [replace(t, budget=min(t.budget, len(costs) - 1), pass_costs=costs, draft_cost=d * profile.c)
                     if t.budget is not None else t for t, d in zip(trees, depths)]
        t0 = time.perf_counter()
        if any(depths):
            drafts = engine.drafter.propose_tree(active, trees, depths)
        else:
            drafts = [EMPTY_TREE_DRAFT] * len(active)
        t1 = time.perf_counter()
        chains = [s.tokens[s.target_cached :] for s in active]
        logits = engine.target.forward_tree(self.state, chains, [d.tokens.tolist() for d in drafts],
                                            [d.tree.parents.tolist() for d in drafts])  # (B, M, V)
        t2 = time.perf_counter()
        verdicts = [engine._verify_tree(s, d, logits[b, : len(d) + 1]) for b, (s, d) in enumerate(zip(active, drafts))]
        engine.target.commit_tree(self.state, [list(v.path) for v in verdicts])
        events = []
        for s, d, v in zip(active, drafts, verdicts):
            s.target_cached = len(s.tokens) + v.num_accepted
            s.stats.record(len(d), v.num_accepted, v.bonus, depth=d.tree.depth)
            events.append(engine._commit(s, d.path_tokens(v.path), v))
        engine.drafter.commit_tree(active, drafts, [v.path for v in verdicts])
        return self._finish_step(events, t1 - t0, t2 - t1)

    def _finish_step(self, events: list[StepEvent], draft_seconds: float, target_seconds: float) -> list[tuple[StepEvent, Sequence]]:
        """Account the step's time to every sequence, drop the finished ones, pair events with sequences."""
        active = self.sequences
        now = time.perf_counter()
        for s in active:
            s.stats.wall_seconds = now - self._joined[id(s)]
            s.stats.draft_seconds += draft_seconds
            s.stats.target_seconds += target_seconds
        self._drop([b for b, s in enumerate(active) if s.finish_reason is not None])
        return list(zip(events, active))

    def _drop(self, rows: list[int]) -> None:
        """Remove these rows from the batch, the target's cache and the drafter's state."""
        if not rows:
            return
        gone = set(rows)
        for b in gone:
            del self._joined[id(self.sequences[b])]
        keep = [b for b in range(len(self.sequences)) if b not in gone]
        self.sequences = [self.sequences[b] for b in keep]
        if not self.sequences:
            self.state = None  # frees the whole cache; the next add starts a fresh one
        else:
            self.state.select(torch.tensor(keep, dtype=torch.long))
        if self.engine.drafter is not None:
            self.engine.drafter.keep(keep)
