"""What the live view should show, computed with the library itself: a Tracer over `decoder.stream`."""

from __future__ import annotations

from verispec.api import SpeculativeDecoder
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.trace import Tracer, tracing


def reference_steps(model_dirs, prompt, k, temperature, seed, max_new_tokens, tree: TreeConfig | None = None):
    """(trace records, generated text, prompt text, stats) of the library's run with these settings."""
    decoder = SpeculativeDecoder.load(*model_dirs)
    tokenizer = decoder.target.tokenizer
    tracer = Tracer(token_text=lambda t: tokenizer.decode([t]))
    steps, seq = [], None
    spec = SpecConfig(num_draft_tokens=k, max_new_tokens=max_new_tokens, tree=tree)
    with tracing(decoder.engine, tracer):
        for event, seq in decoder.stream(prompt, SamplingConfig(temperature=temperature), spec, seed):
            steps.append(tracer.step(event, seq))
    prompt_text = tokenizer.decode(seq.tokens[: seq.prompt_len])
    return steps, decoder.decode(seq.generated), prompt_text, seq.stats


def visible(text):
    """A token's text as the pages show it (live.js / common.js `visible`)."""
    return "\u2205" if text == "" else text.replace(" ", "\u00b7").replace("\n", "\u21b5")
