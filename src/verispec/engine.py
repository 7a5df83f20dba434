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
     (stopping exactly at EOS, a stop string or max_new_tokens), and a StepEvent is streamed per sequence;
  5. the step's observers read what it did (`core.sequence.StepReport`: its costs, each row's outcome): the rows'
     counters and the auto-tuner. (The observers of each row's verification, which read p, are `StepRules`'.)
Sequences advance by their own number of tokens; finished ones leave the batch. In a step where any sequence
drafts a tree, the other drafting sequences draft the tree of shape (1, ..., 1), their chain.

`SpeculativeEngine.step` is that step, on one screen, over a `DecodeBatch` (`verispec.batch`: the rows, which join
and leave between steps, the prompts read in chunks, and the guards that keep a fault with its row); `verispec.plan`
says what each row drafts, `verispec.step` holds the rules a row is verified and committed by (`StepRules`).
`SpeculativeEngine.run` is the one loop around it, driven by every front end: `stream` (the CLI, the API, the bench,
the live view) runs a fixed batch until it is empty; the server's scheduler admits and reaps rows between steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from verispec.batch import DecodeBatch, TargetFault
from verispec.config import ConstraintLimits, SamplingConfig, SpecConfig, TreeConfig, check_tree_request
from verispec.constraints import Grammars
from verispec.core.drafter import PLAIN, Draft, Drafter
from verispec.core.prediction import PredictionFollower
from verispec.core.protocols import PrefixState, Runner
from verispec.core.sequence import RowOutcome, Sequence, StepClock, StepEvent, StepReport, TokenLogprob
from verispec.errors import VerispecError, is_fault
from verispec.plan import StepPlan, draft, plan_step
from verispec.core.prefix import PrefixStore
from verispec.rejection import Verdict
from verispec.step import StepRules, raw_logprobs, token_logprob
from verispec.tuning import KTuner

PROMPT_CHUNK = 256  # prompt tokens a pass reads when their log-probabilities are asked for: (256, V) logits at once


