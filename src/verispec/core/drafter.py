"""The drafter contract: every drafting method proposes through it, one verifier checks them all.

A drafter proposes, for each sequence of a batch, a `Draft`: candidate tokens together with the
distributions q they were sampled from. A deterministic drafter returns q = None, which the
verifier treats as one-hot (Leviathan et al. hold for any q, one-hot included).

One `propose` and one `commit`: a draft is a tree (`verispec.tree.Draft`), a chain its degenerate case.
A row asks for a chain (its `TreeConfig` is None) or a tree; drafters that can build trees say so
(`Traits.trees`), and after verification `commit` gets each row's accepted path (for a chain, its first
`len(path)` drafts). The verification math lives in `verispec.rejection`. The engine knows drafters only
through this class; the drafters themselves live in `verispec.drafters`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING


from verispec.config import TreeConfig
from verispec.core.sequence import Sequence
from verispec.errors import VerispecError
from verispec.tree import EMPTY_DRAFT, Draft

if TYPE_CHECKING:
    from verispec.core.adaptation import AdaptExample

__all__ = ["EMPTY_DRAFT", "PLAIN", "Draft", "Drafter", "PlainDrafter", "RowStates", "Traits"]


@dataclass(frozen=True)
class Traits:
    """What a drafter can do and what it needs from the batch, read by the engine, the batch and the fault guards.

    Attributes:
        plain: no drafts, one token per target pass (only `PlainDrafter`).
        trees: `propose` builds trees (a chain-only drafter is never asked for one).
        adaptive: implements `adapt` (online adaptation, verispec.adapt).
        stops_chains: its chains honour a sequence's `draft_stop` (core.stopping).
        chunked_prefill: follows a prompt the target reads over several steps (chunked prefill, verispec.batch):
            drafters that read only the sequence's tokens. Heads and self-speculation read the target's pass itself.
        follows_prefixes: follows a row that joins with the first positions of its prompt already in the target's
            cache, copied from an earlier row (`verispec.core.prefix`) and read by no pass here: drafters that read
            the tokens themselves, Medusa heads (they need the last position's state only), an EAGLE head (it keeps
            its own entries by their tokens and says how far it can follow: `prefix_limit`). Without it the batch
            reuses no prefix.
        reads_prompt: has a cache of its own (a draft model): `propose` is called in a row's first step even when no
            row drafts (all depths 0), so that it reads the prompt then, before the first output.
        catches_up: reads a row's tokens into a cache of its own before drafting after them (a draft model,
            self-speculation): `unread` counts what a row has not read yet (a composite charges that reading).
        restartable: `start` brings it to a known state for any rows, rows already decoding included (their tokens
            then hold the prompt and the output so far), in any subset and order of the batch's rows. Then the batch
            confines a fault in the drafter to the row that causes it (`verispec.faults.DraftRows`): it starts the
            drafter afresh for each row alone to find the row that fails, keeps that row out of it, and starts it
            afresh for the others. True for drafters whose state is a function of the rows' tokens (draft models
            with caches of their own, lookups, suffix decoding, corpus n-grams, the cross-tokenizer draft). False
            for drafters whose rows are the target's rows and whose state comes from the target's own passes or
            cache (draft heads; self-speculation on the native runner): a fault there turns drafting off for the
            rows present, and the drafter is started afresh when rows join.
        held_back: draft positions a drafting step computes beyond the K it proposes: the tuner charges a step
            (K + held_back) positions' cost (a cross-tokenizer string draft writes until its text holds K + 1
            target tokens).
        input_vocab: token ids the drafter's own model reads (a draft model whose vocabulary is smaller than the
            target's): a row whose tokens hold an id at or past it never reaches the drafter and decodes without
            drafts. None: any target id.
    """

    plain: bool = False
    trees: bool = False
    adaptive: bool = False
    stops_chains: bool = False
    chunked_prefill: bool = False
    follows_prefixes: bool = False
    reads_prompt: bool = False
    catches_up: bool = False
    restartable: bool = True
    held_back: int = 0
    input_vocab: int | None = None


class Drafter(ABC):
    """Base class for drafters. Sequences are passed in batch order on every call."""

    name: str = "drafter"
    # What this drafter can do and needs from the batch (`Traits`): one value, stated once, as a class attribute, in
    # the constructor where it depends on the drafter's models, or as a property where it follows a setting that can
    # change after construction (an EAGLE head's argmax, a composite's members).
    traits: Traits = Traits()
    # A row given no drafts reads at most this many of its pending tokens per call (None: all), so a drafter with a
    # cache of its own reads a long prompt in chunks alongside the target: the batch's, passed to `restart`.
    prefill_chunk: int | None = None
    # The drafter's own model runner where it has one (a draft model, self-speculation's skip set): `--auto-k` times
    # its passes (`tuning.measure_costs`). None: no runner of its own (lookups, heads: see `token_cost`).
    runner = None

    def restart(self, prefill_chunk: int | None = None) -> None:
        """Decoding starts afresh: a batch that was empty takes new requests, just before `start`, reading joining
        prompts `prefill_chunk` tokens a step (None: whole). A drafter that estimates its own acceptance (the
        composite) starts those estimates again from its averages (see `tuning.KTuner.restart`); one that
        overrides this calls it."""
        self.prefill_chunk = prefill_chunk

    def start(self, sequences: list[Sequence]) -> None:
        """A new batch begins (prompts only in `tokens`).

        Drafters that keep per-row state (a cache) override `start`, `extend` and `keep` together."""

    def bind_target(self, state) -> None:
        """The target's cache for the batch about to start (the same object while the batch lives).
        Only a drafter that reads the target's own cache (self-speculation) keeps it."""

    def extend(self, sequences: list[Sequence]) -> None:
        """These new sequences join the running batch as its last rows (prompts only in `tokens`)."""

    def unread(self, b: int, seq: Sequence) -> int:
        """Tokens of row b (`seq`) a drafter that `catches_up` has not read into its own cache yet; 0 for the others."""
        return 0

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of state this drafter holds for one sequence of `tokens` tokens (its model's cache; 0 where it
        keeps none of its own)."""
        return 0

    def size_drafts(self, costs) -> bool:
        """For drafters that choose each row's draft length themselves (the composite): the batch's measured costs
        for this step (a `tuning.CostProfile`; None without `--auto-k`). Return True to get the longest measured K as
        every row's cap instead of the tuner's K. Others return False and are sized by the tuner."""
        return False

    def token_cost(self) -> float | None:
        """Seconds one drafted token costs, timed on this machine, for drafters without a runner of their own
        (draft heads); None where `verispec.tuning.measure_costs` times the drafter's runner, or it is free."""
        return None

    @abstractmethod
    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        """Propose a draft for each sequence b, at most depths[b] tokens deep (0: none this step): a chain where
        trees[b] is None (`trees` None: chains for every row), else a tree shaped by trees[b]."""

    def continuation(self, b: int, seq: Sequence, after: list[int], depth: int) -> list[int]:
        """A deterministic chain of at most `depth` tokens to follow row b's tokens and then `after` (tokens not yet
        committed: a structured-output constraint's forced run), for drafters whose chains are a function of the
        context alone (lookups); [] where the drafter has none. It must not change the drafter's state."""
        return []

    def commit(self, sequences: list[Sequence], drafts: list[Draft], paths: list[tuple[int, ...]]) -> None:
        """Called after verification, once each sequence's tokens hold the committed tokens: paths[b] are the
        accepted nodes of drafts[b] from the root down (for a chain, its first len(paths[b]) drafts)."""

    def keep(self, rows: list[int]) -> None:
        """Only these batch rows continue (the others finished); later calls see them in this order."""

    def reuse_prefixes(self, budget_bytes: int) -> None:
        """Keep up to `budget_bytes` of finished rows' own cache by their tokens, so that a later row whose tokens begin
        the same starts from it (`verispec.core.prefix`), as the target's rows do; 0 turns it off. Drafters without a cache
        of their own, or whose runner's rows do not copy exactly, ignore it."""

    def prefix_limit(self, seq: Sequence) -> int | None:
        """How many positions of `seq`'s tokens a row joining now may take from the target's prefix store
        (`verispec.core.prefix`), asked once the drafter holds the row: None where any will do (drafters that read
        the tokens themselves); a drafter whose rows need the target's features of every position (an EAGLE head)
        says how far its own store reaches."""
        return None

    def retire_all(self) -> None:
        """Every current row is done, as if `keep` dropped it, for drafters that learn from finished outputs (the
        suffix store): a server calls it before it discards a batch without `keep` (at shutdown). The rows stay;
        a later `keep` or `start` does not count them again."""

    def flush_store(self, timeout: float) -> bool:
        """Write what a drafter keeps in a file (the suffix store) and has not written yet, waiting up to `timeout`
        seconds (a server's shutdown, a one-shot command's end); True when nothing is left unwritten, as for every
        drafter without such a file."""
        return True


    def check_adaptable(self, config=None) -> None:
        """Raise a VerispecError, before any adaptation starts, where this drafter cannot adapt online with `config`
        (an AdaptConfig) here. Called only for `adaptive` drafters."""

    def adaptation_buffer(self):
        """The buffer online adaptation drains for this drafter (a `core.adaptation.ExampleBuffer` of its own, as
        heads keep windows of the target's features), or None for the engine's buffer of AdaptExamples."""
        return None

    def adapt(self, examples: list[AdaptExample]) -> None:
        """Learn from target distributions that verification computed (see `verispec.adapt`).

        May be called from another thread while the engine steps; the change must take effect only
        at the start of a later `propose`, so that every q a step reports is the distribution its
        draft tokens were drawn from."""
        raise VerispecError(f"the '{self.name}' drafter cannot adapt online (ngram-corpus, draft models and Medusa / EAGLE heads can)")


