"""`verispec bench`: systems side by side on a Spec-Bench-style prompt set, interleaved prompt by prompt."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from verispec.api import SpeculativeDecoder
from verispec.bench.catalog import (
    BY_NAME,
    CORPUS,
    DISTILLED,
    DISTILLED_SYSTEMS,
    DRAFT,
    EAGLE,
    HF,
    LLAMACPP,
    LLAMACPP_SYSTEMS,
    NGRAM,
    NONE,
    SELF,
    SUFFIX,
    SUFFIX_DRAFT,
    SUFFIX_EAGLE,
    SYSTEMS,
    SystemSpec,
)
from verispec.bench.report import Record
from verispec.bench.results import runs_json, write_json, write_report
from verispec.bench.systems import HFSystem, LlamaCppGenerate, System, VerispecSystem
from verispec.config import (
    AdaptConfig,
    Constraint,
    CrossTokenizerConfig,
    PromptLookupConfig,
    SamplingConfig,
    SuffixConfig,
    TreeConfig,
)
from verispec.console import stderr_console
from verispec.constraints import grammars_for
from verispec.datasets import DEFAULT_PROMPTS, EDITING_PROMPTS, STRUCTURED_PROMPTS, load_prompts
from verispec.drafters import registry
from verispec.drafters.ngram_corpus import DEFAULT_TABLE
from verispec.drafters.registry import DrafterOptions
from verispec.errors import VerispecError
from verispec.models.loading import DEFAULT_DRAFT_WEIGHTS, WEIGHT_FORMATS, LoadedModel

SPLITS = ("all", "heldout", "train")  # Spec-Bench question ids: odd are held out from distillation (see verispec.distill)


@dataclass(frozen=True)
class BenchConfig:
    """What `verispec bench` measures.

    prompts: Spec-Bench-format JSONL, or several read as one (default: Spec-Bench beside the repository and the
        shipped code_editing, agent, json_extraction and function_call prompts; the last two are decoded under
        each row's JSON schema by every system). categories: Spec-Bench categories to keep (None: all).
    per_category: prompts per category. systems: names from SYSTEMS (None: all that apply).
    split: "heldout" keeps the prompts the distilled draft never saw (odd question ids), "train" the
    others, "all" both. distilled: the distilled draft spec of the verispec-*distilled* systems (None: skip them).
    distilled_weights: the distilled draft's weight format ("int8", as `generate` runs it by default, or "dense").
    num_draft_tokens: K of the chain systems, and the depth of a dynamic tree (equal draft passes).
    tree: the tree the *-tree systems draft (default: a dynamic tree of 16 nodes).
    suffix_store: a suffix store file (`--draft suffix:FILE`) each system drafting with suffix decoding starts
        from, its own copy read at the start; the file is never written (None: every system starts empty).
    ngram_table: the table of verispec-ngram-corpus: "ngram-corpus[:PATH]" or a .ngram path (None: the
        table shipped with verispec; without one the system is skipped).
    adapt: verispec systems whose drafter can adapt (ngram-corpus, draft models, heads) learn online between
        prompts (their acceptance then depends on the prompts before).
    self_draft: the verispec-self* systems' draft: "self" (the skip set searched for this target, see
        `verispec self-tune`), "self:SKIP" or "self:FILE".
    medusa, eagle: the verispec-medusa* / verispec-eagle* systems' heads: "medusa" / "eagle" (the heads shipped
        for the default target; skipped with a notice on another target), "medusa:DIR" / "eagle:DIR", or None
        (skip them).
    peer_num_draft_tokens: K of the peers' speculative decoding (llama.cpp's and Hugging Face's prompt lookup,
        llama.cpp's draft model: llama-cpp-python's loop with the draft GGUF); None: num_draft_tokens.
        With several, each K runs as a system of its own (`llamacpp-prompt-lookup-k1`, ...) and the report
        takes the fastest as the peer's best speculative setting (`report.best_speculative`).
    """

    prompts: str | tuple[str, ...] = (str(DEFAULT_PROMPTS), str(EDITING_PROMPTS), str(STRUCTURED_PROMPTS))
    categories: tuple[str, ...] | None = None
    per_category: int = 5
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    num_draft_tokens: int = 4
    systems: tuple[str, ...] | None = None
    out_dir: str = "artifacts/bench"
    split: str = "all"
    distilled: str | None = "distilled"
    distilled_weights: str = DEFAULT_DRAFT_WEIGHTS
    draft_context: int | None = None  # draft models read only a prompt's last N tokens (None: all)
    draft_vocab: int | None = None  # verispec's --draft model systems cut its LM head to N token ids (None: all)
    draft_lookup: int | None = None  # draft models copy from the context first (N; 0: off; None: their own setting)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)  # verispec's prompt lookup (--ngram-max / --ngram-min)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # verispec's suffix decoding (--suffix-capacity)
    suffix_store: str | None = None  # a store file every suffix system starts from (read, never written; None: empty)
    tree: TreeConfig = TreeConfig(budget=16)
    ngram_table: str | None = None
    adapt: bool = False
    peer_num_draft_tokens: tuple[int, ...] | None = None
    self_draft: str = "self"
    medusa: str | None = "medusa"
    eagle: str | None = "eagle"
    cross: CrossTokenizerConfig = CrossTokenizerConfig()  # a --draft model with another tokenizer than the target's

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise VerispecError(f"unknown split '{self.split}'; choose from {', '.join(SPLITS)}")
        unknown = set(self.systems or ()) - set(SYSTEMS)
        if unknown:
            raise VerispecError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
        if self.per_category < 1:
            raise VerispecError("per_category must be >= 1")
        if self.distilled_weights not in WEIGHT_FORMATS:
            raise VerispecError(f"unknown weight format '{self.distilled_weights}' for the distilled draft; "
                                f"choose one of {', '.join(WEIGHT_FORMATS)}")
        if self.peer_num_draft_tokens is not None and (not self.peer_num_draft_tokens
                                                        or min(self.peer_num_draft_tokens) < 1):
            raise VerispecError(f"peer_num_draft_tokens must be one or more K >= 1, got {self.peer_num_draft_tokens}")
        if self.draft_context is not None and self.draft_context < 1:
            raise VerispecError(f"draft_context must be >= 1 token, got {self.draft_context}")
        if self.draft_lookup is not None and self.draft_lookup < 0:
            raise VerispecError(f"draft_lookup must be >= 0 (0: off), got {self.draft_lookup}")
        if self.draft_vocab is not None and self.draft_vocab < 16:
            raise VerispecError(f"draft_vocab must keep >= 16 token ids, got {self.draft_vocab}")
        if self.suffix_store is not None and not Path(self.suffix_store).is_file():
            raise VerispecError(f"the suffix store {self.suffix_store} does not exist (a bench reads a store, never "
                                "writes one)")


def memory_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Measured read bandwidth: the best of several full reductions over a buffer larger than any cache."""
    buf = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: every parameter once, except the input embedding
    (one row per token) unless it is tied to the output layer."""
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb.data_ptr() != out.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of quantized weights one llama.cpp decoding step reads from a GGUF file: every tensor once,
    except the token embedding (one row per token)."""
    from verispec.models.gguf.gguf_file import GGUFFile

    return sum(t.nbytes for t in GGUFFile(Path(path)).tensors.values() if t.name != "token_embd.weight")


