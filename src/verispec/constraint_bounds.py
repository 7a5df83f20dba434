"""What compiling a constraint would cost, measured before it is compiled, in pure Python and without recursion.

The grammar compiler under structured output (llguidance) recurses natively over chains of rules and references, and
a chain a few thousand deep overflows the stack of the thread that compiles it: the process ends with SIGSEGV, every
request in flight with it. Plain nesting is refused by the compiler itself (its JSON parser stops at 128 levels);
chains built from references are not: `{"$ref": "#/$defs/d0"}` with `d0 -> d1 -> ... -> d3000`, an `allOf` chain, a
property chain, a Lark rule chain `r0: r1`, `r1: r2`, ... and the same in GBNF (converted to Lark first, in pure
Python, in time quadratic in the chain's depth). So each constraint is measured here against `ConstraintLimits` and
refused with one line (`ConstraintError`, a 400 for the server) past them:

- size: the source's characters, each literal's and regex's, the nodes (subschemas, rules), the branches of one
  choice (an enum, an anyOf, a rule's alternatives);
- depth: the longest chain the compiler follows, counted over a graph of the constraint's parts (a subschema and
  what it contains or references; a rule and the rules and terminals it names; a regex's nested groups): the
  longest path once every edge back to a part still being followed (recursion, compiled as a reference to a rule
  already being defined) is dropped. Walked with an explicit stack, so a hostile input cannot overflow ours;
- repetition: the product of nested counted repetitions (`(a{1000}){1000}` is a million: its first mask took 1.2 s);
- cycles that never consume text (`a -> b -> a` through `$ref`s or `allOf`s only) and lone surrogates.

Lark and GBNF are read with a small scanner (strings, regexes, character classes, comments, names, `%json {...}`
blocks, whose schema is measured as one), not a parser: it sees what the compiler will recurse over, and leaves the
grammar's validity to the compiler.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable

from verispec.config import Constraint, ConstraintLimits
from verispec.errors import ConstraintError

_SURROGATE = re.compile("[\ud800-\udfff]")
_KIND = {"json_schema": "JSON schema", "json_object": "JSON", "regex": "regex", "grammar": "grammar"}

# JSON Schema keywords whose value is one subschema, a list of them, or a map of name -> subschema. Subschemas reached
# through PRODUCTIVE keywords sit inside a nested JSON value (an object's property, an array's item): a cycle through
# one of them is recursion that consumes text (a tree of nodes); a cycle through the others only never ends.
_ONE = ("not", "if", "then", "else", "items", "additionalItems", "additionalProperties", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_PRODUCTIVE = {"items", "additionalItems", "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties", "prefixItems", "properties", "patternProperties"}
_CHOICES = ("anyOf", "oneOf")  # (an enum is one lexeme to the compiler: its values count as nodes)


def check_constraint(constraint: Constraint, limits: ConstraintLimits) -> None:
    """Raise a ConstraintError naming the first bound `constraint` passes (see the module doc); return if none."""
    kind, source = constraint.kind, constraint.source
    what = _KIND[kind]
    if len(source) > limits.max_chars:
        raise ConstraintError(f"the {what} has {len(source)} characters; this server takes at most {limits.max_chars}")
    found = _SURROGATE.search(source)
    if found:
        raise ConstraintError(f"the {what} holds a lone surrogate (U+{ord(found.group()):04X}) at character "
                              f"{found.start()}: not valid Unicode text")
    if kind == "json_schema":
        check_schema(_load_json(source, "JSON schema"), limits)
    elif kind == "regex":
        check_regex(source, limits, "the regex")
    elif kind == "grammar":
        check_grammar(source, limits)


# --- the shared measure: the longest path of a graph, back edges dropped ---------------------------------------------
_END = object()


def longest_chain(roots: Iterable, successors: Callable[[object], list], weight: Callable[[object], int],
                  key: Callable[[object], object] = id) -> int:
    """The heaviest path from any root (each node counted `weight(node)`), an edge to a node still on the path being
    dropped (recursion). Iterative: no Python recursion whatever the depth.

    Example: a -> b -> c -> a, weights 1: the edge c -> a is dropped and the answer is 3."""
    height: dict = {}
    for root in roots:
        if key(root) in height:
            continue
        on_path = {key(root)}
        stack = [[root, iter(successors(root)), 0]]  # [node, its successors left, its heaviest successor so far]
        while stack:
            frame = stack[-1]
            child = next(frame[1], _END)
            if child is _END:  # every successor seen: the node's height is known
                stack.pop()
                on_path.discard(key(frame[0]))
                height[key(frame[0])] = frame[2] + weight(frame[0])
                if stack:
                    stack[-1][2] = max(stack[-1][2], height[key(frame[0])])
            elif key(child) in height:
                frame[2] = max(frame[2], height[key(child)])
            elif key(child) not in on_path:
                on_path.add(key(child))
                stack.append([child, iter(successors(child)), 0])
    return max(height.values(), default=0)


def find_cycle(roots: Iterable, successors: Callable[[object], list], key: Callable[[object], object] = id) -> list | None:
    """A cycle reachable from the roots (its nodes in order, the first repeated at the end), or None. Iterative."""
    done: set = set()
    for root in roots:
        if key(root) in done:
            continue
        path, on_path = [root], {key(root)}
        stack = [iter(successors(root))]
        while stack:
            child = next(stack[-1], _END)
            if child is _END:
                stack.pop()
                on_path.discard(key(path[-1]))
                done.add(key(path.pop()))
            elif key(child) in on_path:
                keys = [key(n) for n in path]
                return path[keys.index(key(child)):] + [child]
            elif key(child) not in done:
                path.append(child)
                on_path.add(key(child))
                stack.append(iter(successors(child)))
    return None


# --- JSON schemas ----------------------------------------------------------------------------------------------------
def _load_json(source: str, what: str):
    try:
        return json.loads(source)
    except RecursionError:
        raise ConstraintError(f"the {what} is nested too deeply to read") from None
    except json.JSONDecodeError as err:
        raise ConstraintError(f"the {what} is not valid JSON: {err}") from None


def _pointer(root, ref: str):
    """The subschema a local `$ref` ("#", "#/$defs/a", "#/properties/x/items") points at, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Schema:
    """A JSON schema as a graph: a node per subschema (a dict or a boolean position), edges to what it contains
    (`productive` or not) and to what its `$ref` points at."""

    def __init__(self, root, limits: ConstraintLimits) -> None:
        self.root, self.limits = root, limits
        self.edges: dict[int, list[tuple[object, bool]]] = {}  # id(node) -> [(subschema, productive)]
        self.nodes: list = []
        self._walk()

    def _walk(self) -> None:
        limits, todo, seen = self.limits, [self.root], set()
        while todo:
            node = todo.pop()
            if id(node) in seen or not isinstance(node, dict):
                continue
            seen.add(id(node))
            self.nodes.append(node)
            if len(self.nodes) > limits.max_nodes:
                raise ConstraintError(f"the JSON schema has more than {limits.max_nodes} subschemas")
            out: list[tuple[object, bool]] = []
            for name, value in node.items():
                if name in _ONE:
                    out.append((value, name in _PRODUCTIVE))
                elif name in _LIST and isinstance(value, list):
                    out += [(v, name in _PRODUCTIVE) for v in value]
                elif name in _MAP and isinstance(value, dict):
                    out += [(v, name in _PRODUCTIVE) for v in value.values()]
                elif name == "$ref" and isinstance(value, str):
                    target = _pointer(self.root, value)
                    if target is not None:
                        out.append((target, False))
                elif name == "pattern" and isinstance(value, str):
                    check_regex(value, limits, "a 'pattern' of the JSON schema")
                if name in _CHOICES and isinstance(value, list) and len(value) > limits.max_alternatives:
                    raise ConstraintError(f"a '{name}' of the JSON schema has {len(value)} branches; this server takes "
                                          f"at most {limits.max_alternatives}")
                if name == "enum" and isinstance(value, list) and len(value) > limits.max_nodes:
                    raise ConstraintError(f"an 'enum' of the JSON schema has {len(value)} values; this server takes at "
                                          f"most {limits.max_nodes}")
                if name in ("enum", "const"):
                    _check_literals(value if name == "enum" and isinstance(value, list) else [value], limits)
            self.edges[id(node)] = [(v, p) for v, p in out if isinstance(v, dict)]
            todo += [v for v, _ in out if isinstance(v, dict)]

    def check(self) -> None:
        limits = self.limits
        useless = find_cycle([self.root], lambda n: [v for v, p in self.edges.get(id(n), []) if not p])
        if useless is not None:
            names = " -> ".join(_describe(n) for n in useless)
            raise ConstraintError(f"the JSON schema's references form a cycle that never nests a value ({names}): it "
                                  "describes nothing")
        depth = longest_chain([self.root], lambda n: [v for v, _ in self.edges.get(id(n), [])], lambda _: 1)
        if depth > limits.max_depth:
            raise ConstraintError(f"the JSON schema's subschemas and $refs form a chain {depth} deep; this server "
                                  f"takes at most {limits.max_depth}")


