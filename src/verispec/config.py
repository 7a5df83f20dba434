"""Frozen configuration dataclasses: the single source of defaults.

The CLI, the Python API and (later) the server only build these objects; none of them
repeats a default. Validation happens here, so bad values fail early with a clear message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from verispec.errors import VerispecError


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")


def option(default, help: str, *, default_text: str | None = None, switch: bool = False, parse=None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None):
    """A config field that a front end exposes as a command-line option (`--field-name`): its default here, and in
    its metadata what the option needs: `help`; `default_text`, the default as the help shows it (else the value);
    `switch`, an on / off option (`--x` / `--no-x`); `parse`, how the option's text becomes the value (raising
    VerispecError; else the field's int or float); `choices`; `metavar`. Read by `cli.options.add_config_options`."""
    return field(default=default, metadata={"option": {"help": help, "default_text": default_text, "switch": switch,
                                                       "parse": parse, "choices": choices, "metavar": metavar}})


@dataclass(frozen=True)
class Constraint:
    """Structured output: what the answer must match (see `verispec.constraints`).

    kind: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; no source), "regex"
        (source: a regular expression the whole answer matches) or "grammar" (source: a Lark grammar, or a
        GBNF grammar as llama.cpp writes them).
    """

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise VerispecError(f"unknown constraint kind '{self.kind}' (one of {', '.join(CONSTRAINT_KINDS)})")
        if not isinstance(self.source, str) or (self.kind != "json_object" and not self.source.strip()):
            raise VerispecError(f"the {self.kind.replace('_', ' ')} constraint is empty")


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds on a structured-output constraint, checked before it is compiled (`verispec.constraint_bounds`) and
    while it is used. The grammar compiler recurses natively over rule and reference chains and a chain a few
    thousand deep overflows its thread's stack (measured with llguidance 1.9.1: a JSON-schema property -> $ref chain
    of 1,000 objects ends the process on an 8 MiB stack, one of 700 does not); the bounds keep every constraint a
    request can send an order of magnitude below that, and its compile and masks short.

    Attributes:
        max_chars: longest source (schema text, regex, grammar), in characters. Default 131072.
        max_depth: the longest chain the compiler follows: nested subschemas and `$ref`s of a JSON schema, rule
            and terminal references of a grammar, nested groups of a regex. Default 128 (a $ref chain of 128
            objects, about a sixth of what crashes an 8 MiB stack).
        max_nodes: most subschemas, rules or terminals (or values of one enum) in one constraint. Default 20000.
        max_alternatives: most branches of one choice (an anyOf or oneOf, a grammar rule's `|`s). Default 1024
            (llguidance refuses a parser row of over 2,000 items, and only while decoding).
        max_literal_chars: longest single literal, regex or pattern inside a constraint. Default 8192 (a literal's
            first mask costs time linear in its length: 1 s at 900,000 characters).
        max_repetition: largest product of nested counted repetitions (`(a{100}){100}` is 10,000). Default 10000.
        compile_seconds: the server answers 400 when compiling (and the first mask) takes longer. Default 10.
        mask_ms_per_step: most milliseconds one row's constraint may spend on masks and forced tokens in one
            decoding step; a row over it fails alone (400). Default 250 (a nested JSON schema's mask costs 0.016 ms
            a token, 1.7 ms at worst; a step masks at most 1 + 32 forced + the draft's nodes).
    """

    max_chars: int = 131072
    max_depth: int = 128
    max_nodes: int = 20000
    max_alternatives: int = 1024
    max_literal_chars: int = 8192
    max_repetition: int = 10000
    compile_seconds: float = 10.0
    mask_ms_per_step: float = 250.0

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_depth", "max_nodes", "max_alternatives", "max_literal_chars", "max_repetition"):
            if not is_count(getattr(self, name), 1):
                raise VerispecError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        for name in ("compile_seconds", "mask_ms_per_step"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise VerispecError(f"{name} must be a positive number, got {getattr(self, name)}")


@dataclass(frozen=True)
class SamplingConfig:
    """How a distribution over the vocabulary is made from logits.

    The same processing is applied to the target's logits (giving p) and to the draft's
    logits (giving q), so verification compares like with like.

    Attributes:
        temperature: 0 means greedy (argmax), not a tiny temperature. Default 1.0.
        top_k: keep the k most likely tokens; 0 disables. Default 0.
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables. Default 1.0.
        min_p: drop tokens whose probability is below min_p x the top probability; 0 disables.
        repetition_penalty: CTRL-style penalty (> 0) on tokens already in the context; 1.0 disables.
        presence_penalty: subtracted from the logit of every token already in the answer (OpenAI's, in [-2, 2]; the
            answer only, not the prompt, as vLLM counts it). Default 0.
        frequency_penalty: subtracted once per occurrence of a token in the answer so far (OpenAI's, in [-2, 2]).
            Default 0.
        logit_bias: (token id, bias) pairs added to those tokens' logits before everything else (OpenAI's, biases
            in [-100, 100]). Default none.
        constraint: structured output (a JSON schema, a regex, a grammar): the target's p is restricted to the
            tokens it allows at each position, before the settings above apply. None (default): unconstrained.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise VerispecError(f"{name} must be in [-2, 2] (0 disables it), got {value}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        try:
            bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise VerispecError("logit_bias takes (token id, bias) pairs") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise VerispecError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise VerispecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise VerispecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise VerispecError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise VerispecError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_TREE_NODES = 1024
# The ranges a request (the server's, the live view's) may give sampling settings. Sampling is NaN-safe for any
# value SamplingConfig accepts (see `verispec.sampling`); past these a setting means nothing more (at temperature
# 100 logits spanning 10 are uniform to within 10%) and is refused as a client's mistake.
MAX_TEMPERATURE = 100.0
PENALTY_RANGE = (0.01, 100.0)


def is_count(value, minimum: int) -> bool:
    """An integer (or integral float) >= minimum; bools and strings are not counts."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and float(value).is_integer() and value >= minimum)
TREE_CHILDREN = ("without_replacement", "iid", "top")


@dataclass(frozen=True)
class TreeConfig:
    """Tree speculation: several candidate continuations per step, verified in one target pass.

    Give exactly one of `shape` and `budget`.

    Attributes:
        shape: static tree, a branching factor per depth: (3, 2, 1) gives the root 3 children, each of
            them 2 and each of those 1 (3 + 6 + 6 = 15 nodes, depth 3).
        budget: dynamic tree (EAGLE-2 style): at most this many nodes, grown where the draft is most
            confident; its depth is the spec's K (num_draft_tokens), so it costs a chain's draft passes. With
            `--auto-k` each step's measured costs (`tree.TreeCosts`, given beside this configuration) keep only
            the nodes that pay for their share of the pass; the budget stays the upper bound.
        top_k: dynamic trees: nodes the draft model expands per depth, and children per expanded node; at most
            the budget (a tree keeps no more children of one node, nor needs more nodes of one depth, than its
            budget), so a dynamic tree's draft work is bounded by budget x budget candidates per depth. Default 4.
        children: how a sampling draft model picks a node's children from its distribution q:
            "without_replacement" (distinct samples, recursive rejection sampling), "iid" (independent
            samples, SpecInfer's rule) or "top" (the k most probable tokens, deterministic). Greedy
            decoding always takes the top tokens; prompt lookup's candidates are always deterministic.
            Default "without_replacement".
    """

    shape: tuple[int, ...] | None = None
    budget: int | None = None
    top_k: int = 4
    children: str = "without_replacement"

    def __post_init__(self) -> None:
        if (self.shape is None) == (self.budget is None):
            raise VerispecError("a tree needs either a shape (branching factors per depth, e.g. 3,2,1) or a budget "
                                "(nodes per tree), not both and not neither")
        if self.shape is not None:
            shape = tuple(self.shape) if not isinstance(self.shape, (str, bytes)) else ()
            if not shape or not all(is_count(b, 1) for b in shape):
                raise VerispecError(f"a tree shape is one or more branching factors >= 1 (e.g. 3,2,1), got {self.shape}")
            shape = tuple(int(b) for b in shape)
            object.__setattr__(self, "shape", shape)
            size = self.size_upper_bound(len(shape))
            if size > MAX_TREE_NODES:
                raise VerispecError(f"tree shape {','.join(map(str, shape))} has {size} nodes; at most {MAX_TREE_NODES}")
        if self.budget is not None and not (is_count(self.budget, 1) and self.budget <= MAX_TREE_NODES):
            raise VerispecError(f"a tree budget is a number of nodes in 1..{MAX_TREE_NODES}, got {self.budget}")
        if not is_count(self.top_k, 1):
            raise VerispecError(f"tree top_k must be an integer >= 1, got {self.top_k}")
        if self.budget is not None and self.top_k > self.budget:
            object.__setattr__(self, "top_k", int(self.budget))
        if self.children not in TREE_CHILDREN:
            raise VerispecError(f"tree children must be one of {', '.join(TREE_CHILDREN)}, got '{self.children}'")
        if self.budget is not None:
            object.__setattr__(self, "budget", int(self.budget))
        object.__setattr__(self, "top_k", int(self.top_k))

    def depth(self, num_draft_tokens: int) -> int:
        """Longest root-to-leaf path: the shape's length, or K for a dynamic tree."""
        return len(self.shape) if self.shape is not None else num_draft_tokens

    def size_upper_bound(self, depth: int) -> int:
        """Most nodes a tree of this config has at this depth."""
        if self.shape is None:
            return int(self.budget)
        total, width = 0, 1
        for b in self.shape[:depth]:
            width *= b
            total += width
        return total


def check_tree_request(tree: TreeConfig | None, drafting: bool, auto_k: bool = False) -> None:
    """The rules a request's tree follows, wherever it is asked for: the CLI (before it loads any model), the engine
    (`make_sequences`), the server and a batch with an auto-tuner. A tree needs a drafter, and measured costs size
    chains and dynamic trees (a budget), not a static shape. Raises a VerispecError naming the rule broken."""
    if tree is None:
        return
    if not drafting:
        raise VerispecError("tree speculation needs a drafter that builds trees (a draft model or 'ngram'); "
                            "this request decodes plainly")
    if auto_k and tree.budget is None:
        raise VerispecError("auto-tuning (--auto-k) sizes chains and dynamic trees (--tree-budget) from measured costs, "
                            "not a static tree shape (--tree-shape)")


PREFIX_CACHE_BYTES = 1 << 30  # earlier requests' target cache kept for reuse by default (`verispec.core.prefix`)
MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound)
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SpecConfig:
    """How a speculative generation runs.

    Attributes:
        num_draft_tokens: K, the number of draft tokens proposed per step (>= 1). Default 4.
        max_new_tokens: generation stops after this many new tokens, never more. Default 128.
        stop: strings that end generation; the returned text stops before the first match.
        stop_at_eos: stop when the target's end-of-sequence token is committed. Default True.
        tree: draft a tree of candidates per step instead of one chain (None: a chain). Default None.
        draft_stop: a draft model's or prompt lookup's chain stops early where the estimated probability that all of its
            drafts so far are accepted (from the draft's calibrated confidence, see
            `verispec.core.stopping`) falls below this; that token is not proposed. 0 drafts all K
            tokens. An auto-tuner with `stop_drafts` sets the thresholds from measured costs instead. Default 0.
        prediction_depth: the longest chain a predicted output (`core.prediction`) drafts in one step: it grows to
            this while the answer follows the prediction and falls back to 2 after a rejection. Default 16.
        logprobs: report the target's log-probability of every generated token and of the `logprobs` likeliest
            tokens at its place (0: the generated token's only; None: none). Default None.
        logprobs_mode: which distribution they come from: "raw", the target's logits alone (log-softmax; what
            OpenAI and vLLM report by default), or "processed", the distribution the token was drawn from (after the
            repetition penalty, a constraint, temperature, top-k, top-p and min-p; one-hot at temperature 0).
            Default "raw".
        prompt_logprobs: also report the prompt's tokens' log-probabilities, each given the tokens before it (the
            first has none), with the `logprobs` likeliest tokens at each place: the target reads the prompt once
            for them before decoding (OpenAI's completions `echo` with `logprobs`, which evaluation harnesses score
            with). Raw only. Default False.
    """

    num_draft_tokens: int = 4
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_at_eos: bool = True
    tree: TreeConfig | None = None
    draft_stop: float = 0.0
    prediction_depth: int = 16
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.prompt_logprobs and self.logprobs_mode != "raw":
            raise VerispecError("the prompt's log-probabilities are raw (the sampling processors apply to generated "
                                "tokens): prompt_logprobs needs logprobs_mode 'raw'")
        if self.logprobs is not None and (int(self.logprobs) != self.logprobs or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise VerispecError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise VerispecError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if int(self.prediction_depth) != self.prediction_depth or self.prediction_depth < 1:
            raise VerispecError(f"prediction_depth must be an integer >= 1, got {self.prediction_depth}")
        if not (isinstance(self.draft_stop, (int, float)) and 0.0 <= self.draft_stop < 1.0):
            raise VerispecError(f"draft_stop is a probability in [0, 1) (0 turns it off), got {self.draft_stop}")
        if int(self.num_draft_tokens) != self.num_draft_tokens or self.num_draft_tokens < 1:
            raise VerispecError(f"num_draft_tokens (K) must be an integer >= 1, got {self.num_draft_tokens}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise VerispecError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise VerispecError(f"tree must be a TreeConfig, got {type(self.tree).__name__}")

    @property
    def tree_or_chain(self) -> TreeConfig:
        """The tree this spec drafts; a chain of K tokens is the tree of shape (1, ..., 1)."""
        return self.tree if self.tree is not None else TreeConfig(shape=(1,) * self.num_draft_tokens)


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup (n-gram match in the context) drafting.

    Attributes:
        max_ngram: the longest suffix n-gram searched for first. Default 3.
        min_ngram: the shortest suffix n-gram tried before giving up. Default 1.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise VerispecError(
                f"n-gram sizes need 1 <= min_ngram <= max_ngram, got min={self.min_ngram} max={self.max_ngram}"
            )


SUFFIX_SCOPES = ("shared", "key")  # SuffixConfig.scope


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding (`drafters.suffix`): drafts from every earlier occurrence of the context's longest suffix.

    Attributes:
        min_match: the shortest suffix match drafted from (tokens). Default 2.
        max_match: the longest suffix compared (a longer match counts as this long). Default 32.
        spec_factor: a draft is at most this many times the match's length (a short match drafts little). Default 1.0.
        min_share: a chain stops where its most frequent continuation follows less than this share of the
            occurrences it extends. Default 0.1.
        capacity: tokens of earlier requests' outputs kept (the oldest dropped first). Default 262144.
        max_candidates: the most recent occurrences read per step, per source. Default 256.
        scope: whose earlier outputs a row drafts from and adds to: "shared" (one store for every row) or "key"
            (one store per `Sequence.scope`, a server's tenant: a row reads and joins only its own scope's
            outputs; rows of no scope share one). `capacity` bounds all scopes together. Default "key": who sets
            `Sequence.scope` decides (a server sets it per API key under its `suffix_scope`; the CLI and the API set
            none, so every row shares the one store), and "shared" overrides that.
    """

    min_match: int = 2
    max_match: int = 32
    spec_factor: float = 1.0
    min_share: float = 0.1
    capacity: int = 262_144
    max_candidates: int = 256
    scope: str = "key"

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise VerispecError(f"suffix decoding needs 1 <= min_match <= max_match, got {self.min_match} and "
                                f"{self.max_match}")
        if self.capacity < 1:
            raise VerispecError(f"suffix decoding's capacity must be at least 1 token, got {self.capacity}")
        if not self.spec_factor > 0 or not 0 <= self.min_share <= 1 or self.max_candidates < 1:
            raise VerispecError("suffix decoding needs spec_factor > 0, 0 <= min_share <= 1 and max_candidates >= 1")
        if self.scope not in SUFFIX_SCOPES:
            raise VerispecError(f"unknown suffix store scope '{self.scope}'; choose one of {', '.join(SUFFIX_SCOPES)}")


CROSS_SCHEMES = ("string", "intersection")


@dataclass(frozen=True)
class CrossTokenizerConfig:
    """A draft model with another tokenizer than the target's (`drafters.cross_tokenizer`).

    Attributes:
        scheme: "string" (the draft writes greedily, its text re-read as target tokens, q one-hot) or "intersection"
            (q restricted to the tokens both vocabularies share). Default "string" (docs/cross-tokenizer.md).
        passes_per_token: draft passes allowed per target token wanted (the string scheme's draft may need more
            tokens than the target for the same text). Default 2.0.
        min_shared: below this share of the draft's tokens being target tokens too, the draft is dropped with a
            notice and the target decodes alone. Default 0.1.
    """

    scheme: str = "string"
    passes_per_token: float = 2.0
    min_shared: float = 0.1

    def __post_init__(self) -> None:
        if self.scheme not in CROSS_SCHEMES:
            raise VerispecError(f"unknown cross-tokenizer scheme '{self.scheme}'; choose one of {', '.join(CROSS_SCHEMES)}")
        if not self.passes_per_token >= 1 or not 0 <= self.min_shared <= 1:
            raise VerispecError("a cross-tokenizer draft needs passes_per_token >= 1 and 0 <= min_shared <= 1")


@dataclass(frozen=True)
class NGramConfig:
    """Corpus n-gram drafting (`--draft ngram-corpus[:TABLE]`).

    At each draft position the drafter backs off from the longest context (max_n - 1 tokens) to the
    shortest (min_n - 1 tokens) and drafts from the first order where any source has counts: the
    corpus table, the sequence's own context (prompt and generated tokens) and the counts learned
    online; each source's counts are normalized, then mixed with these weights.

    Attributes:
        max_n: the longest n-gram used (capped by the table's). Default 4.
        min_n: the shortest; with no match down to it, drafting stops early. Default 2.
        corpus_weight, context_weight, adapted_weight: mixture weights of the sources. Defaults 1, 3, 3.
        match_temperature: sample drafts from q^(1/T) (renormalized) at temperature T, closer to the
            target's processed p. Default True.
        min_prob: stop drafting where the most likely continuation has q below this. Default 0 (never).
        adapted_contexts: contexts per order the online counts keep (oldest dropped first). Default 200000.
    """

    max_n: int = 4
    min_n: int = 2
    corpus_weight: float = 1.0
    context_weight: float = 3.0
    adapted_weight: float = 3.0
    match_temperature: bool = True
    min_prob: float = 0.0
    adapted_contexts: int = 200_000

    def __post_init__(self) -> None:
        if self.min_n < 1 or self.max_n < self.min_n:
            raise VerispecError(f"n-gram orders need 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        for name in ("corpus_weight", "context_weight", "adapted_weight"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise VerispecError(f"{name} must be a number >= 0, got {getattr(self, name)}")
        if not (0.0 <= self.min_prob < 1.0):
            raise VerispecError(f"min_prob must be in [0, 1), got {self.min_prob}")
        if self.adapted_contexts < 1:
            raise VerispecError(f"adapted_contexts must be >= 1, got {self.adapted_contexts}")


LEARN_FROM = ("mistakes", "all")  # AdaptConfig.learn_from


@dataclass(frozen=True)
class AdaptConfig:
    """Online adaptation of the drafter (`--adapt`): learn from the target's distributions that
    verification already computed, where the draft was wrong. Only the draft changes; the output
    distribution stays the target's.

    Attributes:
        buffer_size: examples kept (the oldest are dropped beyond it). Default 4096.
        top_k: target probabilities kept per example (the rest of p is dropped). Default 8.
        max_context: tokens of context kept per example (the most recent). Default 256.
        include_undrafted: also keep the target's distribution where nothing was drafted. Default True.
        learn_from: "mistakes" keeps p only where a step's drafts stopped being accepted (Online
            Speculative Decoding's buffer); "all" keeps p at every position a step settled (each
            accepted draft token's position too, and the bonus position), so a draft also learns what
            it already got right on this traffic instead of only its failures. Default "mistakes".
        min_examples: examples buffered before an update runs. Default 8.
        background: update in a background thread (True), or in the caller between steps. Default True.
        lr, batch_size, epochs, max_steps: draft-model updates (AdamW on forward KL(p_target || q_draft)):
            learning rate (default None: by the draft's size, see `draft_lr`; heads: `head_lr`), examples per optimizer
            step (default 16), passes over the new examples (default 1), at most this many optimizer
            steps per update (default 16).
        replay: earlier examples (kept up to buffer_size, drawn at random) revisited in each draft-model
            update beside the new ones, so one update's few steps do not wash out what earlier ones
            learned. 0 turns replay off. Default 0.
        head_window: draft heads (Medusa, EAGLE) learn from windows of this many consecutive committed
            positions (the target's features and tokens there) instead of single examples: for them an
            example is a window, buffer_size // head_window windows are kept, batch_size counts windows,
            and top_k, max_context, include_undrafted, learn_from and replay do not apply (see
            `drafters.head_adapt`). Default 64.
    """

    buffer_size: int = 4096
    top_k: int = 8
    max_context: int = 256
    include_undrafted: bool = True
    learn_from: str = "mistakes"
    min_examples: int = 8
    background: bool = True
    lr: float | None = None
    batch_size: int = 16
    epochs: int = 1
    max_steps: int = 16
    replay: int = 0
    head_window: int = 64

    def __post_init__(self) -> None:
        for name in ("buffer_size", "top_k", "max_context", "min_examples", "batch_size", "epochs", "max_steps", "head_window"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise VerispecError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if int(self.replay) != self.replay or self.replay < 0:
            raise VerispecError(f"replay must be an integer >= 0, got {self.replay}")
        if self.learn_from not in LEARN_FROM:
            raise VerispecError(f"learn_from must be one of {', '.join(LEARN_FROM)}, got {self.learn_from!r}")
        if self.lr is not None and (not math.isfinite(self.lr) or self.lr <= 0):
            raise VerispecError(f"lr must be > 0, got {self.lr}")

    def draft_lr(self, num_parameters: int) -> float:
        """The learning rate for a draft of this many parameters: `lr` if set, else 3e-4 for a small
        distilled-size draft (< 100M parameters; trained at ~1e-3, it barely moves at 1e-5: measured
        +0.4% held-out acceptance at 1e-5 and +12% at 3e-4 over 40 math_reasoning prompts), 1e-5 for a
        pre-trained model (larger steps would undo its pre-training)."""
        if self.lr is not None:
            return self.lr
        return 3e-4 if num_parameters < 100_000_000 else 1e-5

    def head_lr(self) -> float:
        """The learning rate for a trained draft head (Medusa, EAGLE): `lr` if set, else 3e-5. A head has
        learned its target already and sees a few windows per update: measured on the shipped EAGLE-3 head,
        training on 16 windows of 8 math_reasoning answers raised agreement on 8 others' windows at 3e-5
        (first draft 0.706 -> 0.716) and lowered it at 1e-4 (0.683 after 3 epochs) and 3e-4 (0.608)."""
        return self.lr if self.lr is not None else 3e-5


@dataclass(frozen=True)
class SelfDraftConfig:
    """On-the-fly choice of the self-speculation draft's skip set (SWIFT-style; `--self-retune`).

    Each sequence keeps an incumbent skip set and now and then tries a challenger, the incumbent with one
    sublayer flipped (skipped or run again), for `trial_steps` of its steps, alternating with the
    incumbent. The one with the better score (expected tokens per step over draft cost, from the acceptance
    those steps saw) becomes the incumbent. A choice depends only on steps already verified, so the output
    distribution never changes (`verispec.drafters.self_retune`).

    Attributes:
        retune: re-choose the skip set while decoding (the online form of `verispec self-tune`). Default False.
        trial_steps: steps a challenger drafts before it is judged. Default 4.
        gap: steps on the incumbent alone between two trials. Default 8.
        seed: seeds the challengers' mutations (the same for every sequence, so batched = single). Default 0.
        lookup: N > 0 copies from the context first where its last n-gram (n >= N) occurred before, as a draft
            model's "lookup first" (`DraftModelDrafter`); 0 drafts from the skipped model only. Default 0.
    """

    retune: bool = False
    trial_steps: int = 4
    gap: int = 8
    seed: int = 0
    lookup: int = 0

    def __post_init__(self) -> None:
        if self.lookup < 0:
            raise VerispecError(f"lookup first needs an n-gram size >= 1 (0 turns it off), got {self.lookup}")
        if self.trial_steps < 1 or self.gap < 0:
            raise VerispecError(f"re-tuning the skip set needs trial_steps >= 1 and gap >= 0, got {self.trial_steps}, {self.gap}")
