"""One harness for sampled exactness: every drafter family on every backend, chains and trees, sampling settings.

A cell of the grid is (drafter family, backend, draft shape, sampling setting). It decodes N copies of one prompt
in one ragged batch, each with its own seed, keeps the first D tokens of each (a step's drafts and its bonus
position: D = 4 for chains of 3, 3 for trees 2 deep, one more for families whose first drafts come in the second
step), and compares their joint distribution (over all 8^D sequences of an 8-token vocabulary) with the target's
exact one, computed from the target's own processed distributions (the oracle: the same runner, one sequence at
a time, `logits_to_probs`).
It also checks that the cell exercised every path of the rule: drafts were proposed, some were accepted, some
steps ended in a rejection (a recovered token) and some, after drafts, with a bonus token.

`tests/test_exactness_grid.py` runs the grid and `tests/test_exactness_grid_power.py`, for each standard wrong rule (`tests/verifier_mutants.py`),
checks that the grid fails; `benchmarks/exactness_mutants.py` prints that as a table.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from conftest import noisy_copy, tiny_model
from verispec.chisquare import FitResult, chi_square_test
from verispec.config import NGramConfig, PromptLookupConfig, SamplingConfig, SpecConfig, TreeConfig
from verispec.engine import SpeculativeEngine
from verispec.sampling import Processors, logits_to_probs

V = 8  # vocabulary: small enough that the joint of 3 tokens has 512 cells
LAYERS = 4  # self-speculation skips sublayers of some of them
PROMPT = [1, 5, 2, 6, 1, 5, 2, 6, 1, 5]  # repeats itself: prompt lookup and n-grams find continuations
N = 3000  # sequences per cell; twice as many for late families, whose drafts start a step later
THRESHOLD = 1e-4  # a correct rule fails a cell with this probability (chi-square p-value)

SETTINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.7-topk4": SamplingConfig(temperature=0.7, top_k=4),
    "T1.2-topp0.7": SamplingConfig(temperature=1.2, top_p=0.7),
    "T1-minp0.15": SamplingConfig(temperature=1.0, min_p=0.15),
    "T0.9-all-rep1.5": SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.5),
    "T1-pres-freq-bias": SamplingConfig(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6,
                                        logit_bias=((3, 1.5), (6, -2.0))),
}
SHAPES = {  # draft shapes: a chain of K tokens, or a tree, and how a sampling drafter picks a node's children
    "chain": None,
    "tree-sampled": TreeConfig(shape=(2, 2), children="without_replacement"),
    "tree-iid": TreeConfig(shape=(2, 2), children="iid"),
    "tree-top": TreeConfig(shape=(2, 2), children="top"),
    "tree-budget": TreeConfig(budget=5, top_k=2),
}
TESTED = 4  # tokens of each sequence whose joint distribution is tested in a chain cell (8^4 sequences)
LATE = {"medusa", "eagle"}  # heads draft from the target's features: the step that reads the prompt drafts nothing


@lru_cache(maxsize=None)
def target_model() -> torch.nn.Module:
    return tiny_model("qwen2", vocab=V, seed=3, layers=LAYERS, sharpness=4.0)


# --- backends --------------------------------------------------------------------------------------------
def torch_runner(model):
    from verispec.models.runners.hf import ModelRunner

    return ModelRunner(model)


_gguf_dir = None


def gguf_of(model, vocab: bool = False):
    """A float32 GGUF of `model`, written once per model (with a placeholder vocabulary for llama.cpp)."""
    import tempfile
    from pathlib import Path

    from tiny_gguf import T, gguf_from_hf

    global _gguf_dir
    _gguf_dir = _gguf_dir or Path(tempfile.mkdtemp(prefix="verispec-grid-"))
    path = _gguf_dir / f"m{id(model)}{'-vocab' if vocab else ''}.gguf"
    if not path.exists():
        gguf_from_hf(model, path, T.F32, vocab=vocab)
    return path


def native_runner(model):
    """The native runner of a float32 GGUF of `model`."""
    from verispec.models.gguf.model import load_gguf
    from verispec.models.gguf.runner import NativeRunner

    return NativeRunner(load_gguf(gguf_of(model), show_progress=False))


def llamacpp_runner(model):
    """llama.cpp's evaluation of a float32 GGUF of `model` (one thread: the model is tiny). With float32 weights a
    pass's width changes its logits by float rounding only, far below what a chi-square test of this size sees;
    the quantized kernels of real models are where width changes them by more (docs/exactness.md)."""
    from verispec.models.runners.llamacpp import LlamaCppRunner

    return LlamaCppRunner(gguf_of(model, vocab=True), context_window=64, threads=1)


BACKENDS = {"torch": torch_runner, "native": native_runner, "llama.cpp": llamacpp_runner}
SEQUENTIAL = {"llama.cpp"}  # backends that decode one sequence at a time: a cell's sequences run one by one


# --- drafter families ----------------------------------------------------------------------------------------
def draft_model(target, backend):
    from verispec.drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(BACKENDS[backend](noisy_copy(target_model(), 1.0, seed=4)), V)


def prompt_lookup(target, backend):
    from verispec.drafters.prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1))


def ngram_corpus(target, backend):
    import numpy as np

    from verispec.drafters.ngram_corpus import CorpusNGramDrafter
    from verispec.ngram.build import NGramBuildConfig, NGramCounter

    g = torch.Generator().manual_seed(0)
    stream = (PROMPT * 40)[:400]
    noise = torch.randint(0, V, (400,), generator=g).tolist()
    mixed = [n if torch.rand(1, generator=g).item() < 0.4 else s for s, n in zip(stream, noise)]
    counter = NGramCounter(3, V)
    counter.add(np.asarray(mixed, dtype=np.int64))
    table = counter.table(NGramBuildConfig(max_n=3, min_count=1), V, {"tokenizer_sha256": "none"})
    return CorpusNGramDrafter(table, V, NGramConfig(max_n=3))


def self_speculation(target, backend):
    from verispec.drafters.self_draft import SelfDrafter
    from verispec.models.skip import SkipSet

    return SelfDrafter(target, SkipSet.parse("a1,m2", LAYERS))


def medusa(target, backend):
    from verispec.drafters.medusa import MedusaDrafter
    from verispec.models.heads.medusa import MedusaHeads

    torch.manual_seed(0)
    lm_head = target_model().get_output_embeddings().weight.detach()
    heads = MedusaHeads(2, 1, lm_head.shape[1], lm_head.shape[0])
    with torch.no_grad():
        for h in heads.heads:
            h[0].linear.weight.normal_(0, 0.05)
            h[-1].weight.copy_(lm_head + 0.5 * lm_head.std() * torch.randn_like(lm_head))
    return MedusaDrafter(target, heads.eval())


def eagle(target, backend):
    from verispec.drafters.eagle import EagleDrafter
    from verispec.models.heads.eagle3 import Eagle3Config, Eagle3Head

    model = target_model()
    E = model.config.hidden_size
    config = Eagle3Config(hidden=E, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=V, draft_vocab=6,
                          target_hidden=E, aux_layers=(0, 2, 3))
    torch.manual_seed(0)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.set_vocabulary(torch.tensor([0, 1, 2, 5, 6, 7]))
    return EagleDrafter(target, head.eval())


def distilled(target, backend):
    """The distilled draft's kind: a small model over a reduced vocabulary (q is 0 outside it), mapped to target ids."""
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.models.distilled import TinyDraftConfig, VocabMap
    from verispec.models.runners.mapped import MappedVocabRunner

    torch.manual_seed(2)
    shape = TinyDraftConfig(draft_vocab_size=5, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, max_positions=128)
    small = shape.build().eval()
    vocab = VocabMap.from_target_ids(torch.tensor([0, 2, 5, 6, 7]), V)
    if backend == "native":
        from verispec.models.gguf.convert import model_from_torch
        from verispec.models.gguf.runner import NativeRunner

        return DraftModelDrafter(MappedVocabRunner(NativeRunner(model_from_torch(small, qtype=0)), vocab), V)
    return DraftModelDrafter(MappedVocabRunner(small, vocab), V)


