"""Draft heads' files (Medusa, EAGLE-3): the shipped heads, their manifests, and what heads read of a target.

A bare `medusa` / `eagle` names the head shipped inside the package for the default target (assets/), each
with a `manifest.json`: the sha256 of every file (checked on load, like the distilled draft's) and the
fingerprint of the target it was trained on (`models.skip.fingerprint`: a probe of its token embedding), so
another target gets one line saying the shipped head is not its own instead of a head that never agrees.
An EAGLE manifest may name `draft_lookup` (lookup first, `PromptLookupConfig` fields), as the shipped one does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from verispec.atomic import atomic_write_json
from verispec.core.protocols import NativeWeights, TorchWeights
from verispec.errors import VerispecError
from verispec.models.heads.eagle3 import EAGLE
from verispec.models.heads.medusa import MEDUSA
from verispec.models.skip import fingerprint, same_model

ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED = {MEDUSA: ASSETS / "medusa-qwen2.5-coder-1.5b", EAGLE: ASSETS / "eagle3-qwen2.5-coder-1.5b"}
MANIFEST = "manifest.json"
TRAINERS = {MEDUSA: "--kind medusa", EAGLE: "--kind eagle3"}


def write_manifest(folder: Path, runner, extra: dict | None = None) -> None:
    """sha256 of every file in `folder` and the target's fingerprint, as manifest.json."""
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    payload = {"sha256": sums, "target_fingerprint": fingerprint(runner), **(extra or {})}
    atomic_write_json(folder / MANIFEST, payload, indent=1)


def shipped_head(kind: str, runner) -> Path:
    """The folder of the head of this kind shipped for this target, its files checked."""
    folder = SHIPPED[kind]
    if not (folder / MANIFEST).is_file():
        raise VerispecError(f"no {kind} head ships with this installation ({folder} is missing); reinstall "
                            f"verispec or pass --draft {kind}:DIR")
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, digest in manifest["sha256"].items():
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise VerispecError(f"the shipped {kind} head's {name} is missing or damaged (sha256 mismatch); "
                                "reinstall verispec")
    if not same_model(manifest["target_fingerprint"], fingerprint(runner)):
        raise VerispecError(f"the shipped {kind} head was trained for {manifest.get('target', 'another target')}, not "
                            f"this target: train one with `verispec train-heads {TRAINERS[kind]}` and pass "
                            f"--draft {kind}:DIR")
    return folder


def hidden_size(runner) -> int:
    """The width of the target's hidden states (what draft heads read)."""
    if isinstance(runner, NativeWeights):
        return int(runner.gguf.config.hidden)
    if isinstance(runner, TorchWeights):
        return int(runner.model.config.hidden_size)
    raise VerispecError(f"the '{type(runner).__name__}' runner gives no hidden states for draft heads "
                        "(use --backend native or torch)")


def lm_head_rows(runner, ids: torch.Tensor) -> torch.Tensor:
    """(k, E) float32: the target's LM head rows for these token ids."""
    if isinstance(runner, NativeWeights):
        return torch.from_numpy(runner.gguf.head.take_rows(ids.numpy().astype(np.int64)))
    weight = runner.model.get_output_embeddings().weight
    if weight.device.type == "meta":
        raise VerispecError("train-heads reads the target's LM head: run it with --target-weights dense or on a GGUF")
    return weight[ids].detach().float()


def final_norm(runner) -> torch.Tensor:
    """(E,) float32: the weight of the target's final norm."""
    if isinstance(runner, NativeWeights):
        return torch.from_numpy(np.asarray(runner.gguf.norm, np.float32))
    return runner.model.model.norm.weight.detach().float()
