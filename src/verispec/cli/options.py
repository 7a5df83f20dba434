"""Options the commands share (models, sampling, trees, prompts), the config builders and the decoder loader.

The CLI only builds the frozen configs; every default lives in `verispec.config` (options left unset are not passed,
so the dataclass default applies) or in `verispec.models.registry`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from verispec.config import CROSS_SCHEMES, TREE_CHILDREN, Constraint, CrossTokenizerConfig, PromptLookupConfig, SamplingConfig, SelfDraftConfig, SpecConfig, SuffixConfig, TreeConfig
from verispec.serve.config import ServeConfig
from verispec.console import notice
from verispec.errors import VerispecError
from verispec.models.gguf import CACHE_DTYPES
from verispec.models.loading import BACKENDS, DEFAULT_BACKEND, DEFAULT_DRAFT_WEIGHTS, DEFAULT_DTYPE, DEFAULT_TARGET_WEIGHTS, DTYPES, WEIGHT_FORMATS
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, NAMED_MODELS


def default_of(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def add_config_options(p, cls) -> None:
    """One option per field of config dataclass `cls` that carries option metadata (`config.option`): --field-name,
    typed by the field (or its `parse`), its help ending with the default; its dest is the field's name, so
    `build_config` reads it, and an option left unset keeps the dataclass default."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        shown = meta["default_text"] or (("on" if f.default else "off") if meta["switch"] else f.default)
        kwargs = {"dest": f.name, "help": f"{meta['help']} (default: {shown})".replace("%", "%%")}
        if meta["switch"]:
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        elif meta["parse"] is not None:
            kwargs["type"] = _argument_type(meta["parse"])
        elif meta["choices"] is None:
            kwargs["type"] = {"int": int, "float": float, "str": str}[str(f.type).split()[0]]
        for key in ("choices", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        p.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _argument_type(parse):
    """A field's `parse` as an argparse type: its one-line VerispecError becomes argparse's usage error."""
    def convert(text: str):
        try:
            return parse(text)
        except VerispecError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__  # argparse names the type in its message
    return convert


def build_config(cls, args: argparse.Namespace, mapping: dict[str, str]):
    """Build a config from the options the user set; unset options keep the dataclass default."""
    values = {field: getattr(args, opt) for field, opt in mapping.items() if getattr(args, opt, None) is not None}
    return cls(**values)


SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty"}
SPEC_OPTIONS = {"num_draft_tokens": "num_draft_tokens", "max_new_tokens": "max_new_tokens", "stop": "stop",
                "draft_stop": "draft_stop", "logprobs": "logprobs", "logprobs_mode": "logprobs_mode"}
LOOKUP_OPTIONS = {"max_ngram": "ngram_max", "min_ngram": "ngram_min"}
SUFFIX_OPTIONS = {"capacity": "suffix_capacity", "scope": "suffix_scope"}  # --suffix-scope: `verispec serve` only
CROSS_OPTIONS = {"scheme": "cross_scheme"}
TREE_OPTIONS = {"budget": "tree_budget", "top_k": "tree_top_k", "children": "tree_children"}
SERVE_OPTIONS = {name: name for name in ServeConfig.__dataclass_fields__}
API_KEY_ENV = "VERISPEC_API_KEY"


def add_model_options(p: argparse.ArgumentParser, draft: str = DEFAULT_DRAFT) -> None:
    """`draft`: this command's default --draft."""
    names = ", ".join(NAMED_MODELS)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"named default ({names}), HF model directory or .gguf file (default: %(default)s)")
    p.add_argument("--draft", default=draft,
                   help="a model spec like --target, 'ngram' (prompt lookup), 'ngram-corpus[:TABLE]' or a .ngram file "
                        "(corpus n-grams, see `verispec ngram build`), 'self' / 'self:SKIP' / 'self:FILE' (the target "
                        "drafts with sublayers skipped; SKIP like a4-9,m12,20-; FILE from `verispec self-tune`), "
                        "'medusa' / 'eagle' (the Medusa / EAGLE-3 head shipped for the default target), 'medusa:DIR' "
                        "(the Medusa repository's format), 'eagle:DIR' (an EAGLE-3 head, SpecForge's format), "
                        "'suffix[:FILE]' (suffix decoding), lookups and one costly drafter joined by '+' and chosen per "
                        "step (suffix+MODEL, ngram+eagle) or 'none' (plain decoding) (default: %(default)s)")
    p.add_argument("--self-retune", action="store_true",
                   help="--draft self: re-choose the skipped sublayers while decoding, from each request's verified "
                        "steps (SWIFT-style; native runner)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["auto", *DTYPES],
                   help="target compute dtype; auto: float32 on the CPU, which keeps greedy output equal to token-by-token "
                        "decoding, bfloat16 on CUDA (default: %(default)s)")
    p.add_argument("--draft-dtype", default=None, choices=["auto", *DTYPES], help="draft compute dtype (speed only; default: same as --dtype)")
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="auto, cpu, cuda or cuda:N; auto is CUDA when torch sees a GPU (then the torch route, a static "
                        "cache and compiled passes) (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch route: a static key/value cache and passes compiled with torch.compile (always on CUDA)")
    p.add_argument("--target-weights", default=DEFAULT_TARGET_WEIGHTS, choices=["packed", "dense"],
                   help="packed: same weights in oneDNN's layout, faster multi-token passes on CPU (default: %(default)s)")
    p.add_argument("--draft-weights", default=DEFAULT_DRAFT_WEIGHTS, choices=list(WEIGHT_FORMATS),
                   help="int8: weight-only int8 draft, changes speed and acceptance only (default: %(default)s)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=list(BACKENDS),
                   help="llama.cpp: run GGUF models with llama.cpp's kernels (needs llama-cpp-python) (default: %(default)s)")
    p.add_argument("--kv-cache", default=None, choices=list(CACHE_DTYPES),
                   help="native runner: the target's key/value cache; float16 halves the bytes attention reads, float32 "
                        f"keeps every bit of the keys and values (default: {CACHE_DTYPES[0]})")
    p.add_argument("--ngram-max", type=int, help=f"prompt lookup: longest n-gram matched (default: {default_of(PromptLookupConfig, 'max_ngram')})")
    p.add_argument("--ngram-min", type=int, help=f"prompt lookup: shortest n-gram matched (default: {default_of(PromptLookupConfig, 'min_ngram')})")
    p.add_argument("--suffix-capacity", type=int, metavar="N",
                   help="--draft suffix[:FILE]: tokens of earlier requests' outputs kept, the oldest dropped first "
                        f"(default: {default_of(SuffixConfig, 'capacity')})")
    p.add_argument("--draft-lookup", type=int, default=None, metavar="N",
                   help="a draft model or an EAGLE head copies from the context first where its last n-gram (n >= N) "
                        "occurred before; "
                        "0 turns it off (default: the draft's own setting, e.g. the distilled draft's)")
    p.add_argument("--draft-context", type=int, default=None, metavar="N",
                   help="a draft model reads only the last N tokens of each prompt: a long prompt's draft pass costs "
                        "N tokens; only the draft's guesses change, never the output (default: all)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="a draft model's LM head keeps N token ids, the most frequent first (native runner): each "
                        "draft token costs less; q is 0 elsewhere, so the output is unchanged (default: all)")
    p.add_argument("--cross-scheme", choices=list(CROSS_SCHEMES), default=None,
                   help="a draft model with another tokenizer than the target's drafts text: 'string' (its greedy text "
                        "read as target tokens) or 'intersection' (its q on the tokens both share); exact either way "
                        f"(default: {default_of(CrossTokenizerConfig, 'scheme')})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, help=f"0 is greedy (default: {default_of(SamplingConfig, 'temperature')})")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--min-p", type=float, help="drop tokens below min-p x top probability (default: 0)")
    p.add_argument("--repetition-penalty", type=float, help="CTRL repetition penalty, 1.0 disables (default: 1.0)")
    p.add_argument("--presence-penalty", type=float,
                   help="subtracted from the logit of each token already in the answer, in [-2, 2] (default: 0)")
    p.add_argument("--frequency-penalty", type=float,
                   help="subtracted per occurrence of a token in the answer so far, in [-2, 2] (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's random generator (default: fresh entropy)")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", type=Path, metavar="FILE",
                            help="structured output: the answer is JSON valid against the schema in FILE (speculation "
                                 "stays exact: p is restricted to what the schema allows; forced tokens are free drafts)")
    structured.add_argument("--json-object", action="store_true", help="structured output: the answer is a JSON object")
    structured.add_argument("--regex", metavar="RE", help="structured output: the whole answer matches RE")
    structured.add_argument("--grammar", type=Path, metavar="FILE",
                            help="structured output: the answer follows the grammar in FILE (Lark, or llama.cpp's GBNF)")
    p.add_argument("-k", "--num-draft-tokens", type=int, help=f"K, draft tokens per step (default: {default_of(SpecConfig, 'num_draft_tokens')})")
    p.add_argument("--draft-stop", type=float, metavar="P",
                   help="a draft model's or prompt lookup's chain stops early where the estimated chance that all its "
                        "drafts are accepted (calibrated draft confidence) falls below P; with --auto-k, K is "
                        f"still the tuner's (default: {default_of(SpecConfig, 'draft_stop')}, off)")


