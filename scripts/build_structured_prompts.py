"""Build the bench's structured-output prompts (src/verispec/bench/data/structured.jsonl): answers that must be JSON
valid against a schema given with the prompt (each row's "schema"), decoded under that schema.

    .venv/bin/python scripts/build_structured_prompts.py            # rewrites the file (deterministic)
    .venv/bin/python scripts/build_structured_prompts.py --check    # exits 1 if the shipped file differs

json_extraction: a function of Python's standard library (PSF license; SOURCE.txt beside the file), read with `ast`
from this interpreter's sources, and its signature, the exceptions it raises and a one-line summary asked for as JSON.
function_call: a user's request and a set of tools (JSON schemas written for this file), and the call of the right
tool asked for as JSON {"name", "arguments"}; the schema admits a call of any of the tools. Question ids 300001.. and
400001..; odd ids are the held-out split, as in Spec-Bench.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "verispec" / "bench" / "data" / "structured.jsonl"
MODULES = ("textwrap", "shlex", "statistics", "fnmatch", "posixpath", "base64", "heapq", "bisect", "calendar",
           "html", "string", "difflib", "colorsys", "ipaddress", "mimetypes", "email.utils", "urllib.parse")
PER_CATEGORY = 20

SIGNATURE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "parameters", "raises", "summary"],
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "default"],
            "properties": {"name": {"type": "string"}, "default": {"type": ["string", "null"]}}}},
        "raises": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string", "maxLength": 200},
    },
}
EXTRACT = ("Read this Python function and describe it as JSON with these keys: \"name\" (the function's name), "
           "\"parameters\" (one object per parameter with its \"name\" and its \"default\" as source text, or null "
           "where it has none), \"raises\" (the names of the exceptions it raises itself) and \"summary\" (what it "
           "does, in one sentence). Reply with the JSON only.\n\n```python\n{source}```")


def _string(description: str, **more) -> dict:
    return {"type": "string", "description": description, **more}


TOOLS = {
    "get_weather": ({"city": _string("city name"), "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    "send_email": ({"to": {"type": "array", "items": _string("address")}, "subject": _string("subject line"),
                    "body": _string("message text")}, ["to", "subject", "body"]),
    "create_event": ({"title": _string("event title"), "date": _string("YYYY-MM-DD", pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$"),
                      "start": _string("HH:MM", pattern="^[0-9]{2}:[0-9]{2}$"),
                      "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600},
                      "attendees": {"type": "array", "items": _string("name")}},
                     ["title", "date", "start", "duration_minutes", "attendees"]),
    "search_files": ({"pattern": _string("glob pattern"), "directory": _string("where to look"),
                      "recursive": {"type": "boolean"}}, ["pattern", "directory", "recursive"]),
    "convert_units": ({"value": {"type": "number"}, "from_unit": _string("unit of value"),
                       "to_unit": _string("unit wanted")}, ["value", "from_unit", "to_unit"]),
    "set_reminder": ({"text": _string("what to remember"), "minutes_from_now": {"type": "integer", "minimum": 1}},
                     ["text", "minutes_from_now"]),
    "translate": ({"text": _string("text to translate"), "target_language": _string("language name")},
                  ["text", "target_language"]),
    "run_sql": ({"query": _string("one SQL statement"), "database": {"enum": ["sales", "inventory", "staff"]}},
                ["query", "database"]),
}
REQUESTS = (
    "What's the weather like in Lisbon right now? Give it to me in celsius.",
    "Email Priya and Tom (priya@example.com, tom@example.com) that the design review moves to Thursday, subject "
    "'Design review moved'.",
    "Book a 45 minute meeting called 'Budget sync' on 2025-03-14 at 10:30 with Ana and Luis.",
    "Find every .csv file under /data/exports, including subfolders.",
    "How many kilometres is 26.2 miles?",
    "Remind me to call the dentist in 90 minutes.",
    "Translate 'Where is the train station?' into German.",
    "From the sales database, list the ten largest orders of 2024 with their customer names.",
    "Is it going to be hot in Phoenix today? Fahrenheit please.",
    "Send a note to ops@example.com with subject 'Disk alert' saying that server db-3 is at 91% disk usage.",
    "Put 'Quarterly planning' in my calendar for 2025-04-02 at 09:00 for two hours with the whole leads team: "
    "Mei, Omar and Sven.",
    "Look for config files named *.toml in ~/projects, but only at the top level.",
    "Convert 350 degrees fahrenheit to celsius.",
    "In 15 minutes remind me to take the laundry out.",
    "How do you say 'thank you for your patience' in Japanese?",
    "How many items in the inventory database have fewer than five units in stock?",
    "Tell me the weather in Nairobi in fahrenheit.",
    "Write to hr@example.com, subject 'Leave request', asking for leave from May 5 to May 9.",
    "Schedule a 30 minute 'Interview: backend role' on 2025-06-20 at 14:00 with Dana.",
    "Which staff joined after 2023? Query the staff database for their names and start dates.",
)
CALL = ("You can call one of these tools. Reply with the call of the right tool for the user's request, as JSON "
        "{{\"name\": ..., \"arguments\": {{...}}}}, and nothing else.\n\nTools:\n{tools}\n\nUser: {request}")


def call_schema() -> dict:
    """Any tool's call: {"name": the tool, "arguments": its parameters}."""
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": name},
                                      "arguments": {"type": "object", "additionalProperties": False,
                                                    "properties": props, "required": required}}}
                      for name, (props, required) in TOOLS.items()]}


def tool_list() -> str:
    return "\n".join(json.dumps({"name": name, "parameters": {"type": "object", "properties": props,
                                                              "required": required}})
                     for name, (props, required) in TOOLS.items())


def functions() -> list[tuple[str, str]]:
    """(module, source) of functions of 8-40 lines in MODULES, module order, at most two per module."""
    found = []
    for name in MODULES:
        source = inspect.getsource(importlib.import_module(name))
        taken = 0
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 40 and taken < 2:
                segment = textwrap.dedent(ast.get_source_segment(source, node, padded=True))
                if "\t" not in segment and not node.name.startswith("_"):
                    found.append((name, segment))
                    taken += 1
    return found


def rows() -> list[dict]:
    out = []
    for i, (module, source) in enumerate(functions()[:PER_CATEGORY], start=1):
        out.append({"question_id": 300000 + i, "category": "json_extraction", "turns": [EXTRACT.format(source=source)],
                    "schema": SIGNATURE_SCHEMA, "source": f"{module} (Python {sys.version_info[0]}.{sys.version_info[1]})"})
    tools, schema = tool_list(), call_schema()
    for i, request in enumerate(REQUESTS[:PER_CATEGORY], start=1):
        out.append({"question_id": 400000 + i, "category": "function_call",
                    "turns": [CALL.format(tools=tools, request=request)], "schema": schema, "source": "verispec"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args()
    text = "".join(json.dumps(row) + "\n" for row in rows())
    if args.check:
        same = OUT.read_text() == text
        print("structured.jsonl is up to date" if same else "structured.jsonl differs from what this script builds")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
