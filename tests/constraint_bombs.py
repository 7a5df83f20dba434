"""Constraints built to crash or stall a grammar compiler, of every kind the server takes, at any depth.

Each bomb is (name, depth) -> `Constraint`, with the valid answer of depth `depth` where one is easy to write (to
decode through the whole chain). Run as a script, it compiles the bombs named on its command line in this process,
on the main thread (an 8 MiB stack), and prints one JSON line per bomb: "ok" with the answer consumed, or "refused"
with the line; a crash ends the process, which is what the tests look for from outside.

    python tests/constraint_bombs.py 64,128 ref prop gbnf ...   # depths, then bomb names ("all": every one)
    python tests/constraint_bombs.py 3000 prop --no-bounds      # bounds lifted: the compiler's own behaviour
"""

from __future__ import annotations

import json
import string
import sys

from verispec.config import Constraint

JSON_CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


def _defs_schema(defs: dict, n: int) -> str:
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def ref_chain(n: int) -> tuple[Constraint, str]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return Constraint("json_schema", _defs_schema(defs, n)), "7"


def allof_chain(n: int) -> tuple[Constraint, str]:
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return Constraint("json_schema", _defs_schema(defs, n)), "7"


def property_chain(n: int) -> tuple[Constraint, str]:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"],
                      "additionalProperties": False} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return Constraint("json_schema", _defs_schema(defs, n)), '{"a": ' * n + "7" + "}" * n


def alias_cycle(n: int) -> tuple[Constraint, str | None]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % max(n, 2)}"} for i in range(max(n, 2))}
    return Constraint("json_schema", _defs_schema(defs, n)), None


def lark_rule_chain(n: int) -> tuple[Constraint, str]:
    rules = [f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "x"']
    return Constraint("grammar", "start: r0\n" + "\n".join(rules)), "x"


def lark_terminal_chain(n: int) -> tuple[Constraint, str]:
    rules = [f"T{i}: T{i + 1}" for i in range(n)] + [f'T{n}: "x"']
    return Constraint("grammar", "start: T0\n" + "\n".join(rules)), "x"


def lark_json_chain(n: int) -> tuple[Constraint, str]:
    """A Lark grammar whose %json block holds a property chain."""
    schema, answer = property_chain(n)
    return Constraint("grammar", f"start: %json {schema.source}"), answer


def gbnf_chain(n: int) -> tuple[Constraint, str]:
    rules = [f"r{i} ::= r{i + 1}" for i in range(n)] + [f'r{n} ::= "x"']
    return Constraint("grammar", "root ::= r0\n" + "\n".join(rules)), "x"


def regex_groups(n: int) -> tuple[Constraint, str]:
    return Constraint("regex", "(" * n + "x" + ")" * n), "x"


def alternatives(n: int) -> tuple[Constraint, str]:
    return Constraint("grammar", "start: " + " | ".join(f'"a{i}"' for i in range(n))), "a0"


def long_literal(n: int) -> tuple[Constraint, str]:
    return Constraint("grammar", 'start: "' + "x" * n + '"'), "x" * n


def repetition(n: int) -> tuple[Constraint, str | None]:
    return Constraint("regex", "(x{%d}){%d}" % (n, n)), "x" * (n * n) if n <= 100 else None


BOMBS = {"ref": ref_chain, "allof": allof_chain, "prop": property_chain, "cycle": alias_cycle, "lark": lark_rule_chain,
         "terminal": lark_terminal_chain, "lark-json": lark_json_chain, "gbnf": gbnf_chain, "regex": regex_groups,
         "alternatives": alternatives, "literal": long_literal, "repetition": repetition}
CHAINS = ("ref", "allof", "prop", "lark", "terminal", "lark-json", "gbnf", "regex")  # the kinds that nest by depth


def grammars(no_bounds: bool = False):
    """A Grammars over a character tokenizer that can spell JSON (bounds lifted with `no_bounds`)."""
    from tiny_hf import char_tokenizer

    from verispec.config import ConstraintLimits
    from verispec.constraints import Grammars

    tokenizer = char_tokenizer(chat=False, chars=JSON_CHARS)
    big = 10**9
    limits = (ConstraintLimits(max_chars=big, max_depth=big, max_nodes=big, max_alternatives=big, max_literal_chars=big,
                               max_repetition=big, mask_ms_per_step=1e9) if no_bounds else
              ConstraintLimits(mask_ms_per_step=1e9))
    return Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id, limits), tokenizer


def main(argv: list[str]) -> None:
    from verispec.errors import ConstraintError

    depths, names = [int(d) for d in argv[0].split(",")], [a for a in argv[1:] if not a.startswith("--")]
    names = list(BOMBS) if names == ["all"] else names
    compiler, tokenizer = grammars("--no-bounds" in argv)
    for depth, name in ((d, n) for d in depths for n in names):
        constraint, answer = BOMBS[name](depth)
        try:
            state = compiler.start(constraint)
        except ConstraintError as err:
            print(json.dumps({"bomb": name, "depth": depth, "result": "refused", "line": str(err)}), flush=True)
            continue
        consumed = True
        try:
            if answer is not None:  # decode through the whole chain: every mask on the way
                for token in tokenizer.encode(answer, add_special_tokens=False):
                    if not bool(state.allowed()[token]):
                        consumed = False
                        break
                    state.advance([token])
        except ConstraintError as err:  # a limit of the compiler's own, met while decoding: the row's 400
            print(json.dumps({"bomb": name, "depth": depth, "result": "failed", "line": str(err)}), flush=True)
            continue
        print(json.dumps({"bomb": name, "depth": depth, "result": "ok", "consumed": consumed}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    main(sys.argv[1:])
