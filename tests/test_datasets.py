"""Prompt sets: several Spec-Bench JSONL files read as one, and the shipped code-editing and agent prompts (what
they hold, their split, and that the builder reproduces them)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.config import Constraint
from verispec.constraints import grammar_text
from verispec.datasets import EDITING_PROMPTS, HELDOUT, STRUCTURED_PROMPTS, load_prompts
from verispec.errors import VerispecError

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_editing_prompts_copy_most_of_what_they_ask_for():
    prompts = load_prompts(EDITING_PROMPTS)
    by = {c: [p for p in prompts if p.category == c] for c in ("code_editing", "agent")}
    assert len(by["code_editing"]) == len(by["agent"]) == 40 == len(prompts) // 2
    assert len(load_prompts(EDITING_PROMPTS, ["agent"], split=HELDOUT)) == 20  # odd ids held out
    for p in by["code_editing"]:
        assert re.search(r"```python\ndef \w+\(.*\n```$", p.text, re.S), p.question_id
        assert "Reply with the complete" in p.text
    for p in by["agent"]:
        line = int(re.search(r"still fails at line (\d+)", p.text).group(1))
        code = re.search(r"```python\n(.*?)\n```", p.text, re.S).group(1).splitlines()
        assert code[line - 1].strip() in p.text.split("Step 2:")[1]  # the traceback quotes the buggy line
    rows = [json.loads(line) for line in EDITING_PROMPTS.read_text().splitlines()]
    assert all(r["source"] for r in rows) and (EDITING_PROMPTS.parent / "SOURCE.txt").is_file()


def test_several_files_read_as_one_and_ids_must_not_repeat(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": ["why?"]}) + "\n")
    both = load_prompts([EDITING_PROMPTS, other], ["qa", "agent"], per_category=2)
    assert [p.category for p in both].count("qa") == 1 and [p.category for p in both].count("agent") == 2
    with pytest.raises(VerispecError, match="unknown categories \\['poetry'\\]"):
        load_prompts([EDITING_PROMPTS, other], ["poetry"])
    with pytest.raises(VerispecError, match="question ids repeat"):
        load_prompts([other, other])


def test_the_shipped_structured_prompts_each_carry_a_schema_the_grammar_engine_accepts():
    import llguidance

    prompts = load_prompts(STRUCTURED_PROMPTS)
    assert [p.category for p in prompts].count("json_extraction") == 20 == [p.category for p in prompts].count("function_call")
    assert len(load_prompts(STRUCTURED_PROMPTS, split=HELDOUT)) == 20
    for p in prompts:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(Constraint("json_schema", p.schema)))
        assert not failed, (p.question_id, messages)
        assert "JSON" in p.text
    rows = [json.loads(line) for line in STRUCTURED_PROMPTS.read_text().splitlines()]
    assert all(r["source"] for r in rows)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="built from Python 3.11's standard library sources")
@pytest.mark.parametrize("script", ["build_edit_prompts.py", "build_structured_prompts.py"])
def test_the_builder_reproduces_the_shipped_prompts(script):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
