"""The server's request -> sequence step on its own (`serve.requests.RequestBuilder`, no app, no HTTP): a request
becomes the sequence it asks for, and each limit it breaks is a 4xx naming its field before anything is admitted."""

from __future__ import annotations

import pytest
from tiny_hf import save_tiny_model_dir

from verispec import SpeculativeDecoder
from verispec.serve.config import ServeConfig
from verispec.serve.protocol import APIError, ChatRequest, CompletionRequest
from verispec.serve.requests import RequestBuilder


@pytest.fixture(scope="module")
def builder(tmp_path_factory) -> RequestBuilder:
    target = str(save_tiny_model_dir(tmp_path_factory.mktemp("requests") / "target", "llama", seed=0))
    decoder = SpeculativeDecoder.load(target, "ngram")
    config = ServeConfig(port=0, served_model_name="tiny", max_prompt_tokens=40, max_tokens_limit=64)
    return RequestBuilder(decoder, config, "tiny")


def refused(build, status: int, param: str | None, message: str) -> None:
    with pytest.raises(APIError) as caught:
        build()
    err = caught.value
    assert (err.status, err.param) == (status, param) and message in err.message, (err.status, err.param, err.message)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "hello there", "max_tokens": 8, **fields})


def test_a_request_becomes_the_sequence_it_asks_for(builder):
    body = completion(temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], speculative={"K": 5})
    prompt = builder.completion_prompt(body)
    seq = builder.sequence(body, prompt, body.max_tokens)
    assert seq.tokens == prompt and seq.prompt_len == len(prompt) and seq.max_new_tokens == 8
    assert seq.sampling.temperature == 0.7 and seq.sampling.top_p == 0.9
    assert seq.spec.num_draft_tokens == 5 and seq.spec.stop == ("\n\n",) and seq.drafting
    token_prompt = completion(prompt=prompt)
    assert builder.completion_prompt(token_prompt) == prompt  # token ids are used as they are
    plain = completion(speculative={"drafter": "none"})
    assert not builder.sequence(plain, prompt, 8).drafting
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)
    assert builder.chat_prompt(chat)  # the tiny tokenizer's chat template


def test_each_broken_limit_is_a_4xx_naming_its_field(builder):
    prompt = builder.completion_prompt(completion())
    cases = [
        (completion(model="other"), prompt, 8, 404, "model", "is not served here"),
        (completion(n=9), prompt, 8, 400, "n", "n may be from 1 to 8"),
        (completion(stop=["a", "b", "c", "d", "e"]), prompt, 8, 400, "stop", "at most 4 stop strings"),
        (completion(speculative={"K": 99}), prompt, 8, 400, "speculative.K", "at most 16"),
        (completion(speculative={"drafter": "eagle"}), prompt, 8, 400, "speculative.drafter", "drafts with 'ngram'"),
        (completion(speculative={"drafter": "none", "tree": {"budget": 8}}), prompt, 8, 400, "speculative.tree",
         "needs a drafter"),
        (completion(speculative={"tree": {"budget": 999}}), prompt, 8, 400, "speculative.tree", "at most 64 nodes"),
        (completion(), list(range(3, 50)), 8, 400, "prompt", "at most 40"),
        (completion(max_tokens=65), prompt, 65, 400, "max_tokens", "at most 64"),
    ]
    for body, tokens, max_tokens, status, param, message in cases:
        refused(lambda: builder.sequence(body, tokens, max_tokens), status, param, message)
    refused(lambda: builder.completion_prompt(completion(prompt=["a", "b"])), 400, "prompt", "one prompt per request")
