"""docs/custom-drafter.md's example works as written: its drafter, registered with one `DrafterKind`, is a `--draft`
spec for the API and (as an installed plugin, `verispec.drafters` entry points) for the CLI, and greedy output equals
plain decoding; a name taken twice, or a plugin that fails to load, is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from drafting import drafts_accepted
from tiny_hf import save_tiny_model_dir

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.cli import main
from verispec.drafters import registry
from verispec.errors import VerispecError

PAGE = Path(__file__).resolve().parents[1] / "docs" / "custom-drafter.md"
GREEDY = SamplingConfig(temperature=0)
SPEC = SpecConfig(num_draft_tokens=3, max_new_tokens=24)
PROMPTS = ["aaaa", "hello there", "ab"]


@pytest.fixture
def clean_registry(monkeypatch):
    """The table as shipped, restored after the test (registrations are process-wide)."""
    monkeypatch.setattr(registry, "_kinds", list(registry.KINDS))
    monkeypatch.setattr(registry, "_plugins_loaded", True)


def page_example() -> dict:
    """Run the page's first Python block (the drafter and its registration); return its names."""
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[0]
    namespace: dict = {"__name__": "custom_drafter_example"}
    exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("custom") / "target", "llama", seed=0))


def test_the_pages_drafter_is_exact_and_drafts(clean_registry, target):
    example = page_example()
    assert registry.parse_draft("repeat").kind == "repeat"  # registered, ahead of the model kind
    assert registry.parse_draft("repeat-model-dir").kind == registry.MODEL
    plain = SpeculativeDecoder.load(target, "none").generate_batch(PROMPTS, GREEDY, SPEC, chat=False)
    decoder = SpeculativeDecoder.load(target, "repeat")
    assert isinstance(decoder.drafter, example["RepeatDrafter"]) and decoder.draft_name == "repeat"
    runs = decoder.generate_batch(PROMPTS, GREEDY, SPEC, chat=False)
    assert [r.token_ids for r in runs] == [p.token_ids for p in plain]
    drafts_accepted(runs)


def test_a_taken_name_is_one_line(clean_registry):
    example = page_example()
    with pytest.raises(VerispecError, match="a drafter kind named 'repeat' is already registered"):
        registry.register_drafter(example["REPEAT"])
    with pytest.raises(VerispecError, match="'ngram' is already registered"):
        registry.register_drafter(registry.DrafterKind("ngram", "", lambda t: False, lambda *a: None))
    with pytest.raises(VerispecError, match="--draft is empty"):
        registry.parse_draft(" ")


class FakeEntryPoint:
    def __init__(self, name: str, value: str, load) -> None:
        self.name, self.value, self.load = name, value, load


def plugins(monkeypatch, points: list) -> None:
    import importlib.metadata

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: points if group == registry.PLUGINS else [])


def test_an_installed_plugin_is_a_draft_spec_for_the_cli(clean_registry, monkeypatch, target, tmp_path, capsys):
    example = page_example()
    monkeypatch.setattr(registry, "_kinds", list(registry.KINDS))  # installed, not registered by hand
    plugins(monkeypatch, [FakeEntryPoint("repeat", "my_package.repeat:REPEAT", lambda: example["REPEAT"])])
    outputs = {}
    for draft in ("none", "repeat"):
        args = ["generate", "--target", target, "--draft", draft, "--temperature", "0", "--max-new-tokens", "24",
                "-k", "3", "--no-chat", "--json", "--prompt", "aaaa"]
        assert main(args) == 0
        outputs[draft] = json.loads(capsys.readouterr().out)
    assert outputs["repeat"]["draft"] == "repeat"
    assert outputs["repeat"]["token_ids"] == outputs["none"]["token_ids"]
    drafts_accepted([outputs["repeat"]])


def test_a_broken_plugin_is_one_line(clean_registry, monkeypatch):
    def broken():
        raise ImportError("No module named 'my_package'")

    plugins(monkeypatch, [FakeEntryPoint("repeat", "my_package.repeat:REPEAT", broken)])
    with pytest.raises(VerispecError, match=r"the drafter plugin 'repeat' \(my_package.repeat:REPEAT\) failed to load: "
                                            "No module named 'my_package'"):
        registry.parse_draft("repeat")
    plugins(monkeypatch, [FakeEntryPoint("repeat", "my_package.repeat:REPEAT", lambda: object())])
    with pytest.raises(VerispecError, match="is not a DrafterKind"):
        registry.parse_draft("repeat")
