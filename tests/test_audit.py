"""`verispec audit` passes on an exact engine and fails on a broken one."""

import json

import pytest

from tiny_hf import save_tiny_model_dir
from verispec import SamplingConfig, SpeculativeDecoder, rejection
from verispec.audit import run_audit
from verispec.cli import main


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    target = save_tiny_model_dir(root / "target", "qwen2", seed=0, sharpness=3.0)
    draft = save_tiny_model_dir(root / "draft", "qwen2", seed=5, sharpness=3.0)
    return SpeculativeDecoder.load(str(target), str(draft)), str(target), str(draft)


def test_audit_passes_for_exact_sampling(decoder):
    dec, _, _ = decoder
    prompt = dec.encode("the cat", chat=False)
    report = run_audit(dec, prompt, SamplingConfig(temperature=1.0, top_k=10), num_draft_tokens=3, samples=1500,
                       batch_size=250, seed=1)
    assert report.passed, report.to_dict()
    assert len(report.checks) == 4 and 0 < report.acceptance_rate < 1


def test_audit_fails_when_the_residual_is_wrong(decoder, monkeypatch):
    dec, _, _ = decoder
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: q)
    prompt = dec.encode("the cat", chat=False)
    report = run_audit(dec, prompt, SamplingConfig(temperature=1.0, top_k=10), num_draft_tokens=3, samples=1500,
                       batch_size=250, seed=1)
    assert not report.passed


def test_audit_cli_json_and_greedy(decoder, capsys, tmp_path):
    """The greedy audit with a draft near the target (a noisy copy): the fixture's other draft has none of its
    greedy guesses accepted, and the check would then compare the target with itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import noisy_copy

    _, target, _ = decoder
    noisy_copy(AutoModelForCausalLM.from_pretrained(target), 0.3).save_pretrained(str(tmp_path / "near"))
    AutoTokenizer.from_pretrained(target).save_pretrained(str(tmp_path / "near"))
    code = main(["audit", "--target", target, "--draft", str(tmp_path / "near"), "--prompt", "dog", "--no-chat",
                 "--temperature", "0", "--samples", "40", "--batch-size", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] and out["checks"][0]["p_value"] == 1.0
    assert 0 < out["acceptance_rate"] < 1, out


def test_audit_of_tree_sampling_passes(decoder):
    from verispec import TreeConfig

    dec, _, _ = decoder
    prompt = dec.encode("the cat", chat=False)
    sampling = SamplingConfig(temperature=1.0, top_k=10)
    report = run_audit(dec, prompt, sampling, 3, samples=1000, batch_size=250, seed=2, tree=TreeConfig(shape=(3, 2)))
    assert report.passed, report.to_dict()