class RowStates(Drafter):
    """A drafter that keeps one state per batch row, in `rows` (batch order): it says how a joining row's state
    begins (`new_row`), and `start`, `extend` and `keep` are these, the same for every such drafter. One that keeps
    more beside its rows (a model's cache, an adaptation log) extends them and calls them."""

    rows: list

    @abstractmethod
    def new_row(self, seq: Sequence):
        """The state of a row that joins the batch (its prompt in `seq.tokens`)."""

    def start(self, sequences: list[Sequence]) -> None:
        self.rows = [self.new_row(seq) for seq in sequences]

    def extend(self, sequences: list[Sequence]) -> None:
        self.rows += [self.new_row(seq) for seq in sequences]

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]


class PlainDrafter(Drafter):
    """The drafter of plain decoding: it proposes nothing, so every step commits the target's one token. An engine
    built without a drafter holds `PLAIN`, so the step never asks whether there is one; the batch gives it no rows
    (`plain`), and a row decodes exactly as the target alone would."""

    name = "none"
    traits = Traits(plain=True, chunked_prefill=True, follows_prefixes=True)  # it reads nothing

    def propose(self, sequences: list[Sequence], depths: list[int],
                trees: list[TreeConfig | None] | None = None) -> list[Draft]:
        return [EMPTY_DRAFT] * len(sequences)


PLAIN = PlainDrafter()
