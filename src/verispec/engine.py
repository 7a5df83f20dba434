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
`verispec.step` holds the rules it verifies and commits by (`StepRules`). `SpeculativeEngine.stream` runs one
DecodeBatch until it is empty; the server's scheduler runs one that requests join. The engine imports the batch and
the batch knows the engine only as `step.StepParts`: no import circle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from verispec.batch import DecodeBatch
from verispec.config import ConstraintLimits, SamplingConfig, SpecConfig, TreeConfig, check_tree_request
from verispec.constraints import Grammars
from verispec.core.drafter import PLAIN, Drafter
from verispec.core.prediction import PredictionFollower
from verispec.core.protocols import PrefixState, Runner
from verispec.core.sequence import Sequence, StepEvent
from verispec.errors import VerispecError
from verispec.prefix import PrefixStore
from verispec.step import StepRules, raw_logprobs, token_logprob
from verispec.tuning import AdaptiveK

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
        # earlier rows' caches by their tokens, for rows whose prompts begin the same (`verispec.prefix`; None: off)
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

    def stream(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seeds: list[int | None] | int | None = None,
        tuner: AdaptiveK | None = None,
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
        while batch:
            results = batch.step()
            for _, seq in results:
                if seq.error is not None:  # a library call fails loudly (the server ends only that request)
                    raise VerispecError(f"sequence {seq.index} failed: {type(seq.error).__name__}: {seq.error}") \
                        from seq.error
            yield from results

    def generate(self, prompts: list[list[int]], sampling=SamplingConfig(), spec=SpecConfig(), seeds=None,
                 tuner: AdaptiveK | None = None, predictions: list[list[int] | None] | None = None) -> list[Sequence]:
        """Decode a batch to the end; returns the finished sequences in prompt order."""
        done: dict[int, Sequence] = {}
        for _, seq in self.stream(prompts, sampling, spec, seeds, tuner, predictions):
            if seq.finish_reason is not None:
                done[seq.index] = seq
        return [done[i] for i in sorted(done)]