def _describe(node) -> str:
    ref = node.get("$ref") if isinstance(node, dict) else None
    return f"$ref {ref}" if isinstance(ref, str) else "{" + ", ".join(list(node)[:3]) + "}"


def _check_literals(values: list, limits: ConstraintLimits) -> None:
    for value in values:
        size = len(value) if isinstance(value, str) else len(json.dumps(value)) if isinstance(value, (dict, list)) else 0
        if size > limits.max_literal_chars:
            raise ConstraintError(f"a literal of the constraint has {size} characters; this server takes at most "
                                  f"{limits.max_literal_chars}")


def check_schema(schema, limits: ConstraintLimits) -> None:
    """A parsed JSON schema against the bounds (a boolean schema or a non-object is left to the compiler)."""
    if isinstance(schema, dict):
        _Schema(schema, limits).check()


# --- regular expressions ---------------------------------------------------------------------------------------------
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_regex(source: str, limits: ConstraintLimits, what: str) -> None:
    """A regex's size, group depth and nested counted repetitions against the bounds."""
    if len(source) > limits.max_literal_chars:
        raise ConstraintError(f"{what} has {len(source)} characters; this server takes at most "
                              f"{limits.max_literal_chars} in one regex")
    frames = [1]  # per open group: the largest repetition product inside it so far
    last = 1  # the product of the atom just closed (a group's, or 1)
    depth = i = 0
    n = len(source)
    while i < n:
        c = source[i]
        if c == "\\":
            i += 2
            if i <= n and source[i - 1] in "pPxu" and i < n and source[i] == "{":  # \p{L}, \x{41}, \u{1F600}
                close = source.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            continue
        if c == "[":
            i = _class_end(source, i)
            last = 1
            continue
        if c == "(":
            frames.append(1)
            depth += 1
            if depth > limits.max_depth:
                raise ConstraintError(f"{what} nests groups {depth} deep; this server takes at most {limits.max_depth}")
        elif c == ")" and len(frames) > 1:
            last = frames.pop()
            depth -= 1
            frames[-1] = max(frames[-1], last)
            i += 1
            continue
        elif c == "{":
            count = _COUNT.match(source, i)
            if count:
                times = max(int(count.group(1)), int(count.group(2) or 0))
                product = last * max(times, 1)
                if product > limits.max_repetition:
                    raise ConstraintError(f"{what} repeats {product} times in all (nested counted repetitions); this "
                                          f"server takes at most {limits.max_repetition}")
                frames[-1] = max(frames[-1], product)
                i = count.end()
                last = 1
                continue
        last = 1
        i += 1


