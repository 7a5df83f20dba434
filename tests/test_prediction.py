"""Predicted outputs (`core.prediction`): the follower alone, then the answer with a prediction equal to plain decoding's
(greedy, every drafter, chains and tree steps, both runners), its sampled distribution the target's (chi-square), the
counters, and the front ends (the Python API, `generate --prediction`, the server's `prediction` field)."""

import json

import httpx
import openai
import pytest
import torch

from conftest import noisy_copy, tiny_model
from test_exactness import THRESHOLD, V, check_distribution
from test_exactness import PROMPT as SAMPLED_PROMPT
from tiny_hf import save_tiny_model_dir
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.cli import main
from verispec.config import TreeConfig
from verispec.core.prediction import MIN_DEPTH, PredictionFollower
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.serve.config import ServeConfig
from verispec.serve.server import BackgroundServer

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


# --- the follower --------------------------------------------------------------------------------------
def test_the_follower_drafts_what_follows_and_realigns_after_a_departure():
    pred = PredictionFollower([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], max_depth=4)
    assert pred.draft([], 8) == [10, 11, 12, 13]  # the answer starts where the prediction does; depth at most 4
    pred.observe(4, 4, [10, 11, 12, 13, 14])  # all accepted and the bonus token followed the prediction too
    assert pred.at == 5 and pred.draft([10, 11, 12, 13, 14], 2) == [15, 16]
    pred.observe(2, 0, [99])  # departed: nothing drafts until the answer's end is found in the prediction again
    assert pred.at is None and pred.depth == MIN_DEPTH
    assert pred.draft([10, 11, 12, 13, 14, 99], 8) == []
    # the answer's last three tokens occur in the prediction: it follows from there, with a short chain first
    assert pred.draft([10, 11, 12, 13, 14, 99, 15, 16, 17], 8) == [18, 19]
    pred.observe(2, 2, [18, 19])
    assert pred.depth == 4 and pred.draft([], 8) == []  # the prediction is used up


def test_realigning_prefers_the_occurrence_after_where_the_answer_stood():
    tokens = [1, 2, 3, 50, 51, 1, 2, 3, 60, 61, 62]
    pred = PredictionFollower(tokens, max_depth=8)
    pred.observe(0, 0, [1, 2, 3, 50, 51, 1])  # followed into the second copy of 1 2 3
    pred.observe(0, 0, [7])  # departed
    assert pred.draft([1, 2, 3, 50, 51, 1, 7, 1, 2, 3], 2) == [60, 61]  # not 50, 51 (the first occurrence)


# --- exactness -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_models():
    target = tiny_model("llama", vocab=64, seed=0, sharpness=30.0)
    return target, noisy_copy(target, 0.3)


def predictions_for(expected: list[int]) -> list[list[int]]:
    """A right prediction, one with an insertion, one with a deletion and a wrong start, and one that is all wrong."""
    return [expected, expected[:5] + [9, 9, 9] + expected[5:], [7, 7, 7] + expected[:4] + expected[9:],
            [(t + 1) % 64 for t in expected]]


@pytest.mark.parametrize("kind", ["none", "draft-model", "ngram", "tree"])
def test_greedy_answers_with_any_prediction_equal_plain_decoding(greedy_models, kind):
    target, draft = greedy_models
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24, prediction_depth=6,
                      tree=TreeConfig(budget=6, top_k=2) if kind == "tree" else None)
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = [s.generated for s in plain.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24))]
    drafter = {"none": None, "ngram": PromptLookupDrafter()}.get(kind) or (
        DraftModelDrafter(ModelRunner(draft), 64) if kind != "none" else None)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    for variant in range(4):
        predictions = [predictions_for(e)[variant] for e in expected]
        predictions[2] = None  # a row without a prediction, batched with rows that have one
        seqs = engine.generate(PROMPTS, GREEDY, spec, predictions=predictions)
        assert [s.generated for s in seqs] == expected, variant
        first = seqs[0].stats
        assert first.accepted_prediction_tokens + first.rejected_prediction_tokens > 0
        assert seqs[2].stats.accepted_prediction_tokens == seqs[2].stats.rejected_prediction_tokens == 0
        if variant == 0:  # the right prediction: every predicted draft accepted, far fewer passes than tokens
            assert first.rejected_prediction_tokens == 0 and first.target_forward_passes <= 6


def test_the_native_runner_with_a_prediction_equals_plain_decoding(tmp_path):
    from tiny_gguf import T, gguf_from_hf
    from verispec.models.gguf.model import load_gguf
    from verispec.models.gguf.runner import NativeRunner

    model = tiny_model("qwen2", vocab=64, seed=0, sharpness=30.0)
    target = NativeRunner(load_gguf(gguf_from_hf(model, tmp_path / "t.gguf", T.Q8_0), show_progress=False))
    engine = SpeculativeEngine(target, None, set())
    expected = [s.generated for s in engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24))]
    for variant in range(4):
        seqs = engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=24),
                               predictions=[predictions_for(e)[variant] for e in expected])
        assert [s.generated for s in seqs] == expected, variant


