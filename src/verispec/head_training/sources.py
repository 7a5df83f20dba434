"""Where the prompts of a head's training corpus come from, all of them on this machine (no hub).

- prompt files: Spec-Bench-style JSONL (Spec-Bench, MT-Bench: only the TRAIN split, even question ids, so the
  bench's held-out prompts never enter a corpus) or text files, one prompt per line;
- prompts the target writes itself (the Magpie recipe, Xu et al. 2024): the target's chat template up to where a
  user's message begins, which an instruct model continues into a plausible request; duplicates and junk
  (too short, too long, mostly non-letters, repetitive) are dropped;
- completion contexts from what ships with Python and its packages: a stretch of a source file cut at a line
  (code), or a docstring's opening (prose), which the target continues as plain text, without a chat template;
- text passages from the same files, whose answer is the file's own next text rather than the target's: nothing to
  decode, so they cost only the prefill that every answer's features need (about 140 tokens a second on 2
  cores, against 38-63 for answering in a batch of 16-48 rows). The labels are still the target's distributions
  at every position; only the tokens the head reads were written by people (EAGLE's first heads trained on fixed
  conversations, not the target's answers).

Every prompt is a `Prompt`: its text, whether the chat template wraps it, its source and category.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from verispec.datasets import TRAIN, load_prompts
from verispec.distill.data import read_text
from verispec.errors import VerispecError

MARK = "\u2063VERISPEC-USER-TURN\u2063"  # a placeholder no real prompt holds


@dataclass(frozen=True)
class Prompt:
    """text: the prompt; chat: wrapped in the target's chat template (False: a completion context, read as is);
    source: "file", "self", "code", "prose" or "text"; category: the file's category, or the source's name (a text
    passage's: code or prose); continuation: see `text_passages`."""

    text: str
    chat: bool
    source: str
    category: str
    continuation: str | None = None  # a text passage's own next text: its answer, read by prefill, never decoded


def file_prompts(path: Path) -> list[Prompt]:
    """Prompts from a Spec-Bench-style JSONL file (its TRAIN split: even question ids) or a text file (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"prompt file not found: {path}")
    if path.suffix == ".jsonl":
        rows = load_prompts(path, split=TRAIN)  # Spec-Bench's split by question id (MT-Bench's ids are its first 80)
        prompts = [Prompt(p.text, True, "file", p.category) for p in rows]
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise VerispecError(f"cannot read prompts from {path}: {err}") from None
        prompts = [Prompt(line.strip(), True, "file", "text") for line in lines if line.strip()]
    if not prompts:
        raise VerispecError(f"no prompts in {path}")
    return prompts


def user_turn_prefix(tokenizer) -> tuple[str, str]:
    """(prefix, end): the chat template's text before a user's message begins, and what follows the message's end
    (where a written prompt stops). Raises VerispecError for a tokenizer without a chat template."""
    from verispec.chat import has_chat_template

    if not has_chat_template(tokenizer):
        raise VerispecError("the target has no chat template: it cannot write prompts of its own (--self-prompts)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if MARK not in text:
        raise VerispecError("the target's chat template does not show the user's message: --self-prompts cannot use it")
    prefix, end = text.split(MARK, 1)
    return prefix, end.strip() or end


def usable(text: str, min_chars: int = 16, max_chars: int = 1500) -> bool:
    """Whether a written prompt is worth answering: long enough, not too long, mostly words, not repetitive."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars or "<|" in text or MARK in text:
        return False
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "")):
        return False
    raw = text.encode("utf-8")
    return len(zlib.compress(raw)) / len(raw) > 0.25 or len(raw) < 80  # a loop compresses to almost nothing


_SPEAKER = re.compile(r"^\W{0,3}(?:q|question|user|human|qwen|prompt|request)\W{0,3}\s*[:\uff1a]\W{0,3}\s*", re.I)
_ANSWER = re.compile(r"\n\s*\W{0,3}(?:a|answer|assistant|response|solution)\W{0,3}\s*[:\uff1a]", re.I)


def request_text(text: str) -> str:
    """A written prompt as a request: a speaker's label before it ("Q:", "User:", "**Question:**") dropped, and
    an answer the target went on to write itself (a line beginning "A:", "Answer:", ...) cut off. Choices
    ("A. ...") stay: they belong to the question."""
    text = _SPEAKER.sub("", text.strip(), count=1)
    found = _ANSWER.search(text)
    return (text[: found.start()] if found else text).strip()


def normalized(text: str) -> str:
    """The form duplicates are compared in: lower case, whitespace collapsed."""
    return re.sub(r"\s+", " ", text.strip().lower())


def python_files(roots: list[Path] | None = None, max_bytes: int = 200_000) -> list[Path]:
    """Python sources shipped with Python and its installed packages, sorted (verispec's own left out)."""
    paths = sysconfig.get_paths()
    roots = roots or sorted({Path(paths["stdlib"]), Path(paths["purelib"])})
    files = []
    for root in roots:
        files += [p for p in Path(root).rglob("*.py") if p.is_file() and 400 <= p.stat().st_size <= max_bytes
                  and "verispec" not in p.parts and "test" not in p.name]
    return sorted(set(files))


def _contexts(files: list[Path], count: int, rng: random.Random, pick) -> list[Prompt]:
    """Up to `count` prompts, at most one per file, the files read in an order `rng` shuffles; `pick(source, rng)`
    makes a file's prompt, or None where it has none."""
    order = list(files)
    rng.shuffle(order)
    out: list[Prompt] = []
    for path in order:
        if len(out) >= count:
            break
        source = read_text(path)
        prompt = pick(source, rng) if source else None
        if prompt is not None:
            out.append(prompt)
    return out


def code_contexts(files: list[Path], count: int, seed: int, max_lines: int = 60) -> list[Prompt]:
    """`count` stretches of source files, each from a top-level definition's start to a line break within it
    (at most `max_lines` lines): the target continues the code."""

    def stretch(source: str, rng: random.Random) -> Prompt | None:
        lines = source.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class ", "async def "))]
        if not starts:
            return None
        start = rng.choice(starts)
        cut = start + rng.randint(2, max_lines)
        text = "\n".join(lines[max(0, start - 5) : cut]) + "\n"
        return Prompt(text, False, "code", "code") if len(text) >= 80 else None

    return _contexts(files, count, random.Random(seed), stretch)


def prose_contexts(files: list[Path], count: int, seed: int) -> list[Prompt]:
    """`count` openings of long docstrings (modules, classes, functions): the target continues the prose."""

    def opening(source: str, rng: random.Random) -> Prompt | None:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return None
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        docs = [d for d in docs if d and len(d) >= 300 and sum(c.isalpha() for c in d) > 0.6 * len(d)]
        if not docs:
            return None
        sentences = re.split(r"(?<=[.!?])\s+", rng.choice(docs))
        text = " ".join(sentences[: max(1, len(sentences) // 3)])
        return Prompt(text + " ", False, "prose", "prose") if len(text) >= 80 else None

    return _contexts(files, count, random.Random(seed + 1), opening)


def doc_files(roots: list[Path] | None = None, max_bytes: int = 200_000) -> list[Path]:
    """Documentation (.md, .rst, .txt) shipped with Python's packages, sorted (verispec's own left out)."""
    roots = roots or [Path(sysconfig.get_paths()["purelib"])]
    files = [p for root in roots for suffix in ("*.md", "*.rst", "*.txt") for p in Path(root).rglob(suffix)
             if p.is_file() and 400 <= p.stat().st_size <= max_bytes and "verispec" not in p.parts]
    return sorted(set(files))


def text_passages(files: list[Path], count: int, seed: int, category: str, context_lines: int = 12,
                  chars: int = 3000) -> list[Prompt]:
    """`count` passages of `category` (code or prose), at most one per file: `context_lines` lines from a random line
    on (the prompt, read as is) and the next `chars` characters of the file (its continuation)."""

    def passage(source: str, rng: random.Random) -> Prompt | None:
        lines = source.splitlines(keepends=True)
        if len(lines) < context_lines + 8:
            return None
        start = rng.randrange(0, len(lines) - context_lines - 7)
        text = "".join(lines[start : start + context_lines])
        rest = "".join(lines[start + context_lines :])[:chars]
        if len(text.strip()) < 40 or len(rest.strip()) < 200 or not usable(rest[:1500]):
            return None
        return Prompt(text, False, "text", category, rest)

    return _contexts(files, count, random.Random(seed + 2 + (category == "prose")), passage)
