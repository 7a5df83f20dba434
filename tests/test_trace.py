"""Tracing verification: on or off, the same seed gives the same tokens; records agree with the
rule (min(1, p/q), u < p/q <=> accepted, residual); `generate --trace` and `replay` round-trip."""

import json

import pytest
import torch

from conftest import noisy_copy, tiny_model
from tiny_hf import save_tiny_model_dir
from verispec.cli import main
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runner import ModelRunner
from verispec.rejection import residual_distribution, verify
from verispec.trace import Tracer, tracing, verification_record

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11]]


def make_engine(kind):
    target = tiny_model("llama", vocab=32, seed=0, sharpness=3.0)
    drafter = DraftModelDrafter(ModelRunner(noisy_copy(target, 0.5)), 32) if kind == "model" else PromptLookupDrafter()
    return SpeculativeEngine(ModelRunner(target), drafter, set())


def run(engine, sampling, tracer=None):
    steps, tokens = [], {}
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24)
    with tracing(engine, tracer) if tracer else _null():
        for event, seq in engine.stream(PROMPTS, sampling, spec, seeds=5):
            tokens[seq.index] = list(seq.generated)
            if tracer:
                steps.append(tracer.step(event, seq))
    return tokens, steps


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_tracing_on_or_off_gives_the_same_tokens(kind, temperature):
    sampling = SamplingConfig(temperature=temperature)
    plain, _ = run(make_engine(kind), sampling)
    traced, steps = run(make_engine(kind), sampling, Tracer())
    assert traced == plain
    assert steps and all(s["committed"] for s in steps)
    verdicts = {d["verdict"] for s in steps for d in s["drafts"]}
    assert "accepted" in verdicts and "rejected" in verdicts  # the check covers both outcomes
    for s in steps:
        for d in s["drafts"]:
            ratio = d["p"] / d["q"]  # of values rounded to 6 digits
            assert d["accept_probability"] == pytest.approx(min(1.0, ratio), rel=1e-3, abs=1e-5)
            if temperature == 0:
                assert d["uniform"] is None
            elif d["verdict"] != "discarded" and abs(d["uniform"] - ratio) > 1e-3:
                assert (d["uniform"] < d["p"] / d["q"]) == (d["verdict"] == "accepted")
        assert s["counters"]["target_calls"] == s["step"]


def test_verify_returns_the_uniforms_it_used_without_changing_the_draws():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 10, generator=gen), -1)  # (n+1, V)
    q = torch.softmax(torch.randn(3, 10, generator=gen), -1)  # (n, V)
    x = torch.tensor([1, 4, 7])
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    verdict, u = verify(p, x, q, a, return_uniforms=True)
    assert verdict == verify(p, x, q, b)
    assert torch.equal(a.get_state(), b.get_state())
    assert torch.equal(u, torch.rand(3, generator=torch.Generator().manual_seed(9)))


def test_verification_record_lists_overlap_excess_and_residual():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])  # (n+1, V), n = 1
    q = torch.tensor([[0.2, 0.6, 0.1, 0.1]])  # (n, V)
    from verispec.rejection import Verdict

    rec = verification_record(p, torch.tensor([1]), q, Verdict(0, 0, False), torch.tensor([0.9]), top=4)
    d = rec["drafts"][0]
    assert (d["p"], d["q"], d["accept_probability"], d["uniform"], d["verdict"]) == (0.3, 0.6, 0.5, 0.9, "rejected")
    pos = rec["positions"][0]
    assert pos["acceptance_mass"] == pytest.approx(0.2 + 0.3 + 0.1 + 0.0)
    by_token = {c["token"]: c for c in pos["candidates"]}
    residual = residual_distribution(p[0], q[0])
    for t, c in by_token.items():
        assert c["overlap"] == pytest.approx(min(p[0, t], q[0, t]))
        assert c["draft_excess"] == pytest.approx(max(0.0, q[0, t] - p[0, t]))
        assert c["residual"] == pytest.approx(float(residual[t]), abs=1e-6)
    assert by_token[0]["residual"] == pytest.approx(0.3 / 0.4)
    assert rec["positions"][1]["acceptance_mass"] is None and rec["positions"][1]["candidates"][0]["token"] == 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(save_tiny_model_dir(root / "t", seed=0, sharpness=3.0)), str(save_tiny_model_dir(root / "d", seed=1, sharpness=3.0))


def test_generate_trace_then_replay(model_dirs, tmp_path, capsys):
    target, draft = model_dirs
    path = tmp_path / "trace.json"
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "abc", "--max-new-tokens", "16",
            "--seed", "3", "--no-chat", "--temperature", "1", "-k", "3", "--json"]
    assert main(args + ["--trace", str(path)]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == traced["token_ids"]
    doc = json.loads(path.read_text())
    assert [t for s in doc["steps"] for t in s["committed"]] == traced["token_ids"]
    assert "".join(text for s in doc["steps"] for text, _ in s["pieces"]) == traced["text"]
    assert doc["steps"][-1]["counters"]["target_calls"] == traced["stats"]["target_forward_passes"]
    assert main(["replay", str(path), "--delay", "0", "--details", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "min(1,p/q)=" in out and "tokens per target pass" in out
    assert main(["replay", str(path), "--delay", "0", "--no-color"]) == 0
    assert traced["text"].replace("\n", "") in capsys.readouterr().out.replace("\n", "")


def test_replay_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert main(["replay", str(bad)]) == 2
    assert "not a verispec trace" in capsys.readouterr().err