def predicted_output(target, backend):
    """A request's predicted output (`core.prediction`) drafts the row's chain while the answer follows it, prompt
    lookup where it does not: the prediction is `PREDICTED`, passed with every sequence (`run_cell`), which sampled
    answers follow for a while (accepted drafts) and leave (recovered tokens, then the prediction realigned)."""
    return prompt_lookup(target, backend)


PREDICTED = [2, 6, 1, 5, 2, 6]  # the prediction the predicted-output cells send: how PROMPT goes on


# (appended last: the settings rotate through the families in this order, and earlier cells keep theirs)
FAMILIES = {"draft-model": draft_model, "prompt-lookup": prompt_lookup, "ngram-corpus": ngram_corpus,
            "self-speculation": self_speculation, "medusa": medusa, "eagle": eagle, "distilled": distilled,
            "predicted-output": predicted_output}
DETERMINISTIC = {"prompt-lookup", "predicted-output"}  # a one-hot q: their trees have no sampled / top choice
UNSUPPORTED = {  # (backend, family): why the family cannot run there (the engine refuses it with that reason)
    ("llama.cpp", "self-speculation"): "skips sublayers inside the target's pass, which llama.cpp does not expose",
    ("llama.cpp", "medusa"): "reads the target's hidden states, which llama.cpp does not expose",
    ("llama.cpp", "eagle"): "reads the target's hidden states, which llama.cpp does not expose",
}