def _peer_ks(config: BenchConfig, name: str) -> list[tuple[str, int]]:
    """(system name, K) of a peer's speculative system: its own name for one K, name-k<K> for each of several."""
    ks = config.peer_num_draft_tokens or (config.num_draft_tokens,)
    return [(name, ks[0])] if len(ks) == 1 else [(f"{name}-k{k}", k) for k in dict.fromkeys(ks)]


def build_systems(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
                  hf_target: LoadedModel | None, hf_draft: LoadedModel | None, context_window: int = 4096) -> list[System]:
    """The systems of `config.systems` (all by default) that these models can run, in that order (catalog.py
    describes each)."""
    wanted = config.systems or SYSTEMS
    llama_target, llama_draft = _llamacpp_models(target, draft, wanted)
    distilled = _distilled(config, target, wanted)
    for model in (draft, llama_draft, distilled):
        if model is not None:
            model.context = config.draft_context
            if config.draft_lookup is not None:
                model.lookup = registry.lookup_first(config.draft_lookup)
    models = _Models(target, draft, hf_target, hf_draft, llama_target, llama_draft, distilled, context_window)
    systems: list[System] = []
    for name in wanted:
        systems += _build(BY_NAME[name], config, models)
    if config.adapt:
        adapters = {}  # one adapter per decoder (verispec-draft and verispec-auto share one)
        for system in systems:
            decoder = system.decoder if isinstance(system, VerispecSystem) else None
            if decoder is not None and decoder.drafter.traits.adaptive \
                    and id(decoder) not in adapters:
                adapters[id(decoder)] = decoder.enable_adaptation(AdaptConfig(background=False))
    return systems


