"""The Python API: load a target and a drafter once, then generate or stream.

    from verispec import SpeculativeDecoder, SamplingConfig, SpecConfig
    decoder = SpeculativeDecoder.load()                       # the default Qwen pair
    result = decoder.generate("Write a haiku about caches", SamplingConfig(temperature=0))
    print(result.text, result.stats.acceptance_rate)

`verispec.generate(...)` does both in one call and returns the same `GenerationResult`
(the fields of `verispec generate --json`).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from verispec.adapt import OnlineAdapter
from verispec.chat import chat_ids, has_chat_template, user_turn
from verispec.constraints import Grammars, grammars_for
from verispec.config import (PREFIX_CACHE_BYTES, AdaptConfig, CrossTokenizerConfig, NGramConfig, PromptLookupConfig,
                             SamplingConfig, SelfDraftConfig, SpecConfig, SuffixConfig)
from verispec.core.drafter import Drafter
from verispec.core.sequence import Sequence, StepEvent, TokenLogprob
from verispec.drafters.registry import NGRAM, Built, DrafterOptions, build_drafter, model_drafter
from verispec.engine import SpeculativeEngine
from verispec.core.prefix import PrefixStore
from verispec.errors import VerispecError
from verispec.models.loading import (
    DEFAULT_BACKEND,
    DEFAULT_DRAFT_WEIGHTS,
    DEFAULT_DTYPE,
    DEFAULT_TARGET_WEIGHTS,
    LoadedModel,
    load_model,
)
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, cache_dir
from verispec.stats import GenerationStats
from verispec.tuning import KTuner, cached_costs, measure_costs


@dataclass
class GenerationResult:
    """One finished generation: the `--json` object of `verispec generate`."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    dtype: str
    target: str
    draft: str
    target_weights: str = "dense"
    draft_weights: str | None = None
    logprobs: list[TokenLogprob] | None = None  # where SpecConfig.logprobs asked for them

    def to_dict(self) -> dict:
        extra = {} if self.logprobs is None else {"logprobs": [
            {"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]} for e in self.logprobs]}
        return {
            "text": self.text,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "target": self.target,
            "draft": self.draft,
            "dtype": self.dtype,
            "target_weights": self.target_weights,
            "draft_weights": self.draft_weights,
            "stats": self.stats.to_dict(),
            **extra,
        }


class SpeculativeDecoder:
    """A target model and a drafter, ready to decode.

    Args:
        target: the loaded target model.
        draft: a loaded draft model, "ngram" (prompt lookup), "ngram-corpus[:TABLE]" or a path ending
            .ngram (corpus n-grams), "self", "self:SKIP" or "self:FILE" (self-speculation: the target with
            sublayers skipped, see `verispec.models.skip`), "none" (plain decoding) or a Drafter.
        self_draft: on-the-fly choice of the self drafter's skip set (SWIFT-style).
        prompt_lookup: n-gram sizes for the "ngram" drafter.
        ngram: settings of the corpus n-gram drafter.
        options: every drafter setting at once (`drafters.registry.DrafterOptions`; replaces the three above).
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | Drafter | str = NGRAM,
        prompt_lookup: PromptLookupConfig = PromptLookupConfig(),
        ngram: NGramConfig = NGramConfig(),
        self_draft: SelfDraftConfig = SelfDraftConfig(),
        options: DrafterOptions | None = None,
    ) -> None:
        if target.weights == "int8":
            raise VerispecError("the target cannot use int8 weights: that would change the distribution being sampled")
        self.target = target
        self.runner = target.make_runner()
        if isinstance(draft, LoadedModel):
            built = model_drafter(draft, target, self.runner, *((options.draft_vocab, options.cross) if options else ()))
        elif isinstance(draft, Drafter):
            built = Built(draft, draft.name)
        else:
            options = options or DrafterOptions(prompt_lookup=prompt_lookup, ngram=ngram, self_draft=self_draft)
            built = build_drafter(draft, target, self.runner, options)
        self.drafter: Drafter = built.drafter
        self.draft_name = built.name
        self.draft_weights: str | None = built.draft_weights
        self.skip_source: str | None = built.skip_source  # the self drafter's skip set: a file, "given" or "default"
        context_window = min(self.runner.context_window, built.context_window or self.runner.context_window)
        self.engine = SpeculativeEngine(
            self.runner, self.drafter, target.eos_token_ids(), decode=self.decode, context_window=context_window,
            grammars=self._grammars,
        )
        self.reuse_prefixes(PREFIX_CACHE_BYTES)
        self.adapter: OnlineAdapter | None = None

    def reuse_prefixes(self, budget_bytes: int) -> None:
        """Keep up to `budget_bytes` of earlier generations' target cache, by their tokens, so a prompt that begins as
        an earlier prompt (or prompt and answer) did reads only the rest (`verispec.core.prefix`; on the native runner,
        whose reused positions are the same bits as recomputed ones). 0 turns it off. The store lives as long as this
        decoder: a conversation's later turns read only what is new. A draft model keeps its own rows the same way, in
        a store of its own with the same budget, and so does an EAGLE head (its layer's entries)."""
        self.engine.prefixes = PrefixStore.of(budget_bytes)
        self.engine.drafter.reuse_prefixes(budget_bytes)  # a draft model's own cache, an EAGLE head's entries

    @property
    def prefixes(self) -> PrefixStore | None:
        return self.engine.prefixes

    @classmethod
    def load(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str = DEFAULT_DRAFT,
        dtype: str = DEFAULT_DTYPE,
        draft_dtype: str | None = None,
        prompt_lookup: PromptLookupConfig = PromptLookupConfig(),
        target_weights: str = DEFAULT_TARGET_WEIGHTS,
        draft_weights: str = DEFAULT_DRAFT_WEIGHTS,
        backend: str = DEFAULT_BACKEND,
        ngram: NGramConfig = NGramConfig(),
        draft_lookup: int | None = None,
        draft_context: int | None = None,
        self_draft: SelfDraftConfig = SelfDraftConfig(),
        device: str = "auto",
        compile: bool = False,
        suffix: SuffixConfig = SuffixConfig(),
        draft_vocab: int | None = None,
        cross: CrossTokenizerConfig = CrossTokenizerConfig(),
        kv_cache: str | None = None,
    ) -> SpeculativeDecoder:
        """Load by spec: a named default, a local HF model directory or a .gguf file.

        `draft` may also be "ngram" (prompt lookup), "suffix[:FILE]" (suffix decoding, settings in `suffix`; FILE
        keeps earlier outputs across processes), "ngram-corpus[:TABLE]" / a .ngram table (corpus n-grams, settings
        in `ngram`) or "none". `draft_dtype` defaults to `dtype`.
        `target_weights` "packed" (default) keeps the target's weights and dtype and only changes
        their memory layout for faster multi-token passes; "dense" runs them as loaded.
        `draft_weights` "int8" (default) quantizes the draft: the draft's dtype and weights change
        its speed and acceptance only, never the output distribution. `backend` "auto" (default) runs
        GGUF files and the named defaults on verispec's native CPU runner (`verispec.models.gguf`), Hugging
        Face directories on torch; "native", "torch" and "llama.cpp" (optional extra; one sequence at a time)
        choose one.
        `draft_lookup` N > 0 makes a draft model (or an EAGLE head) copy from the context first where its last n-gram
        (n >= N) occurred before (see DraftModelDrafter); 0 turns that off; None keeps the draft's own
        setting (a distilled draft's manifest names the one measured best on its validation set).
        `draft_context` N makes a draft model read only the last N tokens of each prompt (a long
        prompt's draft pass then costs N tokens); None reads all.
        `draft_vocab` N cuts a draft model's LM head to N token ids, the most frequent first (native runner; q = 0
        elsewhere, so exact): a cheaper draft token; None keeps all.
        `cross`: how a draft model with another tokenizer than the target's drafts (`drafters.cross_tokenizer`).
        `device` "auto" (default: CUDA when torch sees a GPU), "cpu", "cuda" or "cuda:N" (`models.device`): off
        the CPU the torch route runs the models on a static cache with compiled passes, as `compile=True` does on
        the CPU (`models.runners.static`).
        `kv_cache` "float16" or "float32": the target's key/value cache on the native runner (None: its default,
        float16, as llama.cpp's; float32 keeps every bit of the keys and values at twice the bytes).
        """
        loaded_target = load_model(target, dtype, target_weights, backend, device, compile, kv_cache=kv_cache)
        options = DrafterOptions(prompt_lookup=prompt_lookup, ngram=ngram, self_draft=self_draft, draft_lookup=draft_lookup,
                                 draft_context=draft_context, draft_dtype=draft_dtype or dtype, draft_weights=draft_weights,
                                 backend=backend, device=device, compile=compile, suffix=suffix,
                                 draft_vocab=draft_vocab, cross=cross)
        return cls(loaded_target, draft, options=options)

    def _grammars(self) -> Grammars:
        """The structured-output compiler for the target's tokenizer."""
        return grammars_for(self.target.tokenizer, self.runner.vocab_size, self.target.eos_token_ids())

    # --- online adaptation -------------------------------------------------------------------------
    def enable_adaptation(self, config: AdaptConfig = AdaptConfig()) -> OnlineAdapter:
        """Start online adaptation of the drafter (see `verispec.adapt`): verification's target
        distributions where drafts failed are collected, and the drafter learns from them after each
        finished sequence (`stream` / `generate_batch` poke the adapter). The output distribution
        does not change. Returns the adapter (`stats()`, `adapt_now()`, `close()`)."""
        if self.adapter is not None:
            self.adapter.close()
        self.adapter = OnlineAdapter(self.engine, config)
        return self.adapter

    # --- text <-> tokens ---------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return has_chat_template(self.target.tokenizer)

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Tokenize a prompt; `chat` (default: whether the target has a chat template) wraps it as one user message."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise VerispecError("the prompt is empty")
        tok = self.target.tokenizer
        use_chat = self.has_chat_template if chat is None else chat
        if use_chat:
            if not self.has_chat_template:
                raise VerispecError(f"--chat was asked for, but target '{self.target.name}' has no chat template")
            return chat_ids(tok, user_turn(prompt))
        return list(tok(prompt)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.target.tokenizer.decode(token_ids, skip_special_tokens=True)

    # --- decoding ----------------------------------------------------------------------------------
    def stream(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling: SamplingConfig = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seed: int | list[int | None] | None = None,
        chat: bool | None = None,
        tuner: KTuner | None = None,
        prediction: str | list[int] | list[str | list[int] | None] | None = None,
    ) -> Iterator[tuple[StepEvent, Sequence]]:
        """Yield (StepEvent, Sequence) per sequence per step, as tokens are committed.

        `tuner` (see `auto_tuner`) picks K each step instead of `spec.num_draft_tokens`. `prediction`: the output
        expected (text, or token ids; one per prompt for a batch), drafted from while the answer follows it
        (OpenAI's predicted outputs: the file being edited, say); the answer is the target's either way."""
        token_prompts = self._token_prompts(prompts, chat)
        predictions = self._predictions(prediction, len(token_prompts))
        events = self.engine.stream(token_prompts, sampling, spec, seed, tuner, predictions)
        return events if self.adapter is None else self._adapting(events)

    def _predictions(self, prediction, n: int) -> list[list[int] | None] | None:
        """`stream`'s prediction as token ids per prompt (text encoded without special tokens or a chat template)."""
        if prediction is None:
            return None
        one = isinstance(prediction, str) or (isinstance(prediction, list) and prediction
                                              and isinstance(prediction[0], int))
        each = [prediction] if one else list(prediction)
        if len(each) != n:
            raise VerispecError(f"one prediction per prompt is needed ({n} prompts)")
        tok = self.target.tokenizer
        return [list(tok(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str) else
                None if p is None else list(p) for p in each]

    def _adapting(self, events: Iterator[tuple[StepEvent, Sequence]]) -> Iterator[tuple[StepEvent, Sequence]]:
        """Pass events on; poke the adapter when a sequence finishes (between steps: the stream is paused)."""
        for event, seq in events:
            yield event, seq
            if seq.finish_reason is not None and self.adapter is not None:
                self.adapter.poke()

    def auto_tuner(self, k_max: int = 8, cache: bool = False) -> KTuner:
        """Measure this machine's target and draft pass costs (a few seconds) and return an KTuner.

        `cache`: take the costs measured by an earlier process on this machine for the same models, threads and CPU
        (`tuning.cached_costs`, kept under the cache directory), measuring only the first time: a one-shot
        `verispec generate` then starts at once. The tuner corrects them from every pass either way."""
        draft_runner = self.drafter.runner
        measure = lambda: measure_costs(self.runner, draft_runner, k_max=k_max)  # noqa: E731
        profile = cached_costs(self._cost_key(k_max), measure, cache_dir() / "pass_costs") if cache else measure()
        head_cost = self.drafter.token_cost() if draft_runner is None else None
        profile = replace(profile, draft_token=head_cost) if head_cost else profile
        held_back = self.drafter.traits.held_back
        return KTuner(replace(profile, draft_extra=float(held_back)) if held_back else profile)

    def _cost_key(self, k_max: int) -> str:
        """What a cost profile depends on: the target as loaded, the draft's runner, threads and the CPU."""
        t = self.target
        cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
        return (f"{t.name}|{t.source}|{t.backend}|{t.dtype}|{t.weights}|{self.draft_name}|{self.draft_weights}|"
                f"threads={torch.get_num_threads()}|k_max={k_max}|cpu={cpu}|{platform.machine()}")

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingConfig = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seed: int | None = None,
        chat: bool | None = None,
        tuner: KTuner | None = None,
        prediction: str | list[int] | None = None,
    ) -> GenerationResult:
        """Generate for one prompt (text, or token ids used as they are); `prediction` as in `stream`."""
        return self.generate_batch([prompt], sampling, spec, seed, chat, tuner,
                                   None if prediction is None else [prediction])[0]

    def generate_batch(
        self,
        prompts: list[str] | list[list[int]],
        sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
        spec: SpecConfig = SpecConfig(),
        seed: int | list[int | None] | None = None,
        chat: bool | None = None,
        tuner: KTuner | None = None,
        predictions: list[str | list[int] | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for a batch of prompts together (ragged: each advances at its own pace); `predictions`: one
        predicted output per prompt (or None), as in `stream`."""
        done: dict[int, Sequence] = {}
        for _, seq in self.stream(prompts, sampling, spec, seed, chat, tuner, predictions):
            if seq.finish_reason is not None:
                done[seq.index] = seq
        return [self.result(done[i]) for i in sorted(done)]

    def result(self, seq: Sequence) -> GenerationResult:
        text = self.decode(seq.generated)
        if seq.text_end is not None:
            text = text[: seq.text_end]
        return GenerationResult(
            text=text,
            prompt_token_ids=seq.tokens[: seq.prompt_len],
            token_ids=seq.generated,
            finish_reason=seq.finish_reason or "length",
            stats=seq.stats,
            dtype=str(self.target.dtype).removeprefix("torch."),
            target=self.target.name,
            draft=self.draft_name,
            target_weights=self.target.weights,
            draft_weights=self.draft_weights,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
        )

    def _token_prompts(self, prompts, chat: bool | None) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise VerispecError("no prompts given")
        return [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]


_DECODERS: dict[tuple, SpeculativeDecoder] = {}


def generate(
    prompt: str,
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    *,
    sampling: SamplingConfig = SamplingConfig(),
    spec: SpecConfig = SpecConfig(),
    seed: int | None = None,
    chat: bool | None = None,
    dtype: str = DEFAULT_DTYPE,
) -> GenerationResult:
    """Load (once per process) and generate: `verispec.generate("def fib(n):", draft="ngram")`."""
    key = (target, draft, dtype)
    if key not in _DECODERS:
        _DECODERS[key] = SpeculativeDecoder.load(target, draft, dtype)
    return _DECODERS[key].generate(prompt, sampling, spec, seed, chat)


def set_threads(n: int | None) -> None:
    """Use n CPU threads for torch (None: leave torch's default)."""
    if n:
        torch.set_num_threads(n)


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []
