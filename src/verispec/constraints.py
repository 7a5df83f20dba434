"""Structured output under exact speculation: a JSON schema, a regex or a grammar constrains the target's p.

Constrained decoding draws each token from the target's distribution restricted to the tokens the constraint allows
after the answer so far, renormalised: the logits of forbidden tokens are set to -inf before the sampling settings
(repetition penalty, temperature, top-k, top-p, min-p) apply, as llama.cpp's grammar sampler and vLLM's structured
output do. Speculation stays exact because the constrained p is just another target distribution, and the verifier
(`verispec.rejection`) is exact for any p and any q:
  - every row of a verification pass (the root and after each draft node) is masked with the constraint's state
    after that node's path (`ConstraintState.node_masks`), so the verifier sees the constrained p everywhere;
  - the drafter's q stays as it was drawn: a draft token the constraint forbids has p = 0 and is rejected, and the
    recovered token comes from the constrained p (no truncation of a sampled draft by its value, which would not be
    exact);
  - tokens the constraint forces (a key name, `": "`, a closing brace) are drafted for free with a one-hot q
    (`ConstraintState.forced`): deterministic drafts, so exact like every lookup; the constrained p puts (nearly)
    all its mass on them, so they are accepted (`verispec.batch`);
  - the state advances over committed tokens only; masks for a draft are computed by consuming its path and rolling
    back, so a rejected draft leaves no trace.

The grammar engine is llguidance: measured on this project's 2-core Xeon with the Qwen2.5 tokenizer (151,936 ids)
and a nested JSON schema, its mask costs 0.016 ms a token (median; 1.7 ms at worst, inside a string) against 0.003 ms
for xgrammar and 6.6 ms for outlines-core (which builds its index over the vocabulary for each schema, 0.22 s). Both
llguidance and xgrammar are far below 5% of a 50 ms decoding step; llguidance ships with no dependencies (xgrammar
needs triton and a torch of its own choosing), reads JSON schemas, regexes, Lark and (converted) GBNF grammars, and
computes forced tokens and rollbacks itself. `benchmarks/structured.py` reproduces the measurement.

What a constraint may cost is bounded (`ConstraintLimits`): before compiling, its size and the chains the compiler
would recurse over are measured (`verispec.constraint_bounds`; llguidance's compiler recurses natively and a chain of
a few thousand references overflows its stack, ending the process); each content is compiled once and copied per
answer; and each answer's mask work per decoding step is timed against a budget (a row over it fails alone).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from verispec.config import Constraint, ConstraintLimits
from verispec.constraint_bounds import check_constraint
from verispec.errors import ConstraintError, VerispecError

if TYPE_CHECKING:
    import llguidance

MAX_FORCED = 32  # forced tokens drafted in one step at most (they widen the target's pass)
# JSON as json.dumps writes it: one space after ':' and ',' and no other whitespace. A free whitespace pattern lets a
# model pad an answer with newlines until its token budget runs out (seen with random weights); fixed separators are
# forced tokens, drafted for free. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)  # (32,)


def _llguidance():
    try:
        import llguidance
    except ImportError as err:  # pragma: no cover - a dependency of the package
        raise VerispecError("structured output needs the llguidance package (pip install llguidance)") from err
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint (not yet checked against a tokenizer)."""
    ll = _llguidance()
    kind, source = constraint.kind, constraint.source
    if kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as err:
            raise ConstraintError(f"the JSON schema is not valid JSON: {err}") from None
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply to read") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema is an object, got {type(schema).__name__}")
        try:
            return ll.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
        except (ValueError, TypeError) as err:
            raise ConstraintError(f"invalid JSON schema: {_first_line(str(err))}") from None
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(source)
    if "::=" in source:  # GBNF, llama.cpp's grammar format
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            source = gbnf_to_lark(source)
        except Exception as err:
            raise ConstraintError(f"invalid GBNF grammar: {_first_line(str(err))}") from None
    return ll.LLMatcher.grammar_from_lark(source)


def _first_line(message: str) -> str:
    """llguidance's errors carry the parser's state after their first line."""
    return message.strip().splitlines()[0] if message.strip() else "no reason given"


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(W,) int32 words, bit j of word w allowing token 32 w + j -> (vocab_size,) bool."""
    return ((bits.unsqueeze(-1) >> _BITS) & 1).bool().view(-1)[:vocab_size]


class Grammars:
    """Compiles constraints against one tokenizer (the target's) into per-sequence states.

    Each constraint is measured against `limits` before it is compiled (`verispec.constraint_bounds`: a chain deep
    enough to overflow the compiler's stack is refused in one line, never compiled) and compiled once per content:
    the compiled matcher, its first mask computed, is kept (the `cache_size` most recent) and every sequence gets a
    copy of it (`LLMatcher.deep_copy`, microseconds).

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        vocab_size: the target's vocabulary (its logits' width; ids past the tokenizer's are never allowed).
        eos_token_id: the token that ends a constrained answer (allowed where the constraint is satisfied).
        limits: the bounds every constraint is checked against, and each state's mask budget per step.
    """

    cache_size = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, limits: ConstraintLimits = ConstraintLimits()) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        ll = _llguidance()
        import llguidance.hf
        try:  # the tokenizer's own pre-tokenizer and decoder, read by llguidance (byte-level BPE, SentencePiece)
            self.lltokenizer: llguidance.LLTokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        except Exception:  # another decoder: each token's bytes from decoding it alone
            try:
                self.lltokenizer = ll.LLTokenizer(ll.TokenizerWrapper(_TokenBytes(tokenizer, eos_token_id)),
                                                  n_vocab=vocab_size, eos_token=eos_token_id)
            except Exception as err:
                raise VerispecError(f"structured output cannot use this tokenizer: {err}") from None
        self._ll = ll
        self._compiled: OrderedDict[tuple[Constraint, ConstraintLimits], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint, limits: ConstraintLimits | None = None):
        """The compiled matcher of `constraint` at the start of an answer (kept; never consume from it: `start` hands
        out copies). Raises a ConstraintError past the bounds, for an invalid constraint, or one that allows no
        output at all. The first call for a content compiles it (and computes its first mask, which for a long
        literal is most of the cost); later ones are a lookup."""
        limits = limits or self.limits
        key = (constraint, limits)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        check_constraint(constraint, limits)
        matcher = self._build(constraint, limits)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def _build(self, constraint: Constraint, limits: ConstraintLimits):
        what = {"json_schema": "JSON schema", "json_object": "JSON", "regex": "regex", "grammar": "grammar"}[constraint.kind]
        try:
            grammar = grammar_text(constraint)
            matcher = self._ll.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=parser_limits(limits))
        except (ValueError, TypeError, UnicodeError) as err:
            raise ConstraintError(f"invalid {what} constraint: {_first_line(str(err))}") from None
        if matcher.is_error():
            raise ConstraintError(f"invalid {what} constraint: {_first_line(matcher.get_error())}")
        state = ConstraintState(matcher, self.vocab_size)
        first = state.allowed().nonzero().view(-1)[:64].tolist()  # (where nothing fits, a mask may hold a stray id)
        if matcher.is_error() or not any(matcher.validate_tokens([t]) == 1 for t in first):
            raise ConstraintError(f"the {constraint.kind.replace('_', ' ')} constraint allows no output with this "
                                  "tokenizer")
        return matcher

    def start(self, constraint: Constraint, limits: ConstraintLimits | None = None) -> ConstraintState:
        """A fresh state at the start of an answer (a copy of the compiled matcher); raises a ConstraintError for a
        constraint past the bounds, an invalid one, or one that allows no output at all."""
        limits = limits or self.limits
        return ConstraintState(self.compile(constraint, limits).deep_copy(), self.vocab_size,
                               limits.mask_ms_per_step / 1000)


def parser_limits(limits: ConstraintLimits):
    """llguidance's own limits for a constraint: the library's defaults (its fuel bounds each mask's work), with the
    grammar's size tied to ours."""
    return _llguidance().LLParserLimits(max_grammar_size=max(500_000, 4 * limits.max_chars))


def grammars_for(tokenizer, vocab_size: int, eos_token_ids: set[int],
                 limits: ConstraintLimits = ConstraintLimits()) -> Grammars:
    """The Grammars of a model's tokenizer; a constrained answer ends with the tokenizer's end-of-sequence token where
    it is one of the model's, else with the smallest of the model's."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return Grammars(tokenizer, vocab_size, eos if eos in eos_token_ids else min(eos_token_ids), limits)


class _TokenBytes:
    """A tokenizer as llguidance's generic wrapper reads it: every id's bytes (decoded alone; a special or added token
    is its name after a 0xff byte, llguidance's mark for tokens no text can produce) and an encoder of text."""

    def __init__(self, tokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        # special: the tokenizer's special tokens and its added ones (Qwen's <tool_call>), as llguidance.hf reads a
        # tokenizer: a grammar names them as tokens (<tool_call>), and text never spells them
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + tokenizer.convert_ids_to_tokens(i).encode("utf-8") if i in special
                       else tokenizer.decode([i]).encode("utf-8") for i in range(len(tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class ConstraintState:
    """One answer's place in its constraint: which tokens may come next, and which are forced.

    Advanced over committed tokens only (`advance`); the masks of a draft's nodes are computed by consuming each
    node's path and rolling it back.
    """

    def __init__(self, matcher, vocab_size: int, step_budget_s: float | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.step_budget_s = step_budget_s  # most seconds of mask work between two commits (None: unbounded)
        self.spent_s = 0.0  # seconds of mask work since the last commit (`advance`)
        self.total_s = 0.0  # seconds of mask work over the whole answer

    def _spend(self, since: float) -> None:
        """Count the work since `since` (time.perf_counter()) against this step's budget: past it, the row fails
        alone (a ConstraintError ends its sequence; the batch goes on)."""
        spent = time.perf_counter() - since
        self.spent_s += spent
        self.total_s += spent
        if self.step_budget_s is not None and self.spent_s > self.step_budget_s:
            raise ConstraintError(f"the constraint's masks took {1000 * self.spent_s:.0f} ms in one decoding step, "
                                  f"more than the {1000 * self.step_budget_s:.0f} ms allowed: simplify the schema or "
                                  "grammar")

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens allowed next."""
        since = time.perf_counter()
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # (W,)
        self._spend(since)
        return unpack_bitmask(bits, self.vocab_size)

    def node_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Allowed tokens at the root and after each node of a draft (a chain: parents i - 1).

        tokens, parents: the draft's N nodes (parents first; -1 is the root). Returns (N + 1, V) bool: row 0 at the
        root, row i + 1 after node i. A node the constraint forbids (after its path) can never be accepted (its p is
        0), so the rows below it are never read; they are left all-allowed.
        """
        masks = torch.ones(len(tokens) + 1, self.vocab_size, dtype=torch.bool)  # (N + 1, V)
        masks[0] = self.allowed()
        paths: list[list[int] | None] = []  # path of node i from the root (None: forbidden on the way)
        held: list[int] = []  # the path the matcher has consumed now (a chain only ever extends it)
        try:
            for i, (token, parent) in enumerate(zip(tokens, parents)):
                above = [] if parent < 0 else paths[parent]
                path = None if above is None or not bool(masks[parent + 1, token]) else [*above, token]
                paths.append(path)
                if path is None:
                    continue
                common = 0
                while common < min(len(held), len(path)) and held[common] == path[common]:
                    common += 1
                self.matcher.rollback(len(held) - common)
                held = held[:common]
                consumed = self.matcher.try_consume_tokens(path[common:])
                held += path[common : common + consumed]
                if len(held) == len(path):
                    masks[i + 1] = self.allowed()
                else:  # pragma: no cover - the mask allowed it, the matcher did not
                    paths[i] = None
        finally:
            self.matcher.rollback(len(held))
        return masks

    def allowed_after(self, drafted: list[int]) -> torch.Tensor | None:
        """(V,) bool: the tokens allowed after the committed answer and these draft tokens (None where one of them is
        forbidden). The state is left as it was: a drafter masks its q with this (any q is exact; a masked one is
        accepted more often)."""
        consumed = self.matcher.try_consume_tokens(list(drafted)) if drafted else 0
        try:
            return self.allowed() if consumed == len(drafted) else None
        finally:
            self.matcher.rollback(consumed)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, after the committed answer, the constraint allows in a row (state unchanged)."""
        if not tokens:
            return 0
        since = time.perf_counter()
        try:
            return self.matcher.validate_tokens(list(tokens))
        finally:
            self._spend(since)

    def forced(self, limit: int) -> list[int]:
        """The tokens the constraint forces next (at most `limit`): free drafts."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        since = time.perf_counter()
        try:
            return list(self.matcher.compute_ff_tokens()[:limit])
        finally:
            self._spend(since)

    def advance(self, tokens: tuple[int, ...] | list[int]) -> None:
        """Consume committed tokens (each was drawn from the constrained p, so each is allowed)."""
        self.spent_s = 0.0  # a commit ends the step's mask work
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise ConstraintError(f"the constraint refused a committed token: {_first_line(self.matcher.get_error())}")

    def end_token(self) -> int | None:
        """Once `finished`: the one token still allowed (the end-of-sequence token), which constrained decoding then
        draws with probability 1; None where there is none."""
        ids = self.allowed().nonzero().view(-1)  # (n,)
        return int(ids[0]) if ids.numel() == 1 else None

    @property
    def finished(self) -> bool:
        """The constraint is complete and allows nothing more (end of answer)."""
        return self.matcher.is_stopped()


def apply_constraint(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens' logits at -inf. logits: (N, V) any float dtype; allowed: (N, V) bool -> (N, V) float32."""
    if not bool(allowed.any(dim=-1).all()):
        raise ConstraintError("the constraint allows no token here: it dead-ends")
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