@dataclass
class _Models:
    """What the systems run on, and the draft model's decoder, which verispec-draft, -draft-tree, -draft-tree-auto
    and -auto share (one runner, one adapter)."""

    target: LoadedModel
    draft: LoadedModel | None
    hf_target: LoadedModel | None
    hf_draft: LoadedModel | None
    llama_target: LoadedModel | None
    llama_draft: LoadedModel | None
    distilled: LoadedModel | None
    context_window: int
    shared: dict = field(default_factory=dict)

    def decoder(self, key: str, make) -> SpeculativeDecoder:
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def hf_grammars(self):
        """The structured-output compiler of the Hugging Face target's tokenizer (made once, when first needed)."""
        if "grammars" not in self.shared:
            hf = self.hf_target
            self.shared["grammars"] = grammars_for(hf.tokenizer, hf.model.config.vocab_size, hf.eos_token_ids())
        return self.shared["grammars"]


def _build(spec: SystemSpec, config: BenchConfig, m: _Models) -> list[System]:
    """One catalog entry's systems (several for a peer run at several K; none where its models are missing)."""
    k = config.num_draft_tokens
    eos = m.target.eos_token_ids()
    if spec.needs_llamacpp and m.llama_target is None:
        return []
    if spec.family == HF:
        if m.hf_target is None or (spec.drafter == DRAFT and (m.hf_draft is None or m.draft is None)):
            return []  # Hugging Face systems need the models loaded on torch
        grammars = m.hf_grammars  # structured-output prompts: the schema as a logits processor
        if spec.drafter == NGRAM:
            return [HFSystem(peer, m.hf_target.model, eos, grammars, prompt_lookup_num_tokens=peer_k)
                    for peer, peer_k in _peer_ks(config, spec.name)]
        if spec.drafter == DRAFT:
            return [HFSystem(spec.name, m.hf_target.model, eos, grammars, assistant_model=m.hf_draft.model)]
        return [HFSystem(spec.name, m.hf_target.model, eos, grammars)]
    if spec.family == LLAMACPP:
        source = m.llama_target.source
        if spec.drafter == NGRAM:
            return [LlamaCppGenerate(peer, source, eos, m.context_window, prompt_lookup_num_tokens=peer_k)
                    for peer, peer_k in _peer_ks(config, spec.name)]
        if spec.drafter == DRAFT:
            if m.llama_draft is None:
                return []  # llama-cpp-python's speculative loop with the draft GGUF
            return [LlamaCppGenerate(peer, source, eos, m.context_window, draft_gguf=m.llama_draft.source,
                                     num_draft_tokens=peer_k) for peer, peer_k in _peer_ks(config, spec.name)]
        return [LlamaCppGenerate(spec.name, source, eos, m.context_window)]
    decoder = _verispec_decoder(spec, config, m)
    if decoder is None:
        return []
    if config.suffix_store is not None:
        _suffix_from_store(decoder, config.suffix_store)
    tree = config.tree if spec.tree else None
    if tree is not None and spec.auto and tree.budget is None:
        return []  # a tree sized from measured costs is a dynamic one (a budget)
    tuner = _tuner(decoder, tree.budget if tree is not None else k) if spec.auto else None
    return [VerispecSystem(spec.name, decoder, k, tuner, tree=tree)]


def _verispec_decoder(spec: SystemSpec, config: BenchConfig, m: _Models) -> SpeculativeDecoder | None:
    """The decoder a verispec system runs (None: its drafter or models are missing here)."""
    target = m.llama_target if spec.llamacpp else m.target
    if spec.drafter == NONE:
        return SpeculativeDecoder(target, "none")
    if spec.drafter == NGRAM:
        return SpeculativeDecoder(target, "ngram", options=DrafterOptions(prompt_lookup=config.prompt_lookup))
    if spec.drafter == SUFFIX:
        return SpeculativeDecoder(target, "suffix", options=DrafterOptions(suffix=config.suffix))
    if spec.drafter == CORPUS:
        return _corpus_decoder(config, target)
    if spec.drafter == DISTILLED:
        return SpeculativeDecoder(target, m.distilled) if m.distilled is not None else None
    if spec.drafter == SUFFIX_DRAFT:
        if m.draft is None:
            return None
        from verispec.drafters.composite import CompositeDrafter
        from verispec.drafters.suffix import SuffixDrafter

        model = SpeculativeDecoder(target, m.draft, options=_draft_options(config))  # its own runner
        return SpeculativeDecoder(target, CompositeDrafter([SuffixDrafter(config.suffix), model.drafter],
                                                           [SUFFIX, model.draft_name]))
    if spec.drafter == DRAFT:
        draft = m.llama_draft if spec.llamacpp else m.draft
        if draft is None:
            return None  # the remaining systems need a draft model
        if spec.llamacpp:
            return SpeculativeDecoder(target, draft)
        return m.decoder("draft", lambda: SpeculativeDecoder(target, draft, options=_draft_options(config)))
    if spec.drafter == SELF:
        if spec.retune and target.backend != "native":
            return None  # the on-the-fly choice runs on the native runner's shared caches
        from verispec.config import SelfDraftConfig

        self_draft = SelfDraftConfig(retune=spec.retune, lookup=2 if spec.lookup else 0)
        return SpeculativeDecoder(target, config.self_draft, self_draft=self_draft)
    if spec.drafter == SUFFIX_EAGLE:
        return _head_decoder(config.eagle and f"{SUFFIX}+{config.eagle}", target, DrafterOptions(suffix=config.suffix))
    # EAGLE: lookup first only where named (a shipped head's manifest may turn it on), n-grams of 2 and more
    options = DrafterOptions(draft_lookup=2 if spec.lookup else 0, head_argmax=spec.argmax) \
        if spec.drafter == EAGLE else DrafterOptions()
    return _head_decoder(config.eagle if spec.drafter == EAGLE else config.medusa, target, options)


