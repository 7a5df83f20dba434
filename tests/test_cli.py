"""The CLI and Python API on tiny local HF model directories: --json fields, greedy equality,
streaming output, and clear errors (exit status 2, no traceback) for bad input."""

import json

import pytest
import torch

from drafting import drafts_accepted
from tiny_hf import CHARS, save_tiny_model_dir
from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.cli import main
from verispec.tuning import KTuner, CostProfile


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    draft = save_tiny_model_dir(root / "draft", "llama", seed=0)  # same weights: exercises full acceptance
    other = save_tiny_model_dir(root / "other", "llama", seed=1, vocab_chars=list(reversed(CHARS)))
    nochat = save_tiny_model_dir(root / "nochat", "qwen2", seed=2, chat=False)
    return {"target": str(target), "draft": str(draft), "other": str(other), "nochat": str(nochat)}


def run_json(capsys, *args):
    assert main(["generate", "--json", "--no-auto-k", *args]) == 0  # fixed K unless a test asks (--auto-k wins after)
    return json.loads(capsys.readouterr().out)


def test_draft_stop_option_keeps_greedy_output(model_dirs, capsys):
    common = ["--target", model_dirs["target"], "--prompt", "hello there", "--temperature", "0", "--max-new-tokens", "16"]
    plain = run_json(capsys, *common, "--draft", "none")
    stopped = run_json(capsys, *common, "--draft", model_dirs["draft"], "--draft-stop", "0.5")
    assert stopped["token_ids"] == plain["token_ids"]
    drafts_accepted([stopped])