# --- the grid --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    family: str
    backend: str
    shape: str
    setting: str

    @property
    def id(self) -> str:
        return f"{self.family}-{self.backend}-{self.shape}-{self.setting}"

    @property
    def late(self) -> bool:
        """The family drafts nothing in the step that reads the prompt: its first drafts come in step two."""
        return self.family in LATE or (self.family == "self-speculation" and self.backend == "native")

    @property
    def k(self) -> int:
        """Drafts per step: chains of 3 (2 for late families), so that a rejection can follow an acceptance and an
        acceptance a rejection; trees 2 deep."""
        return (TESTED - 1 - int(self.late)) if self.shape == "chain" else 2

    @property
    def depth(self) -> int:
        """Tokens tested: the step's drafts and its bonus position, after the plain first step of a late family."""
        return self.k + 1 + int(self.late)


# Settings added after the grid's rotation was fixed run in a cell of their own on each backend (family, shape): a
# longer rotation would move every cell's setting, and the power test's cells with it.
EXTRA_SETTINGS = {"T1-pres-freq-bias": ("draft-model", "chain")}  # a sampled q: p and q penalised alike
# Cells added beside the rotation's on each backend, (family, shape, setting): a predicted output's chain under the
# repetition penalty, where the bonus token's distribution differs from the last draft's (the rotation's cells of
# this family cannot tell them apart on this prompt: the "bonus from p_n" rule passes them)
EXTRA_CELLS = [("predicted-output", "chain", "T0.9-all-rep1.5")]


def grid() -> list[Cell]:
    """Every family on every backend, as a chain and as the trees it can draft, each sampling setting on each
    backend at least once: settings rotate through the cells in order (EXTRA_SETTINGS in cells of their own)."""
    cells = []
    for backend in BACKENDS:
        rotation = itertools.cycle([name for name in SETTINGS if name not in EXTRA_SETTINGS])
        for family in FAMILIES:
            if (backend, family) in UNSUPPORTED:
                continue
            shapes = ["chain", "tree-budget"] if family in DETERMINISTIC else ["chain", "tree-sampled", "tree-top"]
            if family == "draft-model":
                shapes.append("tree-iid")
            # a family's extra cells first: a wrong rule that only they show is caught without running the others
            cells += [Cell(family, backend, shape, setting) for extra, shape, setting in EXTRA_CELLS if extra == family]
            cells += [Cell(family, backend, shape, next(rotation)) for shape in shapes]
        cells += [Cell(family, backend, shape, setting) for setting, (family, shape) in EXTRA_SETTINGS.items()
                  if (backend, family) not in UNSUPPORTED]
    return cells


# --- one cell ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    fits: list[FitResult]
    drafted: int
    accepted: int
    recovered: int
    bonus: int
    samples: int
    notes: list[str] = field(default_factory=list)

    @property
    def p_value(self) -> float:
        """The smallest p-value of the cell's fits."""
        return min(f.p_value for f in self.fits)

    @property
    def paths_ran(self) -> bool:
        return self.drafted > 0 and self.accepted > 0 and self.recovered > 0 and self.bonus > 0


_engines: dict[tuple[str, str], tuple] = {}


def engine_for(family: str, backend: str):
    """(engine, oracle runner) for a family on a backend, built once (models are deterministic)."""
    key = (family, backend)
    if key not in _engines:
        target = BACKENDS[backend](target_model())
        _engines[key] = (SpeculativeEngine(target, FAMILIES[family](target, backend), set()), target)
    return _engines[key]


_joints: dict[tuple[str, str, int], dict] = {}


def exact_joint_for(backend: str, setting: str, depth: int) -> dict[tuple[int, ...], float]:
    """`exact_joint` on the backend's target, computed once per setting and depth (the mutants reuse it)."""
    key = (backend, setting, depth)
    if key not in _joints:
        _joints[key] = exact_joint(BACKENDS[backend](target_model()), SETTINGS[setting], depth)
    return _joints[key]