def _suffix_from_store(decoder: SpeculativeDecoder, path: str) -> None:
    """Each suffix decoding drafter of the decoder (alone or a composite's member) starts from the store in `path`,
    its own copy: the systems do not see each other's outputs, and the file stays as it was."""
    from verispec.drafters.suffix import SuffixDrafter

    for drafter in getattr(decoder.drafter, "members", [decoder.drafter]):
        if isinstance(drafter, SuffixDrafter):
            drafter.start_from(path, registry.store_tokenizer(decoder.target), decoder.runner.vocab_size)


def _draft_options(config: BenchConfig) -> DrafterOptions:
    """How verispec's systems drafting with the --draft model set it up (`--cross-*`, `--draft-vocab`)."""
    return DrafterOptions(cross=config.cross, draft_vocab=config.draft_vocab)


def _distilled(config: BenchConfig, target: LoadedModel, wanted) -> LoadedModel | None:
    """The distilled draft for `target`, loaded fresh (each decoder gets its own runner), if asked for."""
    from verispec.models.loading import distilled_path, load_distilled_draft

    if not config.distilled or not set(wanted) & set(DISTILLED_SYSTEMS):
        return None
    if distilled_path(config.distilled) is None:
        raise VerispecError(f"--distilled '{config.distilled}' is not a distilled draft directory")
    return load_distilled_draft(config.distilled, target, config.distilled_weights)


def _corpus_decoder(config: BenchConfig, target: LoadedModel) -> SpeculativeDecoder | None:
    """The corpus n-gram system's decoder: the configured table, else the shipped one if it fits the target."""
    if config.ngram_table is not None:
        table = config.ngram_table
        return SpeculativeDecoder(target, table if registry.parse_draft(table).kind == registry.CORPUS else f"ngram-corpus:{table}")
    if not DEFAULT_TABLE.is_file():
        return None
    try:
        return SpeculativeDecoder(target, "ngram-corpus")
    except VerispecError as err:  # the shipped table is for the default target's tokenizer
        stderr_console().print(f"skipping verispec-ngram-corpus: {err}")
        return None


def _head_decoder(spec: str | None, target: LoadedModel, options: DrafterOptions) -> SpeculativeDecoder | None:
    """The decoder of a head system, or None to skip it: no head given, or a shipped one made for another target."""
    if spec is None:
        return None
    try:
        return SpeculativeDecoder(target, spec, options=options)
    except VerispecError as err:
        if ":" in spec:
            raise
        stderr_console().print(f"skipping the {spec} systems: {err}")
        return None


def _tuner(decoder: SpeculativeDecoder, k: int):
    stderr_console().print(f"measuring pass costs for auto-tuning ({decoder.draft_name} draft) ...")
    return decoder.auto_tuner(max(k, 8))


def _llamacpp_models(target: LoadedModel, draft: LoadedModel | None, wanted) -> tuple:
    """llama.cpp versions of the GGUF target and draft, when llama-cpp-python is installed."""
    from verispec.models.runners.llamacpp import llamacpp_available
    from verispec.models.loading import load_model

    if not set(wanted) & set(LLAMACPP_SYSTEMS) or not llamacpp_available() or not target.source.endswith(".gguf"):
        return None, None
    llama_draft = None
    if draft is not None and draft.source.endswith(".gguf"):
        llama_draft = load_model(draft.name, backend="llama.cpp")
    return load_model(target.name, backend="llama.cpp"), llama_draft