def test_json_output_has_every_field_and_greedy_equals_plain_decoding(model_dirs, capsys):
    common = ["--target", model_dirs["target"], "--prompt", "hello there", "--temperature", "0", "--max-new-tokens", "20"]
    spec = run_json(capsys, *common, "--draft", model_dirs["draft"], "-k", "3")
    plain = run_json(capsys, *common, "--draft", "none")
    ngram = run_json(capsys, *common, "--draft", "ngram")
    for out in (spec, plain, ngram):
        assert set(out) >= {"text", "prompt_token_ids", "token_ids", "stats", "dtype"}
        assert set(out["stats"]) >= {"target_forward_passes", "draft_tokens", "accepted_tokens", "acceptance_rate",
                                     "tokens_per_target_pass", "accepted_per_position", "wall_seconds", "tokens_per_second"}
        assert out["dtype"] == "float32"
    assert spec["token_ids"] == plain["token_ids"] == ngram["token_ids"]
    for run in (spec, ngram):
        drafts_accepted([run])
    assert spec["prompt_token_ids"] == plain["prompt_token_ids"]
    assert spec["stats"]["acceptance_rate"] == 1.0 and spec["stats"]["tokens_per_target_pass"] > 1
    assert len(spec["stats"]["accepted_per_position"]) == 3
    # The chat template was applied by default (the target has one).
    decoder = SpeculativeDecoder.load(model_dirs["target"], "none")
    assert spec["prompt_token_ids"] == decoder.encode("hello there", chat=True) != decoder.encode("hello there", chat=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    prompt = torch.tensor([plain["prompt_token_ids"]])
    reference = model.generate(prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert plain["token_ids"] == reference[0, prompt.shape[1]:].tolist()[: len(plain["token_ids"])]


def test_streaming_output_and_stats_table(model_dirs, capsys):
    code = main(["generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--prompt", "abc",
                 "--max-new-tokens", "12", "--seed", "1", "--no-color", "--no-chat"])
    out = capsys.readouterr().out
    assert code == 0
    assert "acceptance rate" in out and "tokens per target pass" in out and "accepted" in out


def test_sampled_json_is_seeded(model_dirs, capsys):
    args = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--prompt", "abc", "--temperature", "1",
            "--top-p", "0.9", "--seed", "7", "--max-new-tokens", "15"]
    assert run_json(capsys, *args)["token_ids"] == run_json(capsys, *args)["token_ids"]


def test_python_api_mirrors_the_cli(model_dirs, capsys):
    decoder = SpeculativeDecoder.load(model_dirs["target"], model_dirs["draft"])
    result = decoder.generate("hello there", SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=3, max_new_tokens=20))
    cli = run_json(capsys, "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--prompt", "hello there",
                   "--temperature", "0", "--max-new-tokens", "20", "-k", "3")
    assert result.to_dict()["token_ids"] == cli["token_ids"] and result.text == cli["text"]
    batch = decoder.generate_batch(["hello there", "a much longer prompt, with more text"], SamplingConfig(temperature=0),
                                   SpecConfig(max_new_tokens=10))
    assert batch[0].token_ids == result.token_ids[:10]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "-k", "0"], "K"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi", "--top-k", "-3"], "top_k"),
        (["--prompt", "hi", "--draft-stop", "1.5"], "draft_stop"),
        (["--prompt", "hi " * 200, "--no-chat"], "context window"),
        (["--prompt", "hi", "--target", "no-such-model"], "unknown model spec"),
        (["--prompt", "hi", "--target", "NOCHAT", "--draft", "none", "--chat"], "no chat template"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read"),
    ],
)
def test_bad_input_gives_a_clear_error(model_dirs, capsys, args, fragment):
    args = [model_dirs["other"] if a == "OTHER" else model_dirs["nochat"] if a == "NOCHAT" else a for a in args]
    base = ["--target", model_dirs["target"], "--draft", "ngram"]
    assert main(["generate", *base, *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_models_lists_the_named_defaults(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in out and "smollm2-135m-instruct" in out


def test_auto_k_generation_is_greedy_equal(model_dirs, capsys, monkeypatch):
    """--auto-k with a fixed cost profile in which drafting pays (a target pass costs the same over 1 to k_max + 1
    tokens, a draft token 5% of it): costs measured on a busy CPU may turn drafting off, and the comparison would
    then be plain decoding with itself. The measurement itself is the next test's."""
    monkeypatch.setattr(SpeculativeDecoder, "auto_tuner",
                        lambda self, k_max=8, cache=False: KTuner(CostProfile({w: 1.0 for w in range(1, k_max + 2)}, 0.05),
                                                        learn_costs=False))
    common = ["--target", model_dirs["target"], "--prompt", "hello there", "--temperature", "0", "--max-new-tokens", "16"]
    auto = run_json(capsys, *common, "--draft", model_dirs["draft"], "--auto-k")
    plain = run_json(capsys, *common, "--draft", "none")
    assert auto["token_ids"] == plain["token_ids"]
    drafts_accepted([auto])
    tree = run_json(capsys, *common, "--draft", model_dirs["draft"], "--auto-k", "--tree-budget", "8")
    assert tree["token_ids"] == plain["token_ids"]  # a dynamic tree sized from the profile's costs
    drafts_accepted([tree])


def test_auto_k_measures_a_cost_for_every_pass_width_and_the_draft(model_dirs):
    """The one test of the real measurement (`measure_costs` through `auto_tuner`): what it measures, never how fast.
    Whatever the timings, the profile holds a positive cost for target passes over 1 .. k_max + 1 tokens and for a
    draft token, and the K it picks is one of 0 .. k_max."""
    decoder = SpeculativeDecoder.load(model_dirs["target"], model_dirs["draft"])
    tuner = decoder.auto_tuner(3)
    profile = tuner.profile
    assert sorted(profile.target_pass) == [1, 2, 3, 4] and profile.k_max == 3
    assert all(seconds > 0 for seconds in profile.target_pass.values()) and profile.draft_token > 0
    assert profile.v(0) == 1.0 and profile.c == profile.draft_token / profile.target_pass[1]
    assert 0 <= tuner.k() <= 3
    assert SpeculativeDecoder.load(model_dirs["target"], "ngram").auto_tuner(2).profile.draft_token == 0  # free


def test_tree_options_greedy_equal_with_tree_stats(model_dirs, capsys):
    common = ["--target", model_dirs["target"], "--prompt", "hello there", "--temperature", "0", "--max-new-tokens", "20"]
    plain = run_json(capsys, *common, "--draft", "none")
    shaped = run_json(capsys, *common, "--draft", model_dirs["draft"], "--tree-shape", "3,2,1")
    budget = run_json(capsys, *common, "--draft", "ngram", "--tree-budget", "8", "-k", "3")
    assert shaped["token_ids"] == budget["token_ids"] == plain["token_ids"]
    for run in (shaped, budget):
        drafts_accepted([run])
    assert len(shaped["stats"]["drafted_per_position"]) == 3 and shaped["stats"]["mean_accepted_length"] > 0
    stats = shaped["stats"]
    assert stats["tokens_per_target_pass"] <= stats["mean_accepted_length"] + 1 + 1e-9
    from verispec import TreeConfig

    decoder = SpeculativeDecoder.load(model_dirs["target"], model_dirs["draft"])
    api = decoder.generate("hello there", SamplingConfig(temperature=0),
                           SpecConfig(max_new_tokens=20, tree=TreeConfig(shape=(3, 2, 1))))
    assert api.token_ids == shaped["token_ids"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--tree-shape", "3,0,1"], "branching factors >= 1"),
        (["--tree-shape", "three"], "--tree-shape takes"),
        (["--tree-budget", "0"], "budget"),
        (["--tree-shape", "2", "--tree-budget", "4"], "not both"),
        (["--tree-top-k", "3"], "add --tree-shape or --tree-budget"),
        (["--tree-budget", "4", "--tree-top-k", "0"], "top_k"),
        (["--tree-budget", "4", "--draft", "none"], "needs a drafter"),
        (["--tree-shape", "2,1", "--auto-k"], "not a static tree shape"),
    ],
)
def test_bad_tree_options_give_a_clear_error(model_dirs, capsys, args, fragment):
    base = ["--target", model_dirs["target"], "--draft", "ngram", "--prompt", "hi"]
    assert main(["generate", *base, *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
