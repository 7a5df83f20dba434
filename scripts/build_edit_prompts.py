"""Build the bench's code-editing and agent-loop prompts (src/verispec/bench/data/editing.jsonl), the workloads
where an answer copies most of its prompt: an edit returns the function it was given, changed in one place; an
agent's next tool call repeats paths, lines and calls from the transcript before it.

    .venv/bin/python scripts/build_edit_prompts.py            # rewrites the file (deterministic)
    .venv/bin/python scripts/build_edit_prompts.py --check    # exits 1 if the shipped file differs

Both are built from functions of Python's standard library (PSF license; SOURCE.txt beside the file), read with
`ast` from this interpreter's sources: functions of 10 to 45 lines, in module order. code_editing asks for one
edit (rename a local variable, add type hints, a docstring, a guard or a debug log) and the whole function back;
agent gives a coding agent's transcript (the file read, a failing test whose traceback points at a bug put into
one comparison, an earlier edit that did not help) and asks for the next tool call as JSON. Question ids:
100001.. for code_editing, 200001.. for agent; odd ids are the held-out split, as in Spec-Bench.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "verispec" / "bench" / "data" / "editing.jsonl"
MODULES = ("textwrap", "statistics", "fractions", "difflib", "shlex", "calendar", "heapq", "bisect", "colorsys",
           "html", "ipaddress", "string", "fnmatch", "posixpath", "csv", "base64", "gettext", "tokenize",
           "configparser", "argparse", "pprint", "mimetypes", "zipfile", "tarfile", "email.utils", "urllib.parse")
PER_CATEGORY = 40
EDITS = (
    "Rename the local variable `{var}` to `{new}` everywhere in this function. Reply with the complete updated "
    "function only.",
    "Add type hints to every parameter and to the return value of this function. Reply with the complete function "
    "only.",
    "Give this function a Google-style docstring (Args, Returns), replacing any docstring it has. Reply with the "
    "complete function only.",
    "Make this function raise `TypeError` with a clear message when its first parameter is None, before anything "
    "else. Reply with the complete function only.",
    "Add a `logger.debug(...)` call as the first statement of this function that logs its arguments. Reply with "
    "the complete function only.",
)
FLIPS = {ast.Lt: ("<", "<="), ast.Gt: (">", ">="), ast.LtE: ("<=", "<"), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="),
         ast.NotEq: ("!=", "==")}


def functions() -> list[tuple[str, str, ast.FunctionDef]]:
    """(module, source, node) for each function of 10-45 lines in MODULES, in module order."""
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        source = inspect.getsource(module)
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 10 <= node.end_lineno - node.lineno + 1 <= 45:
                segment = textwrap.dedent(ast.get_source_segment(source, node, padded=True))
                if "\t" not in segment:
                    found.append((name, segment, ast.parse(segment).body[0]))
    return found


def local_names(node: ast.FunctionDef) -> list[str]:
    params = {a.arg for a in node.args.args + node.args.kwonlyargs}
    stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(n for n in stored - params if len(n) >= 2 and not n.startswith("_"))


def code_editing(found, rng: random.Random) -> list[dict]:
    rows = []
    for module, source, node in found:
        if len(rows) == PER_CATEGORY:
            break
        kind = len(rows) % len(EDITS)
        names = local_names(node)
        if kind == 0 and not names:
            continue
        var = rng.choice(names) if names else ""
        ask = EDITS[kind].format(var=var, new=f"{var}_value")
        text = f"{ask}\n\n```python\n{source.rstrip()}\n```"
        rows.append({"question_id": 100001 + len(rows), "category": "code_editing", "turns": [text],
                     "source": f"{module}.{node.name}"})
    return rows


def with_bug(source: str, node: ast.FunctionDef) -> tuple[str, int, str, str] | None:
    """The source with its last comparison flipped (< to <=, == to !=, ...): (buggy source, line number in it,
    the buggy line, the line as it was)."""
    compares = [c for c in ast.walk(node) if isinstance(c, ast.Compare) and len(c.ops) == 1 and type(c.ops[0]) in FLIPS]
    lines = source.splitlines()
    for compare in sorted(compares, key=lambda c: -c.lineno):
        old, new = FLIPS[type(compare.ops[0])]
        line = lines[compare.lineno - 1]
        if line.count(f" {old} ") == 1 and compare.lineno == compare.end_lineno:
            buggy = line.replace(f" {old} ", f" {new} ")
            return "\n".join(lines[: compare.lineno - 1] + [buggy] + lines[compare.lineno :]), compare.lineno, buggy, line
    return None


def agent(found, rng: random.Random) -> list[dict]:
    rows = []
    for module, source, node in found[::-1]:  # from the other end: other functions than code_editing's first ones
        if len(rows) == PER_CATEGORY:
            break
        bug = with_bug(source, node)
        if bug is None:
            continue
        buggy, line_no, buggy_line, _ = bug
        path = f"lib/{module.replace('.', '/')}.py"
        test = f"tests/test_{module.split('.')[-1]}.py"
        other = rng.choice([i for i, text in enumerate(buggy.splitlines()) if text.strip() and i + 1 != line_no])
        other_line = buggy.splitlines()[other]
        transcript = (
            "You are a coding agent working in a repository. Tools: read_file(path), run_tests(path), "
            "edit_file(path, old, new). Reply with tool calls as JSON, one object per line: "
            '{"tool": ..., "args": {...}}.\n\n'
            f'Step 1: {{"tool": "read_file", "args": {{"path": "{path}"}}}}\nResult:\n```python\n{buggy.rstrip()}\n```\n\n'
            f'Step 2: {{"tool": "run_tests", "args": {{"path": "{test}"}}}}\nResult:\n'
            f"FAILED {test}::test_{node.name} - AssertionError\n"
            f'  File "{path}", line {line_no}, in {node.name}\n    {buggy_line.strip()}\n\n'
            f'Step 3: {json.dumps({"tool": "edit_file", "args": {"path": path, "old": other_line.strip(), "new": other_line.strip() + "  # checked"}})}\n'
            f"Result: edited; {test}::test_{node.name} still fails at line {line_no}\n\n"
            f"Step 4: undo step 3 and fix the comparison on line {line_no} that the test points at. Reply with the "
            "edit_file calls, one JSON object per line."
        )
        rows.append({"question_id": 200001 + len(rows), "category": "agent", "turns": [transcript],
                     "source": f"{module}.{node.name}"})
    return rows


def build() -> str:
    found = functions()
    rng = random.Random(0)
    rows = code_editing(found, rng) + agent(found, rng)
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = ap.parse_args()
    text = build()
    if args.check:
        same = OUT.is_file() and OUT.read_text() == text
        print("the shipped prompts match this interpreter's build" if same else
              f"{OUT} differs from this interpreter's build (Python {sys.version.split()[0]})")
        raise SystemExit(0 if same else 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}: {text.count(chr(10))} prompts (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