def exact_joint(runner, sampling: SamplingConfig, depth: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of its first `depth` tokens after PROMPT (sequences of positive mass)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, mass in joint.items():
            context = PROMPT + list(prefix)
            logits = runner.forward(runner.new_state(1), [context], [1])[0, -1:].float()  # (1, V)
            seen = Processors(sampling, len(PROMPT)).seen(context, V)  # the penalties' history, or None
            probs = logits_to_probs(logits, sampling, seen)[0].double()  # (V,)
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        joint = grown
    return joint


def run_cell(cell: Cell, n: int | None = None, seed: int = 0, tuner=None) -> Outcome:
    """Decode the cell's sequences and fit their joint; `tuner` (a `tuning.KTuner`) sizes drafts from its costs."""
    n = n or N * (2 if cell.late else 1)
    engine, _ = engine_for(cell.family, cell.backend)
    sampling, tree, depth = SETTINGS[cell.setting], SHAPES[cell.shape], cell.depth
    spec = SpecConfig(num_draft_tokens=cell.k, max_new_tokens=depth, stop_at_eos=False, tree=tree)
    tally = {"drafted": 0, "accepted": 0, "recovered": 0, "bonus": 0}

    def observe(seq, draft, p, verdict, u):  # steps that drafted: which way each ended
        if len(draft):
            tally["drafted"] += len(draft)
            tally["accepted"] += verdict.num_accepted
            tally["bonus" if verdict.bonus else "recovered"] += 1

    guess = PREDICTED if cell.family == "predicted-output" else None
    engine.observers.append(observe)
    try:
        if cell.backend in SEQUENTIAL:
            seqs = [engine.generate([PROMPT], sampling, spec, seeds=seed + i, predictions=[guess])[0] for i in range(n)]
        else:
            seqs = engine.generate([PROMPT] * n, sampling, spec, seeds=seed, tuner=tuner, predictions=[guess] * n)
    finally:
        engine.observers.remove(observe)
    exact = exact_joint_for(cell.backend, cell.setting, depth)
    samples = [tuple(s.generated[:depth]) for s in seqs]
    return Outcome(fits(samples, exact, depth), tally["drafted"], tally["accepted"], tally["recovered"],
                   tally["bonus"], n)


def fits(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], depth: int) -> list[FitResult]:
    """Chi-square fits of the samples against the exact joint: the joint of all `depth` tokens (cells under 5
    expected pooled), and at each position i the distribution of token i after the most frequent prefix of i - 1
    tokens (position 1: its marginal), where a wrong rule at one position (a bonus, a recovered token) shows with
    the most power."""
    results = [_fit(Counter(samples), exact)]
    for i in range(depth):
        prefix = Counter(s[:i] for s in samples).most_common(1)[0][0]
        observed = Counter(s[i] for s in samples if s[:i] == prefix)
        following: dict[int, float] = {}
        for seq, mass in exact.items():
            if seq[:i] == prefix:
                following[seq[i]] = following.get(seq[i], 0.0) + mass
        results.append(_fit(observed, following))
    return results


def _fit(observed: Counter, exact: dict) -> FitResult:
    cells = list(exact) + [key for key in observed if key not in exact]  # impossible outcomes fail the fit
    counts = torch.tensor([observed.get(key, 0) for key in cells], dtype=torch.float64)
    probs = torch.tensor([exact.get(key, 0.0) for key in cells], dtype=torch.float64)
    return chi_square_test(counts, probs)


def check(outcome: Outcome, cell: Cell) -> None:
    """The assertions a correct rule must pass in every cell."""
    assert outcome.paths_ran, (cell.id, outcome)
    assert outcome.p_value > THRESHOLD, (cell.id, outcome.fits)


# --- mutants ---------------------------------------------------------------------------------------------------
def applicable(mutant: str, cells: list[Cell]) -> list[Cell]:
    """The cells a mutant can show in: tree-only mutants in tree cells, chain-only ones in chain cells."""
    from verifier_mutants import CHAIN_ONLY, TREE_ONLY

    if mutant in TREE_ONLY:
        return [c for c in cells if c.shape != "chain"]
    if mutant in CHAIN_ONLY:
        return [c for c in cells if c.shape == "chain"]
    return cells


def caught_by(cells: list[Cell], mutant: str) -> tuple[bool, str]:
    """Run `cells` with the engine verifying by `mutant` until one fails its fits; (caught, how)."""
    from verifier_mutants import installed

    with installed(mutant):
        for cell in applicable(mutant, cells):
            try:
                outcome = run_cell(cell)
            except Exception as err:  # a wrong rule may draw from an empty distribution
                return True, f"{cell.shape}: {type(err).__name__}"
            if outcome.p_value <= THRESHOLD:
                return True, f"{cell.shape}: p={outcome.p_value:.1e}"
    return False, "NOT CAUGHT"


def groups() -> dict[tuple[str, str], list[Cell]]:
    """The grid's cells by (family, backend)."""
    out: dict[tuple[str, str], list[Cell]] = {}
    for cell in grid():
        out.setdefault((cell.family, cell.backend), []).append(cell)
    return out


def coverage_markdown() -> str:
    """The grid as a table (family x backend: the shapes and settings it runs), as docs/exactness.md shows it."""
    by_group = groups()
    backends = list(BACKENDS)
    lines = ["| drafter family | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for family in FAMILIES:
        cells = [", ".join(f"{c.shape} {c.setting}" for c in by_group[(family, b)]) if (family, b) in by_group
                 else f"not run: {UNSUPPORTED[(b, family)]}" for b in backends]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
