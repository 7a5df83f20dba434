"""Every system `verispec bench` can run, described as data: who runs it, on which backend, drafting with what,
in chains or trees, with K fixed or tuned from measured costs. `runner.build_systems` reads these fields; nothing
parses a system's name.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a system drafts with (`drafter`): the bench's own names for its sources, not --draft specs.
NONE, NGRAM, CORPUS, DRAFT, DISTILLED, SELF, MEDUSA, EAGLE, SUFFIX = (
    "none", "ngram", "ngram-corpus", "draft", "distilled", "self", "medusa", "eagle", "suffix")
SUFFIX_DRAFT = "suffix+draft"  # the composite: suffix decoding, else the --draft model, chosen each step
SUFFIX_EAGLE = "suffix+eagle"  # the composite: suffix decoding, else the EAGLE head (BenchConfig.eagle)
VERISPEC, HF, LLAMACPP = "verispec", "hf", "llama.cpp"  # who runs the loop (`family`)


@dataclass(frozen=True)
class SystemSpec:
    """One bench system.

    name: what the report and --systems call it.
    family: whose decoding loop runs: verispec's, Hugging Face's `generate` or llama-cpp-python's.
    drafter: NONE (plain), NGRAM (prompt lookup), SUFFIX (suffix decoding), CORPUS (corpus n-grams), DRAFT (the --draft model), DISTILLED
        (the distilled draft), SELF (self-speculation), MEDUSA or EAGLE (heads), SUFFIX_DRAFT (suffix decoding and
        the --draft model behind one composite drafter), SUFFIX_EAGLE (suffix decoding and the EAGLE head, likewise).
    llamacpp: verispec's loop on llama.cpp's kernels (the target and draft as llama.cpp models).
    tree: drafts the bench's tree (BenchConfig.tree) instead of chains.
    auto: K (or the tree's budget) tuned from pass costs measured at start.
    lookup: copies from the context first (self-speculation, EAGLE).
    argmax: the head drafts its argmax as one-hot drafts (vLLM's way).
    retune: self-speculation re-chooses its skip set while decoding (native runner only).
    peer: a peer's speculative setting, run once per K of BenchConfig.peer_num_draft_tokens.
    """

    name: str
    family: str
    drafter: str
    llamacpp: bool = False
    tree: bool = False
    auto: bool = False
    lookup: bool = False
    argmax: bool = False
    retune: bool = False
    peer: bool = False

    @property
    def needs_llamacpp(self) -> bool:
        """Whether it needs llama-cpp-python and GGUF files."""
        return self.family == LLAMACPP or self.llamacpp


def _verispec(name: str, drafter: str, **options) -> SystemSpec:
    return SystemSpec(name, VERISPEC, drafter, **options)


CATALOG: tuple[SystemSpec, ...] = (
    _verispec("verispec-plain", NONE),
    SystemSpec("hf-generate", HF, NONE),
    SystemSpec("hf-assisted", HF, DRAFT),
    SystemSpec("hf-prompt-lookup", HF, NGRAM, peer=True),
    _verispec("verispec-draft", DRAFT),
    _verispec("verispec-ngram", NGRAM),
    _verispec("verispec-ngram-auto", NGRAM, auto=True),
    _verispec("verispec-suffix", SUFFIX),
    _verispec("verispec-suffix-auto", SUFFIX, auto=True),
    _verispec("verispec-suffix-tree", SUFFIX, tree=True),
    _verispec("verispec-suffix-draft", SUFFIX_DRAFT),
    _verispec("verispec-suffix-draft-auto", SUFFIX_DRAFT, auto=True),
    _verispec("verispec-suffix-draft-tree-auto", SUFFIX_DRAFT, tree=True, auto=True),
    _verispec("verispec-ngram-corpus", CORPUS),
    _verispec("verispec-ngram-corpus-tree", CORPUS, tree=True),
    _verispec("verispec-auto", DRAFT, auto=True),
    _verispec("verispec-draft-tree", DRAFT, tree=True),
    _verispec("verispec-draft-tree-auto", DRAFT, tree=True, auto=True),
    _verispec("verispec-ngram-tree", NGRAM, tree=True),
    _verispec("verispec-distilled", DISTILLED),
    _verispec("verispec-distilled-auto", DISTILLED, auto=True),
    _verispec("verispec-distilled-tree", DISTILLED, tree=True),
    _verispec("verispec-distilled-tree-auto", DISTILLED, tree=True, auto=True),
    # self-speculation (--draft self): BenchConfig.self_draft's skip set
    _verispec("verispec-self", SELF),
    _verispec("verispec-self-auto", SELF, auto=True),
    _verispec("verispec-self-lookup-auto", SELF, auto=True, lookup=True),
    _verispec("verispec-self-retune-auto", SELF, auto=True, retune=True),
    # draft heads (BenchConfig.medusa / .eagle)
    _verispec("verispec-medusa", MEDUSA),
    _verispec("verispec-medusa-auto", MEDUSA, auto=True),
    _verispec("verispec-medusa-tree", MEDUSA, tree=True),
    _verispec("verispec-eagle", EAGLE),
    _verispec("verispec-eagle-auto", EAGLE, auto=True),
    _verispec("verispec-eagle-tree", EAGLE, tree=True),
    _verispec("verispec-eagle-tree-auto", EAGLE, tree=True, auto=True),
    _verispec("verispec-eagle-argmax", EAGLE, argmax=True),
    _verispec("verispec-eagle-lookup", EAGLE, lookup=True),
    _verispec("verispec-eagle-lookup-auto", EAGLE, auto=True, lookup=True),
    _verispec("verispec-suffix-eagle", SUFFIX_EAGLE),
    _verispec("verispec-suffix-eagle-auto", SUFFIX_EAGLE, auto=True),
    # llama.cpp: its own loops, and verispec's on its kernels
    SystemSpec("llamacpp-generate", LLAMACPP, NONE),
    SystemSpec("llamacpp-prompt-lookup", LLAMACPP, NGRAM, peer=True),
    SystemSpec("llamacpp-draft-model", LLAMACPP, DRAFT, peer=True),
    _verispec("verispec-llamacpp-plain", NONE, llamacpp=True),
    _verispec("verispec-llamacpp-draft", DRAFT, llamacpp=True),
    _verispec("verispec-llamacpp-ngram", NGRAM, llamacpp=True),
    _verispec("verispec-llamacpp-auto", DRAFT, llamacpp=True, auto=True),
    _verispec("verispec-llamacpp-ngram-auto", NGRAM, llamacpp=True, auto=True),
    _verispec("verispec-llamacpp-distilled", DISTILLED, llamacpp=True),
    _verispec("verispec-llamacpp-distilled-auto", DISTILLED, llamacpp=True, auto=True),
    _verispec("verispec-llamacpp-distilled-tree", DISTILLED, llamacpp=True, tree=True),
    _verispec("verispec-llamacpp-distilled-tree-auto", DISTILLED, llamacpp=True, tree=True, auto=True),
    _verispec("verispec-llamacpp-ngram-tree", NGRAM, llamacpp=True, tree=True),
)
BY_NAME = {spec.name: spec for spec in CATALOG}
SYSTEMS = tuple(spec.name for spec in CATALOG)
LLAMACPP_SYSTEMS = tuple(spec.name for spec in CATALOG if spec.needs_llamacpp)
DISTILLED_SYSTEMS = tuple(spec.name for spec in CATALOG if spec.drafter == DISTILLED)
SELF_SYSTEMS = tuple(spec.name for spec in CATALOG if spec.drafter == SELF)
HEAD_SYSTEMS = tuple(spec.name for spec in CATALOG if spec.drafter in (MEDUSA, EAGLE, SUFFIX_EAGLE))