def constraint(args: argparse.Namespace) -> Constraint | None:
    """The structured-output constraint the options ask for (--json-schema, --json-object, --regex, --grammar)."""
    if getattr(args, "json_object", False):
        return Constraint("json_object")
    if getattr(args, "regex", None) is not None:
        return Constraint("regex", args.regex)
    for option, kind in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, option, None)
        if path is not None:
            try:
                return Constraint(kind, path.read_text())
            except OSError as err:
                raise VerispecError(f"cannot read --{option.replace('_', '-')} {path}: {err.strerror}") from None
            except UnicodeDecodeError:
                raise VerispecError(f"--{option.replace('_', '-')} {path} is not UTF-8 text") from None
    return None


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The SamplingConfig the sampling and structured-output options ask for."""
    return dataclasses.replace(build_config(SamplingConfig, args, SAMPLING_OPTIONS), constraint=constraint(args))


def add_tree_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-shape", help="tree speculation, static tree: branching factors per depth, e.g. 3,2,1 "
                   "(the root gets 3 children, each of them 2, each of those 1)")
    p.add_argument("--tree-budget", type=int, help="tree speculation, dynamic tree (EAGLE-2 style): at most this many "
                   "nodes, depth K, grown where the draft is most confident")
    p.add_argument("--tree-top-k", type=int, help="dynamic trees: nodes expanded per depth and children per expanded "
                   f"node (default: {default_of(TreeConfig, 'top_k')})")
    p.add_argument("--tree-children", choices=list(TREE_CHILDREN), help="how a sampling draft model picks children: "
                   f"distinct samples, independent samples or its top tokens (default: {default_of(TreeConfig, 'children')})")


def add_decoding_options(p: argparse.ArgumentParser, draft: str = DEFAULT_DRAFT) -> None:
    """What a command that decodes one prompt takes: the models (`draft`: the default --draft), the prompt, sampling
    and trees."""
    add_model_options(p, draft)
    add_prompt_options(p)
    add_sampling_options(p)
    add_tree_options(p)


def tree_config(args: argparse.Namespace) -> TreeConfig | None:
    """The TreeConfig the --tree-* options ask for, or None (a chain)."""
    if args.tree_shape is None and args.tree_budget is None:
        if args.tree_top_k is not None or args.tree_children is not None:
            raise VerispecError("--tree-top-k and --tree-children shape a tree: add --tree-shape or --tree-budget")
        return None
    values = {}
    if args.tree_shape is not None:
        try:
            values["shape"] = tuple(int(b) for b in args.tree_shape.split(","))
        except ValueError:
            raise VerispecError(f"--tree-shape takes branching factors per depth like 3,2,1, got '{args.tree_shape}'") from None
    return TreeConfig(**values, **{f: getattr(args, o) for f, o in TREE_OPTIONS.items() if getattr(args, o) is not None})


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="the prompt text")
    group.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the target's chat template as one user message (default: on when the target has one)")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    return read_text_file(args.prompt_file, "--prompt-file")


def read_text_file(path: Path, option: str) -> str:
    """A file's text for an option, or one line naming the option and why it cannot be read."""
    try:
        return path.read_text()
    except OSError as err:
        raise VerispecError(f"cannot read {option} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise VerispecError(f"{option} {path} is not UTF-8 text") from None


def suffix_config(args: argparse.Namespace, scope: str | None = None) -> SuffixConfig:
    """The SuffixConfig the --suffix-* options ask for; `scope` ("shared" or "key"), where given, overrides
    --suffix-scope (a caller holding the setting elsewhere, a server's config)."""
    config = build_config(SuffixConfig, args, SUFFIX_OPTIONS)
    return config if scope is None else dataclasses.replace(config, scope=scope)


def decoder_kwargs(args: argparse.Namespace, suffix_scope: str | None = None) -> dict:
    """The arguments of `SpeculativeDecoder.load` the model options ask for (`suffix_scope`: see `suffix_config`)."""
    return dict(target=args.target, draft=args.draft, dtype=args.dtype, draft_dtype=args.draft_dtype,
                prompt_lookup=build_config(PromptLookupConfig, args, LOOKUP_OPTIONS),
                suffix=suffix_config(args, suffix_scope),
                target_weights=args.target_weights, draft_weights=args.draft_weights, backend=args.backend,
                draft_lookup=getattr(args, "draft_lookup", None), draft_context=getattr(args, "draft_context", None),
                draft_vocab=getattr(args, "draft_vocab", None), cross=build_config(CrossTokenizerConfig, args, CROSS_OPTIONS),
                self_draft=SelfDraftConfig(retune=getattr(args, "self_retune", False)), device=args.device,
                compile=args.compile, kv_cache=getattr(args, "kv_cache", None))


def load_decoder(args: argparse.Namespace, suffix_scope: str | None = None):
    """The decoder the model options ask for (`suffix_scope`: see `suffix_config`)."""
    from verispec.api import SpeculativeDecoder, set_threads

    set_threads(args.threads)
    decoder = SpeculativeDecoder.load(**decoder_kwargs(args, suffix_scope))
    if decoder.skip_source == "default":
        notice(f"self-speculation with the untuned default skip set {decoder.draft_name}: "
               f"`verispec self-tune --target {args.target}` searches a faster one for this model")
    return decoder