@pytest.fixture(scope="module")
def sampled_target():
    return tiny_model("qwen2", vocab=V, seed=3, sharpness=4.0)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=5, repetition_penalty=1.3)],
                         ids=["T1", "T0.8-k5-r1.3"])
def test_sampled_answers_with_a_prediction_follow_the_targets_distribution(sampled_target, sampling):
    """A prediction of the target's likeliest tokens is accepted often and rejected often; the first three tokens
    still have the target's distribution (chi-square, as for every drafter)."""
    engine = SpeculativeEngine(ModelRunner(sampled_target), None, set())
    likely = [int(t) for t in torch.argsort(sampled_target(torch.tensor([SAMPLED_PROMPT])).logits[0, -1], descending=True)]
    prediction = [likely[0], likely[1], likely[0], likely[2]] * 2
    n = 3000
    seqs = engine.generate([SAMPLED_PROMPT] * n, sampling, SpecConfig(max_new_tokens=3, stop_at_eos=False), seeds=0,
                           predictions=[prediction] * n)
    accepted = sum(s.stats.accepted_prediction_tokens for s in seqs)
    rejected = sum(s.stats.rejected_prediction_tokens for s in seqs)
    assert accepted > 0 and rejected > 0
    for fit in check_distribution(sampled_target, [tuple(s.generated[:3]) for s in seqs], sampling):
        assert fit.p_value > THRESHOLD, fit


def test_a_prediction_outside_the_vocabulary_is_one_clear_error(greedy_models):
    engine = SpeculativeEngine(ModelRunner(greedy_models[0]), None, set())
    with pytest.raises(VerispecError, match="prediction of prompt 0 holds token ids outside the vocabulary"):
        engine.generate([[1, 2]], GREEDY, SpecConfig(max_new_tokens=4), predictions=[[1, 64]])
    with pytest.raises(VerispecError, match="one prediction"):
        engine.generate([[1, 2]], GREEDY, SpecConfig(max_new_tokens=4), predictions=[[1], [2]])
    with pytest.raises(VerispecError, match="prediction_depth"):
        SpecConfig(prediction_depth=0)


# --- front ends ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("prediction") / "target", "llama", seed=0))


@pytest.fixture(scope="module")
def decoder(model_dir):
    return SpeculativeDecoder.load(model_dir, "none")


def test_the_python_api_takes_a_prediction_as_text(decoder):
    plain = decoder.generate("hello there", GREEDY, SpecConfig(max_new_tokens=30), chat=False)
    predicted = decoder.generate("hello there", GREEDY, SpecConfig(max_new_tokens=30), chat=False,
                                 prediction=plain.text)
    assert predicted.token_ids == plain.token_ids
    assert predicted.stats.accepted_prediction_tokens > 0
    assert predicted.stats.target_forward_passes < plain.stats.target_forward_passes


def test_generate_takes_a_prediction_file(model_dir, decoder, tmp_path, capsys):
    plain = decoder.generate("hello there", GREEDY, SpecConfig(max_new_tokens=30), chat=False)
    (tmp_path / "expected.txt").write_text(plain.text)
    assert main(["generate", "--target", model_dir, "--draft", "none", "--prompt", "hello there", "--no-chat",
                 "--temperature", "0", "--max-new-tokens", "30", "--prediction", str(tmp_path / "expected.txt"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain.token_ids and out["stats"]["accepted_prediction_tokens"] > 0
    assert main(["generate", "--target", model_dir, "--prompt", "x", "--prediction", str(tmp_path / "gone.txt")]) != 0
    assert "cannot read --prediction" in capsys.readouterr().err


def test_the_server_takes_openais_prediction_and_reports_its_tokens(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": "hello there", "max_tokens": 30, "temperature": 0}
        plain = http.post("/v1/completions", json=body).json()
        text = plain["choices"][0]["text"]
        out = http.post("/v1/completions", json={**body, "prediction": {"type": "content", "content": text}}).json()
        assert out["choices"][0]["text"] == text
        details = out["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
        assert out["usage"]["speculative"]["target_forward_passes"] < plain["usage"]["speculative"]["target_forward_passes"]
        bad = http.post("/v1/completions", json={**body, "prediction": {"type": "file", "content": text}})
        assert bad.status_code == 400 and "prediction" in bad.json()["error"]["message"]
        # the openai SDK's own field, on the chat endpoint, streamed and not
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        answer = chat.choices[0].message.content
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                               prediction={"type": "content", "content": answer})
        assert again.choices[0].message.content == answer
        assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0
        streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                  prediction={"type": "content", "content": answer}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer


def test_tokenize_and_detokenize_round_trip(decoder):
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": "hello there"}).json()
        assert ids["tokens"] == decoder.encode("hello there", chat=False) and ids["count"] == len(ids["tokens"])
        assert ids["max_model_len"] == decoder.engine.context_window
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == decoder.encode("hi", chat=True)
        back = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()
        assert back["prompt"] == decoder.decode(ids["tokens"])
        assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
        assert http.post("/tokenize", json={}).status_code == 400
        assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
