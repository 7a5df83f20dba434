"""The systems `verispec bench` runs side by side: verispec's own, and the peers users would pick.

Each system decodes one prompt (token ids) and returns a `Run`: the new token ids, wall time and,
for verispec systems, the speculative statistics. Hugging Face systems seed torch's global generator
before sampling, since that is the only randomness `generate` takes.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from verispec.api import SpeculativeDecoder
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.errors import VerispecError
from verispec.stats import GenerationStats
from verispec.tuning import KTuner


@dataclass
class Run:
    """One prompt decoded by one system.

    seconds: wall time from the call to the last token, prompt processing included.
    first_seconds / first_tokens: when the first output arrived and how many tokens it held (a
    speculative first step can commit several): the prompt's prefill ends there, so the rate after it
    is the decoding rate, the phase speculation speeds up and the bandwidth limit bounds.
    faults: what the engine absorbed while decoding (a drafter's or a row's fault, one line each): the output stays
    exact, the speed may not (a drafter restarted reads its rows' prompts again).
    """

    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None = None
    first_seconds: float = 0.0
    first_tokens: int = 0
    faults: tuple[str, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first output per second after it (None where too few tokens followed it)."""
        tokens, seconds = len(self.token_ids) - self.first_tokens, self.seconds - self.first_seconds
        return tokens / seconds if tokens > 0 and seconds > 0 and self.first_tokens > 0 else None


class _FirstOutput:
    """A Hugging Face streamer that notes when the first new tokens arrive (its first `put` is the prompt)."""

    def __init__(self, start: float) -> None:
        self.start, self.calls, self.seconds, self.tokens = start, 0, 0.0, 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.seconds, self.tokens = time.perf_counter() - self.start, int(value.numel())

    def end(self) -> None:
        pass


class System:
    name: str = "system"
    family: str = "verispec"  # or "hf", "llama.cpp"

    def run(self, prompt: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> Run:
        raise NotImplementedError


class VerispecSystem(System):
    """verispec with a given drafter; `tuner` set means K is auto-tuned from measured costs; `tree` set
    means it drafts that tree per step instead of a chain."""

    def __init__(self, name: str, decoder: SpeculativeDecoder, num_draft_tokens: int, tuner: KTuner | None = None,
                 tree: TreeConfig | None = None):
        self.name, self.decoder, self.k, self.tuner, self.tree = name, decoder, num_draft_tokens, tuner, tree

    def run(self, prompt, sampling, max_new_tokens, seed):
        spec = SpecConfig(num_draft_tokens=self.k, max_new_tokens=max_new_tokens, tree=self.tree)
        first_seconds, first_tokens = 0.0, 0
        with absorbed_faults() as faults:
            start = time.perf_counter()
            for _, seq in self.decoder.engine.stream([prompt], sampling, spec, seeds=[seed], tuner=self.tuner):
                if not first_tokens and seq.generated:
                    first_seconds, first_tokens = time.perf_counter() - start, len(seq.generated)
            seconds = time.perf_counter() - start
        if self.decoder.adapter is not None:
            self.decoder.adapter.poke()  # online adaptation between prompts, outside the timed run
        return Run(seq.generated, seconds, seq.stats, first_seconds, first_tokens, tuple(faults))


# where decoding reports each fault it absorbs: the batch's (`verispec.faults`, `verispec.batch`) and a step plan's
# (`verispec.plan`: a constraint's forced tokens or a draft's check against it left out)
FAULT_LOGGERS = ("verispec.batch", "verispec.plan")


@contextmanager
def absorbed_faults():
    """The lines the decoding batch logs for each fault it absorbs while the block runs (a list, filled as they
    come): a bench counts them, since an absorbed fault keeps the output exact and hides in the speed."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    lines: list[str] = []
    handler, loggers = Collect(logging.WARNING), [logging.getLogger(name) for name in FAULT_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class _ConstrainedLogits:
    """A Hugging Face logits processor restricting scores to what a structured-output constraint allows after the
    answer so far (input_ids past the prompt). Assisted generation scores candidates at several lengths, so the
    constraint's matcher is moved to each call's answer by rolling back to the prefix it shares with the last one."""

    def __init__(self, state, prompt_len: int) -> None:
        self.state, self.prompt_len, self.held = state, prompt_len, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        answer = input_ids[0, self.prompt_len :].tolist()
        common = 0
        while common < min(len(answer), len(self.held)) and answer[common] == self.held[common]:
            common += 1
        matcher = self.state.matcher
        matcher.rollback(len(self.held) - common)
        consumed = matcher.try_consume_tokens(answer[common:]) if len(answer) > common else 0
        self.held = answer[: common + consumed]
        if len(self.held) < len(answer):  # a candidate past a token the constraint forbids: never committed
            return scores
        allowed = self.state.allowed()[: scores.shape[-1]].to(scores.device)  # (V,)
        return scores.masked_fill(~allowed, float("-inf"))


class HFSystem(System):
    """Hugging Face `generate`: target alone, assisted by a draft model, or with prompt lookup."""

    family = "hf"

    def __init__(self, name: str, target, eos_token_ids: set[int], grammars=None, **generate_kwargs):
        self.name, self.target, self.eos, self.kwargs = name, target, sorted(eos_token_ids), generate_kwargs
        self.grammars = grammars  # () -> verispec.constraints.Grammars, for structured-output prompts

    @torch.inference_mode()
    def run(self, prompt, sampling, max_new_tokens, seed):
        from transformers import LogitsProcessorList

        ids = torch.tensor([prompt], device=self.target.device)
        kwargs = dict(self.kwargs)
        if sampling.constraint is not None:
            if self.grammars is None:
                raise VerispecError(f"{self.name} was built without a tokenizer for structured output")
            state = self.grammars().start(sampling.constraint)
            kwargs["logits_processor"] = LogitsProcessorList([_ConstrainedLogits(state, len(prompt))])
        if sampling.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                          top_p=sampling.top_p, min_p=sampling.min_p or None,
                          repetition_penalty=sampling.repetition_penalty)
            torch.manual_seed(seed)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        first = _FirstOutput(start)
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None,
                                   streamer=first, **kwargs)
        seconds = time.perf_counter() - start
        new = out[0, len(prompt):].tolist()
        return Run(_cut_at_eos(new, set(self.eos)), seconds, None, first.seconds, min(first.tokens, len(new)))


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _llamacpp_draft_model(gguf: str, num_tokens: int, context_window: int, threads: int):
    """A llama-cpp-python draft model (its `LlamaDraftModel` interface: the context in, draft tokens out)
    that decodes a draft GGUF greedily for `num_tokens` tokens, keeping the draft's KV cache for the
    prefix it shares with the last call (llama-cpp-python's `generate` reuses a matching prefix)."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraftModel(LlamaDraftModel):
        def __init__(self):
            self.llm = Llama(model_path=gguf, n_ctx=context_window, verbose=False, n_threads=threads,
                             n_threads_batch=threads)

        def __call__(self, input_ids, /, **kwargs):
            draft = []
            for token in self.llm.generate(input_ids.tolist(), reset=True, temp=0.0):
                draft.append(token)
                if len(draft) == num_tokens:
                    break
            return np.array(draft, dtype=np.intc)

    return GreedyDraftModel()


class LlamaCppGenerate(System):
    """llama.cpp decoding the target with its own sampling loop (the CPU peer): alone, or with
    llama-cpp-python's own speculative decoding, by prompt lookup when `prompt_lookup_num_tokens` > 0 or
    with `draft_gguf` drafting `num_draft_tokens` greedily."""

    family = "llama.cpp"

    def __init__(self, name: str, gguf: str, eos_token_ids: set[int], context_window: int = 4096,
                 prompt_lookup_num_tokens: int = 0, draft_gguf: str | None = None, num_draft_tokens: int = 0):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name, self.eos = name, set(eos_token_ids)
        threads = torch.get_num_threads()  # for one token and for several (llama-cpp-python's default: every core)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup_num_tokens) if prompt_lookup_num_tokens else None
        if draft_gguf is not None:
            draft = _llamacpp_draft_model(draft_gguf, num_draft_tokens, context_window, threads)
        # With a draft, llama-cpp-python writes logits for every position into its score buffer but sizes
        # that buffer from the logits_all argument (n_batch rows unless it is True): a prompt longer than
        # n_batch (512) then fails ("could not broadcast ... into shape (0,)"). logits_all=True sizes it n_ctx.
        self.llm = Llama(model_path=gguf, n_ctx=context_window, verbose=False, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, logits_all=draft is not None)

    def run(self, prompt, sampling, max_new_tokens, seed):
        self.llm.reset()
        self.llm.set_seed(seed)
        kwargs = dict(temp=0.0) if sampling.greedy else dict(
            temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=sampling.min_p,
            repeat_penalty=sampling.repetition_penalty)
        if sampling.constraint is not None:  # llama.cpp's own grammar sampler, from its JSON-schema converter
            kwargs["grammar"] = llamacpp_grammar(sampling.constraint)
        tokens: list[int] = []
        first_seconds = 0.0
        start = time.perf_counter()
        for token in self.llm.generate(prompt, reset=True, **kwargs):
            tokens.append(int(token))
            if len(tokens) == 1:
                first_seconds = time.perf_counter() - start
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        return Run(tokens, time.perf_counter() - start, None, first_seconds, min(1, len(tokens)))


def llamacpp_grammar(constraint):
    """A llama-cpp-python LlamaGrammar for a JSON-schema or JSON-object constraint (llama.cpp's own converter to
    GBNF, which allows optional whitespace where verispec's JSON has fixed separators)."""
    from llama_cpp import LlamaGrammar

    if constraint.kind == "json_object":
        return LlamaGrammar.from_json_schema('{"type": "object"}', verbose=False)
    if constraint.kind == "json_schema":
        return LlamaGrammar.from_json_schema(constraint.source, verbose=False)
    if constraint.kind == "grammar" and "::=" in constraint.source:
        return LlamaGrammar.from_string(constraint.source, verbose=False)
    raise VerispecError(f"the llama.cpp systems take JSON schemas and GBNF grammars, not a {constraint.kind}")