def _class_end(source: str, start: int) -> int:
    """The index after the character class opening at `start` (escapes and a leading ']' inside it)."""
    i = start + 1
    if i < len(source) and source[i] == "^":
        i += 1
    if i < len(source) and source[i] == "]":
        i += 1
    while i < len(source) and source[i] != "]":
        i += 2 if source[i] == "\\" else 1
    return i + 1


# --- grammars (Lark as llguidance reads it, and GBNF) ----------------------------------------------------------------
_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z_0-9-]*)[ \t]*::=", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9-]*")


def check_grammar(source: str, limits: ConstraintLimits) -> None:
    """A Lark or GBNF grammar's rules against the bounds: their count, each one's alternatives and literals, the
    longest chain of references (and of nested groups), and the schemas of `%json` blocks."""
    gbnf = "::=" in source
    rules = _split_rules(source, _GBNF_RULE if gbnf else _LARK_RULE)
    if len(rules) > limits.max_nodes:
        raise ConstraintError(f"the grammar has {len(rules)} rules; this server takes at most {limits.max_nodes}")
    refs: dict[str, list[str]] = {}
    weight: dict[str, int] = {}
    for name, body in rules.items():
        scan = _scan_body(body, gbnf, limits)
        if scan.alternatives > limits.max_alternatives:
            raise ConstraintError(f"the grammar's rule '{name}' has {scan.alternatives} alternatives; this server takes "
                                  f"at most {limits.max_alternatives}")
        refs[name] = [r for r in scan.names if r in rules]
        weight[name] = 1 + max(scan.nesting, scan.embedded)
    depth = longest_chain(list(rules), lambda r: refs[r], lambda r: weight[r], key=lambda r: r)
    if depth > limits.max_depth:
        raise ConstraintError(f"the grammar's rules reference each other in a chain {depth} deep; this server takes "
                              f"at most {limits.max_depth}")