def by_turns(prompts: list) -> list:
    """The prompts reordered to take categories in turns (first of each, then second of each, ...), so
    drift over a long run, or a bench cut short (its partial results), touches every category alike."""
    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    ordered = []
    for i in range(max(len(g) for g in groups.values())):
        ordered += [g[i] for g in groups.values() if i < len(g)]
    return ordered


def prompt_sampling(sampling: SamplingConfig, prompt) -> SamplingConfig:
    """The sampling settings for one prompt: constrained by its JSON schema where it has one."""
    return sampling if prompt.schema is None else replace(sampling, constraint=Constraint("json_schema", prompt.schema))


def run_bench(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
              hf_target: LoadedModel | None = None, hf_draft: LoadedModel | None = None) -> dict:
    """Run every system on every prompt (interleaved), write JSON, markdown and plots; return the report.

    `target` / `draft` run verispec's systems; `hf_target` / `hf_draft` (default: the same models)
    run Hugging Face's, so they can be loaded as users would load them.
    """
    if hf_target is None and target.model is not None:
        hf_target, hf_draft = target, hf_draft or draft
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    prompts = load_prompts(config.prompts, list(config.categories) if config.categories else None, config.per_category,
                           split=None if config.split == "all" else config.split)
    if not prompts:
        raise VerispecError(f"no prompts selected from {', '.join(config.prompts) if isinstance(config.prompts, tuple) else config.prompts}")
    prompts = by_turns(prompts)
    encoder = SpeculativeDecoder(target, "none")
    prompt_ids = [encoder.encode(prompt.text, chat=None) for prompt in prompts]
    # llama.cpp's own decoding keeps an (n_ctx x vocab) score buffer: size its context from the prompts
    context = max(len(ids) for ids in prompt_ids) + config.max_new_tokens + config.num_draft_tokens + 8
    systems = build_systems(config, target, draft, hf_target, hf_draft, context_window=max(512, context))
    sampling = SamplingConfig(temperature=config.temperature)
    records: list[Record] = []
    failures: list[dict] = []
    for system in systems:  # warm-up: first calls pay for kernel set-up, not for decoding
        system.run(encoder.encode("Hello"), sampling, 4, config.seed)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # llama.cpp's kernels and the native runner read the GGUF's quantized weights (the torch route, float ones)
    reads_gguf = target.backend == "native" or any(s.family == "llama.cpp" or s.name in LLAMACPP_SYSTEMS for s in systems)
    gguf_bytes = gguf_bytes_per_token(target.source) if reads_gguf else None
    head = {"config": asdict(config), "partial": True, "target": target.name, "draft": draft.name if draft else None,
            "dtype": str(target.dtype), "target_weights": target.weights, "draft_weights": draft.weights if draft else None,
            "target_backend": target.backend, "memory_bandwidth_gbs": memory_bandwidth_gbs(),
            "weight_bytes_per_token": (gguf_bytes if target.backend == "native"
                                       else weight_bytes_per_token(hf_target.model) if hf_target is not None else None)}
    if reads_gguf:
        head["gguf_bytes_per_token"] = gguf_bytes
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console()) as progress:
        task = progress.add_task("bench", total=len(prompts) * len(systems))
        for prompt, ids in zip(prompts, prompt_ids):
            for system in systems:
                progress.update(task, description=f"{prompt.category} q{prompt.question_id} {system.name}")
                try:  # a structured-output prompt is decoded under its schema by every system
                    run = system.run(ids, prompt_sampling(sampling, prompt), config.max_new_tokens,
                                     config.seed + prompt.question_id)
                except Exception as err:  # noqa: BLE001 (recorded, printed and reported below)
                    # one system failing on one prompt (a context too long for it, a backend error) is
                    # recorded and the bench goes on: the other systems' figures are still worth having
                    failures.append({"system": system.name, "question_id": prompt.question_id,
                                     "category": prompt.category, "prompt_tokens": len(ids),
                                     "error": f"{type(err).__name__}: {err}"})
                    progress.console.print(f"[red]{system.name} failed on q{prompt.question_id}[/red]: {err}")
                else:
                    records.append(Record(system.name, prompt.question_id, prompt.category, run))
                progress.advance(task)
            progress.console.print(f"{prompt.category} q{prompt.question_id}: " + ", ".join(
                f"{r.system} {r.run.tokens_per_second:.2f} tok/s" for r in records if r.question_id == prompt.question_id))
            # partial results after every prompt, so a bench cut short still leaves its measurements
            write_json(out / "bench.json", {**head, "runs": runs_json(records), "failures": failures})
    if not records:
        raise VerispecError(f"every system failed on every prompt; first error: {failures[0]['error']}")
    return write_report(out, {**head, "partial": False}, records, failures, greedy=sampling.greedy)
