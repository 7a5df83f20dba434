"""Load a target or draft model from a spec: a named default, a local HF directory, or a .gguf file.

Loading a GGUF through transformers dequantizes every tensor, which takes about a minute per
billion parameters on a laptop CPU. The first load therefore saves a converted copy
(safetensors in float32, which holds the dequantized weights exactly, plus config and
tokenizer) under the cache directory; later loads read that copy in seconds and cast it to the
requested dtype. A converted copy that fails to load is reported, removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.atomic import atomic_dir
from verispec.console import notice
from verispec.errors import VerispecError
from verispec.models.gguf import CACHE_DTYPES
from verispec.models.runners.packed import pack_linear_layers
from verispec.models.runners.quantized import quantize_linear_layers
from verispec.models.registry import NAMED_MODELS, assemble, cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COMPLETE = "verispec-converted.json"


WEIGHT_FORMATS = ("dense", "packed", "int8")
# auto: GGUF files and the named defaults run on verispec's own quantized CPU runner ("native"),
# Hugging Face directories on torch.
BACKENDS = ("auto", "native", "torch", "llama.cpp")
# The decoding defaults, used by the API and the CLI alike.
DEFAULT_DTYPE = "auto"  # float32 on the CPU, bfloat16 on CUDA (models.device.default_dtype)
DEFAULT_TARGET_WEIGHTS = "packed"
DEFAULT_DRAFT_WEIGHTS = "int8"
DEFAULT_BACKEND = BACKENDS[0]


@dataclass
class LoadedModel:
    """A model ready for decoding: `model` (a transformers causal LM), its tokenizer and where it came from.

    weights: "dense" (as loaded), "packed" (linear weights in oneDNN's packed layout: same values,
    faster multi-token passes on CPUs) or "int8" (weight-only int8: for drafts only, never a target).
    """

    name: str
    model: torch.nn.Module | None
    tokenizer: object
    source: str
    weights: str = "dense"
    backend: str = DEFAULT_BACKEND
    vocab: object | None = None  # a distilled draft's VocabMap (its vocabulary is a subset of the target's)
    lookup: object | None = None  # a draft's "lookup first" n-gram sizes (PromptLookupConfig; see DraftModelDrafter)
    context: int | None = None  # a draft reads only this many of a prompt's last tokens (see DraftModelDrafter)
    gguf: object | None = None  # the GGUFModel of backend "native"
    device: str = "cpu"  # where the torch route runs it (models.device)
    compiled: bool = False  # run on the static cache with compiled passes (models.runners.static)
    kv_cache: str | None = None  # the native runner's key/value cache element type (None: its default)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype if self.model is not None else torch.float32

    def make_runner(self):
        """The runner that decodes with this model: a ModelRunner, or a LlamaCppRunner for backend "llama.cpp".
        int8 models run row by row (`verispec.models.runners.rowwise`: a row's results then never depend on its batch)."""
        if self.backend == "llama.cpp":
            from verispec.models.runners.llamacpp import LlamaCppRunner

            return LlamaCppRunner(Path(self.source))
        if self.backend == "native":
            from verispec.models.gguf.runner import NativeRunner
            from verispec.models.runners.mapped import MappedVocabRunner

            runner = NativeRunner(self.gguf, source=self.model, cache_dtype=self.kv_cache or CACHE_DTYPES[0])
            return MappedVocabRunner(runner, self.vocab) if self.vocab is not None else runner
        from verispec.models.runners.mapped import MappedVocabRunner
        from verispec.models.runners.rowwise import RowwiseRunner
        from verispec.models.runners.hf import ModelRunner

        if self.compiled:  # load_model sets it for every model off the CPU
            from verispec.models.runners.static import StaticRunner

            runner = StaticRunner(self.model)
            return MappedVocabRunner(runner, self.vocab) if self.vocab is not None else runner
        runner = MappedVocabRunner(self.model, self.vocab) if self.vocab is not None else ModelRunner(self.model)
        return RowwiseRunner(runner) if self.weights == "int8" else runner

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        config = getattr(self.model, "generation_config", None)
        for value in (getattr(config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids


# Distilled drafts shipped with the package: spec name -> directory (see verispec.distill).
DISTILLED_DRAFTS = {"distilled": Path(__file__).resolve().parent.parent / "assets" / "qwen2.5-coder-distilled-draft"}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise VerispecError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def describe_spec_error(spec: str) -> str:
    return (
        f"unknown model spec '{spec}': it is not a named default ({', '.join(NAMED_MODELS)}), "
        "not an existing directory with a Hugging Face model, and not an existing .gguf file"
    )


def resolve(spec: str) -> tuple[str, Path]:
    """Map a spec to (kind, path) with kind in {'gguf', 'hf'}; assembles named defaults."""
    if not spec or not spec.strip():
        raise VerispecError("empty model spec")
    if spec in NAMED_MODELS:
        return "gguf", assemble(NAMED_MODELS[spec])
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    if path.is_dir():
        raise VerispecError(f"model directory '{spec}' has no config.json: not a Hugging Face model directory")
    raise VerispecError(describe_spec_error(spec))


def _converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models.gguf.gguf_file import GGUFFile

    if "rope_freqs.weight" in GGUFFile(gguf).tensors:  # transformers' GGUF loader drops it: another model
        raise VerispecError(f"{gguf.name}: its RoPE frequency factors (rope_freqs.weight, Llama 3's scaling) are not "
                            "read by transformers' GGUF loader; run it on --backend native or llama.cpp")
    notice(
        f"[bold]converting {gguf.name}[/bold] to a cached float32 copy at {out} (one time; later loads are fast)"
    )
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # dequantizing takes minutes: show transformers' own progress bar
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        raise VerispecError(f"transformers could not load the GGUF file {gguf}: {err}") from None
    finally:
        hf_logging.disable_progress_bar()
    # The weights are dequantized now; drop the GGUF quantizer tag so transformers saves them plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(out) as tmp:  # built in a folder of its own, renamed into place complete
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE).write_text(json.dumps({"source": str(gguf)}))


def _load_hf_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval(), tokenizer


def distilled_path(spec: str) -> Path | None:
    """The directory of a distilled draft spec: the shipped default's name, or a distilled draft directory."""
    from verispec.models.distilled import is_distilled_dir

    if spec in DISTILLED_DRAFTS:
        if not is_distilled_dir(DISTILLED_DRAFTS[spec]):
            raise VerispecError(f"the distilled draft '{spec}' is missing from this installation "
                                f"({DISTILLED_DRAFTS[spec]}); reinstall verispec")
        return DISTILLED_DRAFTS[spec]
    path = Path(spec).expanduser()
    return path if path.is_dir() and is_distilled_dir(path) else None


def load_distilled_draft(spec: str, target: LoadedModel, weights: str = "dense") -> LoadedModel:
    """A distilled draft for `target`: checked (sha256, tokenizer) and given the target's tokenizer."""
    from verispec.models.distilled import load_distilled

    path = distilled_path(spec)
    if path is None:
        raise VerispecError(describe_spec_error(spec))
    from verispec.config import PromptLookupConfig

    model, vocab, manifest = load_distilled(path, target.tokenizer)
    lookup = manifest.get("draft_lookup")  # chosen on the draft's validation set when it was exported
    loaded = LoadedModel(spec, model, target.tokenizer, str(path), vocab=vocab,
                         lookup=PromptLookupConfig(**lookup) if lookup else None)
    if weights == "int8" and target.backend == "native":
        # beside a native target, the draft runs on the same kernels: its weights in Q8_0 (int8 blocks)
        from verispec.models.gguf.convert import model_from_torch

        loaded.gguf, loaded.backend, loaded.weights = model_from_torch(model, str(path)), "native", "q8_0"
    elif weights == "int8" and quantize_linear_layers(model):
        loaded.weights = "int8"
    return loaded


def load_model(spec: str, dtype: str = DEFAULT_DTYPE, weights: str = "dense", backend: str = DEFAULT_BACKEND,
               device: str = "cpu", compiled: bool = False, kv_cache: str | None = None) -> LoadedModel:
    """Load a model for decoding.

    Args:
        spec: a named default (see `NAMED_MODELS`), a local Hugging Face model directory, or a .gguf file.
        dtype: compute dtype name: auto (default: float32 on the CPU, which keeps greedy output exact;
            bfloat16 on CUDA), float32, bfloat16 or float16.
        weights: "dense", "packed" or "int8" (see LoadedModel); a format this CPU cannot run falls
            back to "dense", and `LoadedModel.weights` says which one was used. Compiled and CUDA models
            run dense.
        device: auto, cpu, cuda or cuda:N (`models.device`); off the CPU the torch route runs the model.
        compiled: on the torch route, run on a static cache with compiled passes (`models.runners.static`;
            always so on CUDA).
        kv_cache: the native runner's key/value cache element type, one of `CACHE_DTYPES` (None: its default,
            float16); another backend keeps its own cache, so naming one there is an error.
    """
    from verispec.models.device import default_dtype, resolve_device

    if weights not in WEIGHT_FORMATS:
        raise VerispecError(f"unknown weight format '{weights}'; choose one of {', '.join(WEIGHT_FORMATS)}")
    if backend not in BACKENDS:
        raise VerispecError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if device == "auto" and backend not in ("auto", "torch"):
        device = "cpu"  # the native and llama.cpp runners are CPU runners
    where = resolve_device(device)
    if where.type != "cpu" and backend in ("native", "llama.cpp"):
        raise VerispecError(f"the {backend} backend runs on the CPU; --device {device} needs --backend torch (or auto)")
    if backend == "auto":
        backend = "native" if _native_runs(spec) and where.type == "cpu" and not compiled else "torch"
    if compiled and backend != "torch":
        raise VerispecError(f"--compile runs the torch route; the {backend} backend has its own kernels")
    if kv_cache is not None and kv_cache not in CACHE_DTYPES:
        raise VerispecError(f"unknown key/value cache type '{kv_cache}'; choose one of {', '.join(CACHE_DTYPES)}")
    if kv_cache is not None and backend != "native":
        raise VerispecError(f"--kv-cache chooses the native runner's cache, and this model runs on the {backend} "
                            "backend, which keeps its own")
    if backend == "llama.cpp":
        return _load_for_llamacpp(spec)
    if backend == "native":
        loaded = _load_native(spec)
        loaded.kv_cache = kv_cache
        return loaded
    loaded = _load(spec, default_dtype(where) if dtype == "auto" else dtype)
    if where.type != "cpu" or compiled:
        loaded.model = loaded.model.to(where)
        loaded.device, loaded.compiled = str(where), compiled or where.type != "cpu"
        return loaded
    if weights == "packed" and pack_linear_layers(loaded.model):
        loaded.weights = "packed"
    elif weights == "int8" and quantize_linear_layers(loaded.model):
        loaded.weights = "int8"
    return loaded


def load_tokenizer(spec: str):
    """Only the tokenizer of a model spec (no weights): from an HF directory (a tokenizer saved on its
    own is accepted too), or for a GGUF from its converted copy when there is one, else from the GGUF
    file itself."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder = Path(spec).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        kind, path = "hf", folder  # a tokenizer saved on its own
    else:
        kind, path = resolve(spec)
    try:
        if kind == "hf":
            return AutoTokenizer.from_pretrained(str(path))
        converted = _converted_dir(path)
        if (converted / _COMPLETE).is_file():
            return AutoTokenizer.from_pretrained(str(converted))
        saved = _tokenizer_dir(path)
        if (saved / _COMPLETE).is_file():
            return AutoTokenizer.from_pretrained(str(saved))
        tokenizer = _gguf_tokenizer(path)
    except (ValueError, OSError, KeyError) as err:
        raise VerispecError(f"cannot load the tokenizer of '{spec}': {err}") from None
    _save_tokenizer(tokenizer, saved)
    return tokenizer


def _gguf_tokenizer(path: Path):
    """A GGUF's tokenizer from its own metadata. transformers' AutoTokenizer first reads the file as one of the
    architectures its GGUF loader maps to a model (it refuses SmolLM3 or Granite, whose vocabularies it builds all
    the same); the tokenizer itself is built from `tokenizer.ggml.*`, which the fast tokenizer class reads directly
    (the same tokens and chat template: checked on the Qwen files)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as err:
        if "is not supported" not in str(err):
            raise
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_dir(gguf: Path) -> Path:
    """Where a GGUF's tokenizer is kept once transformers has built it (10 s for the Qwen vocabulary)."""
    return cache_dir() / "tokenizers" / _converted_dir(gguf).name


def _save_tokenizer(tokenizer, out: Path) -> None:
    """Save through a temporary directory, so a reader never sees half a tokenizer; a failure only costs speed."""
    try:
        with atomic_dir(out) as tmp:
            tokenizer.save_pretrained(str(tmp))
            (tmp / _COMPLETE).write_text("{}")
    except OSError as err:
        notice(f"[yellow]could not cache the tokenizer at {out}: {err}[/yellow]")


def _native_runs(spec: str) -> bool:
    """Whether `--backend auto` runs the model on the native runner: a GGUF of an architecture it has (others, as
    Gemma 2 or Phi-3, run on torch after a notice; a damaged file goes to the native loader, which names what is
    wrong)."""
    kind, path = resolve(spec)
    if kind != "gguf":
        return False
    from verispec.models.gguf.gguf_file import GGUFFile
    from verispec.models.gguf.model import ARCHITECTURES

    try:
        arch = GGUFFile(path).fields.get("general.architecture")
    except VerispecError:
        return True
    if arch in ARCHITECTURES:
        return True
    notice(f"[dim]{path.name}: architecture '{arch}' runs on torch (the native CPU runner has "
           f"{', '.join(ARCHITECTURES)})[/dim]")
    return False


def _load_for_llamacpp(spec: str) -> LoadedModel:
    """A GGUF for llama.cpp: only the tokenizer is loaded here (from the converted copy when there is one)."""

    from verispec.models.runners.llamacpp import llamacpp_available

    kind, path = resolve(spec)
    if kind != "gguf":
        raise VerispecError(f"the llama.cpp backend needs a GGUF model, and '{spec}' is a Hugging Face directory")
    if not llamacpp_available():
        raise VerispecError("the llama.cpp backend needs llama-cpp-python; see README, 'llama.cpp backend'")
    return LoadedModel(spec, None, load_tokenizer(spec), str(path), weights="gguf", backend="llama.cpp")


def _load_native(spec: str) -> LoadedModel:
    """A GGUF on verispec's quantized CPU runner: weights read and repacked tensor by tensor (seconds)."""
    from verispec.models.gguf.model import load_gguf

    kind, path = resolve(spec)
    if kind != "gguf":
        raise VerispecError(f"the native backend runs GGUF models, and '{spec}' is a Hugging Face directory "
                            "(use --backend torch)")
    _notice_kernel_path()
    model = load_gguf(path)
    return LoadedModel(spec, None, load_tokenizer(spec), str(path), weights="gguf", backend="native", gguf=model)


def _notice_kernel_path() -> None:
    """One line where the CPU lacks the fast kernels' instructions, naming the fallback in use."""
    from verispec.models.gguf import native

    path = native.path()
    amx = native.amx_status()
    if path == "amx":
        notice("[dim]native runner: AVX-512 VNNI kernels, AMX tiles for Q4_K / Q5_K matmuls over 16 / 12 tokens and "
               "more (where they measured faster)[/dim]")
    elif amx in ("refused", "no AVX-512"):
        notice(f"[yellow]this CPU has AMX tiles but they cannot be used ({amx}): the native runner uses its "
               f"{path} kernels (same results)[/yellow]")
    if path in ("avx2", "avx-vnni"):
        notice(f"[yellow]this CPU has no AVX-512 VNNI: the native runner uses its {path.upper()} kernels (same "
               "results, slower passes over several tokens)[/yellow]")
    elif path == "portable":
        notice("[yellow]this CPU has no AVX2: the native runner uses its portable C kernels (same results, several "
               "times slower); --backend llama.cpp may be faster here[/yellow]")


def _load(spec: str, dtype: str) -> LoadedModel:
    from transformers.utils import logging as hf_logging

    torch_dtype = parse_dtype(dtype)
    kind, path = resolve(spec)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if kind == "hf":
        model, tokenizer = _load_hf_dir(path, torch_dtype)
        return LoadedModel(spec, model, tokenizer, str(path))
    converted = _converted_dir(path)
    if (converted / _COMPLETE).is_file():
        try:
            model, tokenizer = _load_hf_dir(converted, torch_dtype)
            return LoadedModel(spec, model, tokenizer, str(path))
        except Exception as err:  # a damaged cache must not stop the user: rebuild it
            notice(
                f"[red]cached converted model at {converted} failed to load[/red] ({type(err).__name__}: "
                f"{str(err)[:200]}); converting {path.name} again"
            )
            shutil.rmtree(converted, ignore_errors=True)
    _convert_gguf(path, converted)
    model, tokenizer = _load_hf_dir(converted, torch_dtype)
    return LoadedModel(spec, model, tokenizer, str(path))


def same_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether draft tokens are target tokens: the two vocabularies map every token to the same id."""
    return target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise where the two vocabularies differ, for callers that need the target's ids (a draft model no longer does:
    with another tokenizer it drafts text, `drafters.cross_tokenizer`)."""
    if same_tokenizer(target, draft):
        return
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    differing = sum(1 for tok, idx in draft_vocab.items() if target_vocab.get(tok) != idx)
    raise VerispecError(
        f"draft '{draft.name}' and target '{target.name}' use different tokenizers "
        f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} draft tokens map to other ids); "
        "this needs a shared tokenizer"
    )