class SpeculativeEngine:
    """Runs exact speculative decoding of `target`, drafting with `drafter`.

    Args:
        target: the target model's runner.
        drafter: a Drafter; `core.drafter.PLAIN` (or None, taken as PLAIN) decodes plainly, one token per target
            pass.
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
        self.drafter: Drafter = PLAIN if drafter is None else drafter
        self.rules = StepRules(eos_token_ids, decode)
        self.context_window = context_window or target.context_window
        self._make_grammars = grammars
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # the server compiles constraints on worker threads
        self.constraint_limits = ConstraintLimits()  # what a constraint may cost (a server sets its own)
        # earlier rows' caches by their tokens, for rows whose prompts begin the same (`verispec.core.prefix`; None: off)
        self.prefixes: PrefixStore | None = None
        # Where the target's logits are (a GPU for the static runner on CUDA): sampling and verification run there,
        # from per-sequence generators made there. Seeded draws on a GPU differ from the CPU's (another generator).
        self.device: torch.device = target.device

    @property
    def eos_token_ids(self) -> set[int]:
        return self.rules.eos_token_ids

    @property
    def decode(self) -> Callable[[list[int]], str] | None:
        return self.rules.decode

    @property
    def tracer(self) -> Callable | None:
        """The observer of every verification that `verispec.trace` sets (see `StepRules`)."""
        return self.rules.tracer

    @tracer.setter
    def tracer(self, tracer: Callable | None) -> None:
        self.rules.tracer = tracer

    @property
    def observers(self) -> list[Callable]:
        """The other observers of every verification (online adaptation; see `StepRules`)."""
        return self.rules.observers

    def make_sequences(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig],
        spec: SpecConfig,
        seeds: list[int | None] | int | None,
        drafting: bool = True,
        tuned: bool = True,
        scope: str | None = None,
        predictions: list[list[int] | None] | None = None,
    ) -> list[Sequence]:
        """Check prompts against the vocabulary and context window and make one Sequence per prompt.

        The target's vocabulary: an id outside it is refused (a VerispecError). An id inside it that the drafter's own
        model cannot read (a draft with a smaller vocabulary) is not: the batch keeps that row away from the drafter,
        and it decodes without drafts (`verispec.faults.DraftRows`), as does a row that later commits such an id.

        `sampling`: one config for all prompts or one per prompt; `seeds` as in `stream`. `drafting` False: these
        sequences decode plainly (a request that asks for no drafts); `tuned` False: a batch's auto-tuner leaves their
        K as `spec` says (a request that names K or a tree); `scope`: whose shared drafter state they read
        (`Sequence.scope`); `predictions`: per prompt, the token ids of the output its request predicts (None or
        empty: none), which drafts while the answer follows it (`core.prediction`). A sequence is not changed after
        it is made: these are its request's whole policy.
        """
        if not prompts:
            raise VerispecError("no prompts given")
        if spec.tree is not None:
            self.check_tree_request(spec.tree, drafting)
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if seeds is None or isinstance(seeds, int):
            seeds = [None if seeds is None else seeds + i for i in range(len(prompts))]
        predictions = [None] * len(prompts) if predictions is None else predictions
        if len(samplings) != len(prompts) or len(seeds) != len(prompts) or len(predictions) != len(prompts):
            raise VerispecError("one sampling config, one seed and one prediction (or None) per prompt are needed")
        for i, predicted in enumerate(predictions):
            if predicted and any(t < 0 or t >= self.target.vocab_size for t in predicted):
                raise VerispecError(f"the prediction of prompt {i} holds token ids outside the vocabulary "
                                    f"(size {self.target.vocab_size})")
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
            seq = Sequence(i, list(prompt), len(prompt), cfg, rng, min(spec.max_new_tokens, room), spec,
                           drafting=drafting, tuned=tuned, scope=scope)
            if cfg.constraint is not None:
                seq.constraint = self.grammars().start(cfg.constraint)
            if predictions[i]:
                seq.prediction = PredictionFollower(list(predictions[i]), spec.prediction_depth)
            sequences.append(seq)
        return sequences

    def score_prompt(self, seq: Sequence) -> None:
        """Fill `seq.prompt_logprobs`: the target reads the prompt once more in a state of its own, PROMPT_CHUNK tokens
        a pass with the logits at every position, and each prompt token after the first gets its raw log-probability
        given the tokens before it (`step.raw_logprobs`, as generated tokens get theirs). Where the prefix store can
        hold the rows, the prompt's cache is kept there, so the sequence's own first step reuses it instead of
        reading the prompt again."""
        prompt = seq.tokens[: seq.prompt_len]
        state = self.target.new_state(1)
        entries = []
        for start in range(0, len(prompt), PROMPT_CHUNK):
            chunk = prompt[start : start + PROMPT_CHUNK]
            logits = self.target.forward(state, [chunk], [len(chunk)])[0]  # (len(chunk), V) after each token
            for i in range(len(chunk)):
                at = start + i + 1  # the token these logits predict
                if at < len(prompt):
                    entries.append(token_logprob(raw_logprobs(logits[i : i + 1].float()), prompt[at], seq.spec.logprobs))
        seq.prompt_logprobs = entries
        if self.prefixes is not None and isinstance(state, PrefixState):
            self.prefixes.keep(state, 0, prompt)

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
        return self.target.cache_bytes(tokens) + self.drafter.cache_bytes(tokens)

    def check_tree_request(self, tree: TreeConfig, drafting: bool = True) -> None:
        """Raise a VerispecError unless a request that drafts (`drafting`) or not can ask for this tree here: the
        request's rules (`config.check_tree_request`), then this engine's target and drafter (`make_sequences`
        applies it; the server and the live view ask early)."""
        check_tree_request(tree, drafting)
        if self.drafter.traits.plain:
            raise VerispecError("tree speculation needs a drafter that builds trees (a draft model or 'ngram'); "
                                "this decoder decodes plainly")
        if not isinstance(self.target, Runner):
            raise VerispecError("tree speculation needs a target backend with tree passes "
                                "(`core.protocols.Runner`: forward with the nodes' parents, then commit)")
        if not self.drafter.traits.trees:
            raise VerispecError(f"the '{self.drafter.name}' drafter cannot draft trees here "
                                "(a chain-only drafter)")

    # --- the step, and the one loop around it ----------------------------------------------------
    def step(self, batch: DecodeBatch) -> list[tuple[StepEvent, Sequence]]:
        """One speculative step for every row of the batch; finished (and failed) rows leave it.

        Returns (event, sequence) for every sequence that committed tokens or ended this step, in row order (a row
        still reading its prompt has no event yet). A fault stays with its row (`verispec.batch`); one in the target's
        batched work ends every row of the batch, which starts afresh."""
        if not batch:
            return []
        try:
            return self._step(batch)
        except TargetFault as fault:
            return batch.fail_all(fault.stage, fault.error)

    def _step(self, batch: DecodeBatch) -> list[tuple[StepEvent, Sequence]]:
        rows, absorbed = batch.sequences, len(batch.faults)
        # 1. draft: each row's shape, then the drafter's drafts (or a forced run, or the predicted output)
        t0 = time.perf_counter()
        plan = plan_step(batch)
        drafts = draft(batch, plan)
        t1 = time.perf_counter()
        # 2. one target pass: each row's pending tokens, then its draft's nodes; logits after the last pending token
        # and after each node (none for a row still reading its prompt). Rows the target cannot read end before it.
        pending = [batch.pending(s, pre) for s, pre in zip(rows, plan.prefilling)]
        nodes = [d.tokens.tolist() for d in drafts]
        failed = batch.check(pending, drafts, nodes)
        inputs = [[] if b in failed else p + n for b, (p, n) in enumerate(zip(pending, nodes))]
        wanted = [0 if pre or b in failed else len(d) + 1 for b, (d, pre) in enumerate(zip(drafts, plan.prefilling))]
        parents = [d.tree.parents.tolist() for d in drafts]
        logits = batch.forward(inputs, wanted, parents, failed)  # per row: (>= len(d) + 1, V)
        t2 = time.perf_counter()
        clock = StepClock(t1 - t0, t2 - t1, sum(len(i) for i in inputs), max(plan.depths, default=0), plan.first,
                          any(plan.prefilling), calm=len(batch.faults) == absorbed)  # costs measured while decoding
        # 3. verify the whole batch: per row, the accepted path and the recovered or bonus token
        verdicts = self._verify(batch, drafts, logits, plan.prefilling, failed)
        paths = [v.path if v is not None else () for v in verdicts]
        batch.target("commit", lambda: self.target.commit(batch.state, [list(p) for p in paths]))
        # 4. commit: each row's tokens (to EOS, a stop string or its length), then the drafter keeps the accepted
        # paths (a head keeps the target's features there; a draft model only the nodes it fed itself)
        events, prompted, outcomes = [], [], []
        for b, (s, d, v, pre, read) in enumerate(zip(rows, drafts, verdicts, plan.prefilling, pending)):
            if b in failed or v is None and not pre:  # ended before, in the pass or in its verification: leaves below
                continue
            if pre:
                s.target_cached += len(read)
                continue
            if s.num_generated == 0:
                prompted.append(b)  # its whole prompt is in the cache now: kept for requests that share it
            source = "forced" if b in plan.forced else "predicted" if b in plan.predicted else "drafter"
            outcomes.append(RowOutcome(s, len(d), d.tree.depth, v.num_accepted, v.bonus, source,
                                       len(plan.forced.get(b, ()))))
            event = self._commit(batch, plan, b, d, v, logits[b][: len(d) + 1])
            if event is not None:
                events.append((event, s))
        batch.draft_rows.commit(rows, drafts, paths)
        batch.keep_prefixes([b for b in prompted if rows[b].finish_reason is None])
        # 5. the step's observers: the rows' counters, the tuner (costs, and the chains its drafter drafted)
        report = StepReport(clock, tuple(outcomes), plan.trees is not None)
        for observe in batch.observers:
            observe(report)
        return batch.finish_step(events, t1 - t0, t2 - t1)

    def _verify(self, batch: DecodeBatch, drafts: list[Draft], logits, prefilling: list[bool],
                failed: set[int]) -> list[Verdict | None]:
        """Each row's Verdict (None for a row reading its prompt, or ended): the greedy chain rows from one argmax over
        the pass, the others one by one (`step.StepRules`); a fault in a row's own verification ends that row alone."""
        rules, rows = self.rules, batch.sequences
        together_rows = [b for b, (s, d, pre) in enumerate(zip(rows, drafts, prefilling))
                         if not pre and b not in failed and rules.batched(s, d)]
        try:
            together = rules.verify_rows(together_rows, rows, drafts, logits)
        except BaseException as err:  # the rows are verified one by one, where a fault finds its row
            if not is_fault(err):
                raise
            together = {}
        return [None if pre or b in failed else together[b] if b in together else
                batch.row(s, "verify", lambda b=b, s=s, d=d: rules.verify_one(s, d, logits[b][: len(d) + 1]))
                for b, (s, d, pre) in enumerate(zip(rows, drafts, prefilling))]

    def _commit(self, batch: DecodeBatch, plan: StepPlan, b: int, d: Draft, v: Verdict,
                logits: torch.Tensor) -> StepEvent | None:
        """Row b's tokens of this step committed, its logprobs recorded; None where the row failed (its
        fault is kept by the batch). logits: (N + 1, V) at the root and after each of its draft's nodes."""
        s, rules = batch.sequences[b], self.rules
        s.target_cached = len(s.tokens) + v.num_accepted
        entries = None
        if s.logprobs is not None:  # before the commit: a constraint's masks are this step's
            entries = batch.row(s, "logprobs", lambda: rules.logprobs(s, d, v, logits))
            if entries is None:
                return None
        event = batch.row(s, "commit", lambda: rules.commit(s, d.path_tokens(v.path), v))
        if event is None:
            return None
        if entries is not None:
            # a constraint's end token committed without a pass (the only token it allows) has probability 1
            s.logprobs.extend(entries[: len(event.committed)] +
                              [TokenLogprob(t, 0.0) for t in event.committed[len(entries):]])
        if s.prediction is not None:
            s.prediction.observe(len(d) if b in plan.predicted else 0, v.num_accepted, list(event.committed))
        return replace(event, forced=True) if b in plan.forced else event

    def run(self, batch: DecodeBatch, between: Callable[[DecodeBatch], bool] | None = None,
            on_fault: Callable[[BaseException], None] | None = None) -> Iterator[list[tuple[StepEvent, Sequence]]]:
        """The decoding loop every front end drives (`stream`, the server's scheduler, the corpus answerer): one
        `step` at a time, yielding each step's events.

        `between(batch)` runs before every step, where rows join and leave (the server admits, reaps and waits there
        while the batch is empty); the loop ends when it returns False, or, without it, when the batch is empty.
        `on_fault(err)`: a fault that escaped the step's own guards (a bug) is handed to it and the loop goes on (the
        server cuts that batch and keeps serving); without it, the fault is raised."""
        while between(batch) if between is not None else bool(batch):
            if not batch:
                continue
            try:
                results = self.step(batch)
            except BaseException as err:
                if on_fault is None or not is_fault(err):
                    raise
                on_fault(err)
                continue
            yield results

    def stream(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seeds: list[int | None] | int | None = None,
        tuner: KTuner | None = None,
        predictions: list[list[int] | None] | None = None,
    ) -> Iterator[tuple[StepEvent, Sequence]]:
        """Decode a batch, yielding (event, sequence) after every step for every running sequence.

        `seeds`: one per prompt, or an int s (prompt i gets s + i), or None (fresh entropy).
        `tuner`: chooses K each step from measured costs and acceptance (then `spec.num_draft_tokens`
        is unused); the output distribution does not depend on K.
        `predictions`: per prompt, the token ids of its predicted output, or None (see `make_sequences`).
        """
        batch = DecodeBatch(self, tuner)
        sequences = self.make_sequences(prompts, sampling, spec, seeds, predictions=predictions)
        for seq in sequences if spec.prompt_logprobs else ():
            self.score_prompt(seq)
        batch.add(sequences)
        for results in self.run(batch):
            for _, seq in results:
                if seq.error is not None:  # a library call fails loudly (the server ends only that request)
                    raise VerispecError(f"sequence {seq.index} failed: {type(seq.error).__name__}: {seq.error}") \
                        from seq.error
            yield from results

    def generate(self, prompts: list[list[int]], sampling=SamplingConfig(), spec=SpecConfig(), seeds=None,
                 tuner: KTuner | None = None, predictions: list[list[int] | None] | None = None) -> list[Sequence]:
        """Decode a batch to the end; returns the finished sequences in prompt order."""
        done: dict[int, Sequence] = {}
        for _, seq in self.stream(prompts, sampling, spec, seeds, tuner, predictions):
            if seq.finish_reason is not None:
                done[seq.index] = seq
        return [done[i] for i in sorted(done)]
