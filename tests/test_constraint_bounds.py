"""Constraint bombs: every kind of chain a grammar compiler recurses over, measured before compiling and refused in one
line past the bounds; compiled in a subprocess so that a crash fails the test instead of the run.

llguidance 1.9.1 ends the process with SIGSEGV on a $ref, allOf, property, Lark rule or %json chain 3,000 deep (the
last test shows the harness sees that crash with the bounds lifted); with the bounds, every kind at every depth up to
100,000 is either compiled and decoded through (masks on the main thread's 8 MiB stack) or refused with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import constraint_bombs as bombs
from verispec.config import Constraint, ConstraintLimits
from verispec.constraint_bounds import check_constraint, find_cycle, longest_chain
from verispec.errors import ConstraintError

HERE = Path(__file__).parent
BIG = 10**9
UNSIZED = ConstraintLimits(max_chars=BIG, max_literal_chars=BIG, max_nodes=BIG)  # only depth and the rest apply


def refused(constraint: Constraint, limits: ConstraintLimits = ConstraintLimits()) -> str:
    with pytest.raises(ConstraintError) as caught:
        check_constraint(constraint, limits)
    line = str(caught.value)
    assert "\n" not in line
    return line


def run_bombs(depths: str, names: list[str], *extra: str) -> tuple[int, list[dict], str]:
    """Compile bombs in a fresh interpreter: (exit code, one record per bomb it finished, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "constraint_bombs.py"), depths, *names, *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


# --- the measure itself, in this process (pure Python: no compile) ------------------------------------------------
def test_longest_chain_drops_back_edges_and_needs_no_recursion():
    assert longest_chain(["a"], {"a": ["b"], "b": ["c"], "c": ["a"]}.__getitem__, lambda _: 1, key=str) == 3
    assert longest_chain([0], lambda i: [i + 1] if i < 100_000 else [], lambda _: 1, key=int) == 100_001
    diamond = {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}
    assert longest_chain(["a"], diamond.__getitem__, lambda n: 2 if n == "c" else 1, key=str) == 4
    assert find_cycle(["a"], {"a": ["b"], "b": ["a"]}.__getitem__, key=str) == ["a", "b", "a"]
    assert find_cycle(["a"], diamond.__getitem__, key=str) is None
    assert find_cycle([0], lambda i: [i + 1] if i < 100_000 else [0], key=int)[-1] == 0


@pytest.mark.parametrize("name", bombs.CHAINS)
def test_every_chain_ten_times_the_crash_depth_is_refused_by_its_depth_without_recursing(name):
    constraint, _ = bombs.BOMBS[name](30_000)  # (100,000 deep: the subprocess test below, refused by its size)
    line = refused(constraint, UNSIZED)  # the walk keeps its own stack: no RecursionError at any depth
    assert "deep" in line and "at most 128" in line, line
    assert "characters" in refused(constraint)  # with the default bounds its size is refused first


@pytest.mark.parametrize("name", bombs.CHAINS)
def test_a_chain_within_the_bound_passes_and_one_past_it_is_refused(name):
    limits = ConstraintLimits(max_depth=40)
    check_constraint(bombs.BOMBS[name](10)[0], limits)
    assert "at most 40" in refused(bombs.BOMBS[name](200)[0], limits)


def test_what_is_not_a_chain_passes():
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    check_constraint(Constraint("json_schema", json.dumps(tree)), ConstraintLimits())  # recursion through a value
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    check_constraint(Constraint("json_schema", json.dumps(wide)), ConstraintLimits())  # wide, not deep
    check_constraint(Constraint("grammar", 'start: item+\nitem: "a" | "(" start ")"'), ConstraintLimits())
    check_constraint(Constraint("regex", r"[(\[]{2}\((a|b){3,5}\)\{1,2\}"), ConstraintLimits())


def test_each_other_bound_is_one_line_naming_it():
    limits = ConstraintLimits()
    assert "a cycle that never nests a value" in refused(bombs.alias_cycle(2)[0])
    allof_cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}}
    assert "cycle" in refused(Constraint("json_schema", json.dumps(allof_cycle)))
    assert "1025 alternatives" in refused(bombs.alternatives(1025)[0])
    any_of = {"anyOf": [{"const": i} for i in range(2000)]}
    assert "2000 branches" in refused(Constraint("json_schema", json.dumps(any_of)))
    assert "characters" in refused(bombs.long_literal(10_000)[0])
    assert "at most 131072" in refused(Constraint("grammar", 'start: "' + "x" * 140_000 + '"'))
    assert "repeats 1000000 times" in refused(bombs.repetition(1000)[0])
    assert "repeats" in refused(Constraint("grammar", "start: /(a{200}){200}/"))
    schema_pattern = {"type": "string", "pattern": "((((x{50}){50}){50}))"}
    assert "'pattern'" in refused(Constraint("json_schema", json.dumps(schema_pattern)))
    assert "lone surrogate (U+D800)" in refused(Constraint("regex", "ab\ud800"))
    assert "lone surrogate" in refused(Constraint("json_schema", '{"const": "\ud800"}'))
    assert "nested too deeply" in refused(Constraint("json_schema", "[" * 100_000 + "]" * 100_000), UNSIZED)
    assert "not valid JSON" in refused(Constraint("json_schema", "{"))
    big_enum = {"enum": list(range(limits.max_nodes + 1))}
    assert "values" in refused(Constraint("json_schema", json.dumps(big_enum)), ConstraintLimits(max_chars=BIG))


# --- compiled for real, in a subprocess --------------------------------------------------------------------------
DEPTHS = (10, 64, 128, 3000, 100_000)


def test_no_bomb_of_any_kind_or_depth_ends_the_process():
    code, records, stderr = run_bombs(",".join(map(str, DEPTHS)), ["all"])
    last = records[-1] if records else None
    assert code == 0, f"the compiler crashed (exit {code}) after {last}: {stderr[-2000:]}"
    assert [(r["depth"], r["bomb"]) for r in records] == [(d, name) for d in DEPTHS for name in bombs.BOMBS]
    for r in records:
        assert r["result"] in ("ok", "refused", "failed"), r
        if r["result"] == "ok":
            assert r["consumed"], r  # the whole answer decoded: every mask on the way computed
        else:
            assert "\n" not in r["line"] and r["line"], r
    results = {(r["depth"], r["bomb"]): r["result"] for r in records}
    assert {name: results[10, name] for name in bombs.BOMBS} == {**dict.fromkeys(bombs.BOMBS, "ok"), "cycle": "refused"}
    assert {results[depth, name] for depth in (3000, 100_000) for name in bombs.CHAINS} == {"refused"}


def test_the_harness_sees_a_crash_when_the_bounds_are_lifted():
    """Without the bounds a 3,000-deep property chain ends the compiling process (llguidance 1.9.1), which is why the
    bounds exist; should a later llguidance survive it, this fails, and the bounds can be relaxed."""
    code, records, _ = run_bombs("3000", ["prop"], "--no-bounds")
    assert code == -11 and not records, (code, records)