def _split_rules(source: str, head: re.Pattern) -> dict[str, str]:
    """name -> body (a rule defined twice keeps both bodies), comments and directives outside any body ignored."""
    starts = list(head.finditer(source))
    rules: dict[str, str] = {}
    for m, after in zip(starts, [*starts[1:], None]):
        body = source[m.end() : after.start() if after is not None else len(source)]
        rules[m.group(1)] = rules.get(m.group(1), "") + "\n" + body
    return rules


class _Body:
    """What the scanner found in one rule's body."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.alternatives = 1
        self.nesting = 0  # deepest group nesting
        self.embedded = 0  # deepest %json schema


def _scan_body(body: str, gbnf: bool, limits: ConstraintLimits) -> _Body:
    out, depth, i, n = _Body(), 0, 0, len(body)
    while i < n:
        c = body[i]
        if c == '"' or (c == "'" and gbnf):
            end = _string_end(body, i)
            if end - i - 2 > limits.max_literal_chars:
                raise ConstraintError(f"a literal of the grammar has {end - i - 2} characters; this server takes at "
                                      f"most {limits.max_literal_chars}")
            i = end
        elif c == "/" and not gbnf and i + 1 < n and body[i + 1] == "/":  # a Lark comment
            i = _line_end(body, i)
        elif c == "#" and gbnf:
            i = _line_end(body, i)
        elif c == "/" and not gbnf:  # a Lark regex /.../flags
            end = _regex_end(body, i)
            check_regex(body[i + 1 : end - 1], limits, "a regex of the grammar")
            i = end
        elif c == "[" and gbnf:  # a GBNF character class
            i = _class_end(body, i)
        elif c == "%" and body.startswith("%json", i):
            i = _json_block(body, i + 5, out, limits)
        elif c in "([":
            depth += 1
            out.nesting = max(out.nesting, depth)
            i += 1
        elif c in ")]":
            depth = max(depth - 1, 0)
            i += 1
        elif c == "|":
            out.alternatives += 1
            i += 1
        elif c == "{" and gbnf:
            count = _COUNT.match(body, i)
            if count and max(int(count.group(1)), int(count.group(2) or 0)) > limits.max_repetition:
                raise ConstraintError(f"a repetition of the grammar is {count.group()} times; this server takes at "
                                      f"most {limits.max_repetition}")
            i = count.end() if count else i + 1
        else:
            name = _NAME.match(body, i)
            if name:
                out.names.append(name.group())
                i = name.end()
            else:
                i += 1
    return out


def _string_end(body: str, start: int) -> int:
    quote, i = body[start], start + 1
    while i < len(body) and body[i] != quote:
        i += 2 if body[i] == "\\" else 1
    return i + 1


def _regex_end(body: str, start: int) -> int:
    i = start + 1
    while i < len(body) and body[i] not in "/\n":
        if body[i] == "\\":
            i += 2
        elif body[i] == "[":
            i = _class_end(body, i)
        else:
            i += 1
    return i + 1


def _line_end(body: str, start: int) -> int:
    end = body.find("\n", start)
    return len(body) if end < 0 else end


def _json_block(body: str, start: int, out: _Body, limits: ConstraintLimits) -> int:
    """Measure the schema of a `%json { ... }` block starting after `%json`; return the index after it."""
    i = start
    while i < len(body) and body[i].isspace():
        i += 1
    if i >= len(body) or body[i] != "{":
        return i
    try:
        schema, end = json.JSONDecoder().raw_decode(body, i)
    except RecursionError:
        raise ConstraintError("a %json schema of the grammar is nested too deeply to read") from None
    except json.JSONDecodeError as err:
        raise ConstraintError(f"a %json schema of the grammar is not valid JSON: {err}") from None
    if isinstance(schema, dict):
        graph = _Schema(schema, limits)
        graph.check()
        out.embedded = max(out.embedded, longest_chain([schema], lambda s: [v for v, _ in graph.edges.get(id(s), [])],
                                                       lambda _: 1))
    return end
