"""Every drafter kind in one table: a `--draft` spec is parsed once (`parse_draft`) into a `DrafterChoice`, and its kind's
entry in `KINDS` builds the drafter. The API, the CLI, the server, the bench and the live view all go through here.

    none | off                   plain decoding (no drafter)
    ngram                        prompt lookup (`prompt_lookup.py`)
    suffix[:FILE]                suffix decoding over the context and earlier requests' outputs (`suffix.py`),
                                 the outputs kept in FILE across processes
    LOOKUP+...+OTHER             lookups first (ngram, suffix, corpus n-grams) and one costly drafter, chosen per row
                                 and step from measured costs and acceptance (`composite.py`): suffix+eagle, ...
    ngram-corpus[:TABLE], X.ngram  corpus n-grams (`ngram_corpus.py`)
    self, self:SKIP, self:FILE   the target with sublayers skipped (`self_draft.py`)
    medusa[:DIR]                 Medusa heads on the target's hidden states (`medusa.py`)
    eagle[:DIR]                  an EAGLE-3 head on the target's fused features (`eagle.py`)
    anything else                a draft model: a named default, a Hugging Face directory, a .gguf file or a
                                 distilled draft (`draft_model.py`)

Adding a drafter: its module under `drafters/` and one `DrafterKind` in `KINDS`, or, outside verispec,
`register_drafter(DrafterKind(...))` (docs/custom-drafter.md has a working example). Kinds are tried in order; the
first whose `matches` accepts the text wins, and the model kind comes last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from verispec.config import CrossTokenizerConfig, NGramConfig, PromptLookupConfig, SelfDraftConfig, SuffixConfig
from verispec.console import notice
from verispec.core.drafter import PLAIN, Drafter
from verispec.errors import VerispecError

NONE, NGRAM, CORPUS, SELF, MEDUSA, EAGLE, MODEL = "none", "ngram", "ngram-corpus", "self", "medusa", "eagle", "model"
SUFFIX, COMPOSITE = "suffix", "composite"
NO_DRAFT = ("none", "off")


@dataclass(frozen=True)
class DrafterChoice:
    """A parsed `--draft`: its kind (a key of KINDS), the text as given and its argument (what follows "kind:", or
    a model's name or path; None when absent)."""

    kind: str
    text: str
    arg: str | None = None

    @property
    def loads_model(self) -> bool:
        """Whether this spec loads a draft model of its own (the others draft from the context or the target)."""
        return self.kind == MODEL or (self.kind == COMPOSITE and any(part.loads_model for part in self.parts))

    @property
    def parts(self) -> tuple[DrafterChoice, ...]:
        """A composite's drafters, in order (one clear line for an empty part, 'none' or a nested composite)."""
        if self.kind != COMPOSITE:
            return (self,)
        parts = []
        for text in self.text.split("+"):
            part = parse_draft(text) if text.strip() else None
            if part is None or part.kind in (NONE, COMPOSITE):
                raise VerispecError(f"--draft {self.text}: each part of a composite names a drafter "
                                    f"(ngram, suffix, ngram-corpus, then a model, eagle, medusa or self), got {text!r}")
            parts.append(part)
        return tuple(parts)

    @property
    def is_head(self) -> bool:
        return self.kind in (MEDUSA, EAGLE)


@dataclass(frozen=True)
class DrafterOptions:
    """What the drafter kinds read besides their spec; one source of defaults (`config.py` holds each part's).

    prompt_lookup: n-gram sizes of the `ngram` drafter.
    ngram: settings of the corpus n-gram drafter.
    suffix: settings of suffix decoding.
    self_draft: settings of self-speculation.
    draft_lookup: N > 0 makes a draft model, an EAGLE head or the self drafter copy from the context first where
        its last n-gram (n >= N) occurred before; 0 turns that off; None keeps the drafter's own setting.
    draft_context: a draft model reads only the last N tokens of each prompt (None: all).
    draft_vocab: a draft model's LM head keeps N token ids, the most frequent first (q = 0 elsewhere: exact;
        None: all; `models.runners.head_rows`).
    head_argmax: an EAGLE head drafts its argmax as one-hot drafts (vLLM's way) instead of sampling from its q.
    cross: how a draft model with another tokenizer than the target's drafts (`drafters.cross_tokenizer`).
    draft_dtype, draft_weights, backend, device, compile: how a draft model is loaded (`models.loading`).
    """

    prompt_lookup: PromptLookupConfig = PromptLookupConfig()
    ngram: NGramConfig = NGramConfig()
    suffix: SuffixConfig = SuffixConfig()
    self_draft: SelfDraftConfig = SelfDraftConfig()
    draft_lookup: int | None = None
    draft_context: int | None = None
    draft_vocab: int | None = None
    head_argmax: bool = False
    cross: CrossTokenizerConfig = CrossTokenizerConfig()
    draft_dtype: str | None = None
    draft_weights: str | None = None
    backend: str | None = None
    device: str = "cpu"
    compile: bool = False


def with_suffix_scope(options: DrafterOptions, scope: str | None) -> DrafterOptions:
    """`options` with suffix decoding's store scope set (`SuffixConfig.scope`: "shared", or "key" for one store per
    `Sequence.scope`; None keeps it): how a caller's setting (a server's) reaches every suffix drafter it builds,
    a composite's suffix part included."""
    return options if scope is None else replace(options, suffix=replace(options.suffix, scope=scope))


@dataclass
class Built:
    """A kind's product: the drafter (`PLAIN`: plain decoding), the name it is reported by, and notes for the CLI
    (`skip_source`: where the self drafter's skip set came from; `draft_weights`: a draft model's weights)."""

    drafter: Drafter
    name: str
    skip_source: str | None = None
    draft_weights: str | None = None
    context_window: int | None = None  # a draft model's own limit, where it is below the target's


@dataclass(frozen=True)
class DrafterKind:
    """One row of the table: `matches(text)` claims a spec, `build(spec, target, runner, options)` makes its
    drafter (a `Built`, or the Drafter alone) for a loaded target (`models.loading.LoadedModel`) and its runner."""

    name: str
    summary: str
    matches: Callable[[str], bool]
    build: Callable[[DrafterChoice, object, object, DrafterOptions], Built | Drafter]
    arg_prefix: bool = True  # "kind:ARG" carries an argument
    aliases: tuple[str, ...] = field(default_factory=tuple)


def lookup_first(n: int) -> PromptLookupConfig | None:
    """A drafter's "lookup first" n-gram sizes for --draft-lookup N: n-grams of N and more (at least up to 4);
    0 turns it off."""
    if n < 0:
        raise VerispecError(f"draft lookup needs an n-gram size >= 1 (0 turns it off), got {n}")
    return PromptLookupConfig(max_ngram=max(4, n), min_ngram=n) if n else None


# --- the kinds' builders ---------------------------------------------------------------------------
def _none(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    return Built(PLAIN, NONE)


def _ngram(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.prompt_lookup import PromptLookupDrafter

    return Built(PromptLookupDrafter(options.prompt_lookup), NGRAM)


def _suffix(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.suffix import SuffixDrafter

    if spec.arg is None:
        return Built(SuffixDrafter(options.suffix), SUFFIX)
    return Built(SuffixDrafter(options.suffix, spec.arg, store_tokenizer(target), runner.vocab_size), spec.text)


def store_tokenizer(target) -> dict:
    """Whose token ids a suffix store file may hold: the target's tokenizer, by name and digest."""
    from verispec.ngram.table import tokenizer_fingerprint

    return {"name": getattr(target.tokenizer, "name_or_path", "?"), "sha256": tokenizer_fingerprint(target.tokenizer)}


def _corpus(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.ngram_corpus import CorpusNGramDrafter

    return Built(CorpusNGramDrafter.from_spec(spec.text, target.tokenizer, runner.vocab_size, options.ngram), spec.text)


def _self(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.self_draft import SelfDrafter
    from verispec.models.skip import resolve_skip

    self_draft = options.self_draft
    if options.draft_lookup:
        self_draft = replace(self_draft, lookup=options.draft_lookup)
    skip, source = resolve_skip(spec.text, runner, target.name)
    drafter = SelfDrafter(runner, skip, self_draft, lookup_first(self_draft.lookup))
    return Built(drafter, f"self:{skip.text}", skip_source=source)


def _head(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.heads import head_drafter

    drafter = head_drafter(spec.kind, spec.arg, runner)
    if options.head_argmax:
        if spec.kind == MEDUSA:
            raise VerispecError("argmax drafting is an EAGLE head's option; Medusa heads draft as they were trained")
        drafter.argmax = True
    if options.draft_lookup is not None:
        if spec.kind == MEDUSA:
            raise VerispecError("--draft-lookup: Medusa heads draft every position from one hidden state; "
                                "lookup first works with --draft eagle")
        drafter.lookup = lookup_first(options.draft_lookup)
    return Built(drafter, spec.text)


def _model(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.models.loading import (
        DEFAULT_BACKEND,
        DEFAULT_DRAFT_WEIGHTS,
        DEFAULT_DTYPE,
        distilled_path,
        load_distilled_draft,
        load_model,
    )

    weights = options.draft_weights or DEFAULT_DRAFT_WEIGHTS
    if distilled_path(spec.text) is not None:
        loaded = load_distilled_draft(spec.text, target, weights)
    else:
        loaded = load_model(spec.text, options.draft_dtype or DEFAULT_DTYPE, weights,
                            options.backend or DEFAULT_BACKEND, options.device, options.compile)
    if options.draft_lookup is not None:
        loaded.lookup = lookup_first(options.draft_lookup)
    loaded.context = options.draft_context  # checked by DraftModelDrafter
    return model_drafter(loaded, target, runner, options.draft_vocab, options.cross)


def model_drafter(loaded, target, runner, draft_vocab: int | None = None,
                  cross: CrossTokenizerConfig = CrossTokenizerConfig()) -> Built:
    """A loaded draft model's drafter for this target: with the same tokenizer (a reduced vocabulary mapped to the
    target's) or, with another, a cross-tokenizer drafter (`drafters.cross_tokenizer`)."""
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.models.distilled import VocabMap
    from verispec.models.loading import same_tokenizer

    if not same_tokenizer(target, loaded):
        if draft_vocab is not None:
            raise VerispecError("--draft-vocab cuts a draft's vocabulary to the target's most written ids; a draft "
                                "with another tokenizer has other ids")
        return _cross_tokenizer(loaded, target, runner, cross)
    if loaded.vocab is not None and loaded.vocab.to_draft.numel() != runner.vocab_size:
        loaded.vocab = VocabMap.from_target_ids(loaded.vocab.to_target, runner.vocab_size)
    draft_runner = loaded.make_runner()
    if draft_vocab is not None:
        from verispec.models.runners.head_rows import HeadRowsRunner

        if loaded.vocab is not None:
            raise VerispecError("--draft-vocab: this draft already has a vocabulary of its own (a distilled draft)")
        draft_runner = HeadRowsRunner(draft_runner, draft_vocab, target.tokenizer)
    drafter = DraftModelDrafter(draft_runner, runner.vocab_size, loaded.lookup, loaded.context)
    return Built(drafter, loaded.name, draft_weights=loaded.weights, context_window=draft_runner.context_window)


def _cross_tokenizer(loaded, target, runner, config: CrossTokenizerConfig) -> Built:
    """A draft with another tokenizer: checked to round-trip the target's text and to share enough tokens with it;
    one that shares too little is dropped with a notice (the target decodes alone)."""
    from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
    from verispec.drafters.token_text import TokenText, VocabBridge

    draft_runner = loaded.make_runner()
    bridge = VocabBridge(TokenText(target.tokenizer, runner.vocab_size, f"target '{target.name}'"),
                         TokenText(loaded.tokenizer, draft_runner.vocab_size, f"draft '{loaded.name}'"))
    sample = bridge.sample_text()
    bridge.target.check_round_trip(sample)
    bridge.draft.check_round_trip(sample)
    shared, of_draft, of_target = bridge.shares()
    said = (f"draft '{loaded.name}' has another tokenizer than target '{target.name}': {shared:,} tokens shared "
            f"({of_draft:.0%} of the draft's, {of_target:.0%} of the target's)")
    if of_draft < config.min_shared:
        notice(f"[yellow]{said}, under the {config.min_shared:.0%} it needs to help; decoding without a draft[/yellow]")
        return Built(PLAIN, NONE)
    notice(f"[dim]{said}; it drafts text ({config.scheme} scheme)[/dim]")
    drafter = CrossTokenizerDrafter(draft_runner, bridge, runner.vocab_size, config)
    return Built(drafter, loaded.name, draft_weights=loaded.weights)


def _composite(spec: DrafterChoice, target, runner, options: DrafterOptions) -> Built:
    from verispec.drafters.composite import CompositeDrafter

    parts = spec.parts
    if len(parts) < 2:
        raise VerispecError(f"--draft {spec.text}: a composite needs two drafters or more, joined by '+'")
    built = []
    for part in parts:
        try:
            built.append(build_drafter(part, target, runner, options))
        except VerispecError as err:
            raise VerispecError(f"--draft {spec.text}: {err}") from None
    try:
        drafter = CompositeDrafter([b.drafter for b in built], [b.name for b in built])
    except VerispecError as err:
        raise VerispecError(f"--draft {spec.text}: {err}") from None
    model = next((b for b in built if b.draft_weights is not None or b.context_window is not None), None)
    return Built(drafter, drafter.name, draft_weights=model and model.draft_weights,
                 context_window=model and model.context_window)


def _is_composite(text: str) -> bool:
    """A '+'-joined spec whose first part is a lookup (a model path with a '+' in it stays a model)."""
    first = text.split("+", 1)[0].strip()
    return "+" in text and (first in (NGRAM, SUFFIX) or _prefixed(SUFFIX)(first) or _is_corpus(first))


def _prefixed(name: str) -> Callable[[str], bool]:
    return lambda text: text == name or text.startswith(name + ":")


def _is_corpus(text: str) -> bool:
    from verispec.drafters.ngram_corpus import TABLE_SUFFIX

    return _prefixed(CORPUS)(text) or text.endswith(TABLE_SUFFIX)


KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(COMPOSITE, "lookups first and one costly drafter, chosen each step (suffix+eagle, ngram+MODEL)",
                _is_composite, _composite, arg_prefix=False),
    DrafterKind(NONE, "plain decoding", lambda text: text in NO_DRAFT, _none, arg_prefix=False, aliases=("off",)),
    DrafterKind(NGRAM, "prompt lookup: copies from the context", lambda text: text == NGRAM, _ngram, arg_prefix=False),
    DrafterKind(SUFFIX, "suffix decoding: the context's and earlier outputs' continuations, by frequency",
                _prefixed(SUFFIX), _suffix),
    DrafterKind(CORPUS, "corpus n-grams (`verispec ngram build`)", _is_corpus, _corpus),
    DrafterKind(SELF, "self-speculation: the target with sublayers skipped", _prefixed(SELF), _self),
    DrafterKind(MEDUSA, "Medusa heads on the target's hidden states", _prefixed(MEDUSA), _head),
    DrafterKind(EAGLE, "an EAGLE-3 head on the target's fused features", _prefixed(EAGLE), _head),
    DrafterKind(MODEL, "a draft model: named default, HF directory, .gguf or distilled draft", lambda text: True,
                _model, arg_prefix=False),
)
_kinds: list[DrafterKind] = list(KINDS)  # KINDS and those registered since, the model kind last


def register_drafter(kind: DrafterKind) -> None:
    """Add a drafter kind (before the model kind, which takes every text no other kind claims). One clear line for a
    name already taken."""
    if any(k.name == kind.name or kind.name in k.aliases for k in _kinds):
        raise VerispecError(f"a drafter kind named '{kind.name}' is already registered")
    _kinds.insert(len(_kinds) - 1, kind)


PLUGINS = "verispec.drafters"  # entry-point group: a package names its DrafterKind there to add a --draft kind
_plugins_loaded = False


def _load_plugins() -> None:
    """Register the kinds installed packages declare under the `verispec.drafters` entry-point group (once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=PLUGINS):
        try:
            kind = point.load()
        except Exception as err:  # a broken plugin is named, not a traceback from inside it
            raise VerispecError(f"the drafter plugin '{point.name}' ({point.value}) failed to load: {err}") from None
        if not isinstance(kind, DrafterKind):
            raise VerispecError(f"the drafter plugin '{point.name}' ({point.value}) is not a DrafterKind")
        if all(k.name != kind.name for k in _kinds):
            register_drafter(kind)


def kinds() -> tuple[DrafterKind, ...]:
    """Every drafter kind, in the order specs are matched (installed plugins included)."""
    _load_plugins()
    return tuple(_kinds)


def parse_draft(text: str) -> DrafterChoice:
    """`--draft` text -> its spec (one clear line for an empty one)."""
    if not isinstance(text, str) or not text.strip():
        raise VerispecError("--draft is empty: name a drafter (ngram, self, eagle, medusa, a model) or 'none'")
    text = text.strip()
    for kind in kinds():
        if kind.matches(text):
            arg = text[len(kind.name) + 1 :] if kind.arg_prefix and text.startswith(kind.name + ":") else None
            if kind.name == MODEL or (kind.name == CORPUS and not text.startswith(CORPUS)):
                arg = text
            return DrafterChoice(kind.name, text, arg or None)
    raise AssertionError("the model kind matches every text")  # pragma: no cover


def build_drafter(spec: DrafterChoice | str, target, runner, options: DrafterOptions = DrafterOptions()) -> Built:
    """The drafter of `spec` for a loaded target and its runner."""
    spec = parse_draft(spec) if isinstance(spec, str) else spec
    built = next(kind for kind in kinds() if kind.name == spec.kind).build(spec, target, runner, options)
    return built if isinstance(built, Built) else Built(built, spec.text)  # a plugin may return the drafter alone
