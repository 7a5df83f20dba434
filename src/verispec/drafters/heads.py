"""Draft heads (Medusa, EAGLE-3) as drafters: `--draft medusa[:DIR]`, `--draft eagle[:DIR]` (see `models.heads.shipped` for
the shipped heads and their manifests)."""

from __future__ import annotations

import json
from pathlib import Path

from verispec.config import PromptLookupConfig
from verispec.core.protocols import FeatureRunner
from verispec.errors import VerispecError
from verispec.models.heads.eagle3 import EAGLE, load_eagle3
from verispec.models.heads.shipped import MANIFEST, hidden_size, shipped_head
from verispec.models.heads.medusa import MEDUSA, load_medusa
from verispec.models.skip import num_layers


def head_drafter(kind: str, folder: str | Path | None, runner):
    """The drafter of a `kind` head (MEDUSA or EAGLE) in `folder` (None: the head shipped for this target) on the
    target's runner."""
    if not isinstance(runner, FeatureRunner):
        raise VerispecError(f"{kind} heads read the target's hidden states; the '{type(runner).__name__}' "
                            "runner does not give them (use --backend native or torch)")
    folder = shipped_head(kind, runner) if folder is None else Path(folder)
    if kind == MEDUSA:
        from verispec.drafters.medusa import MedusaDrafter

        return MedusaDrafter(runner, load_medusa(folder, hidden_size(runner), runner.vocab_size))
    if kind != EAGLE:
        raise VerispecError(f"unknown head kind '{kind}' (medusa or eagle)")
    from verispec.drafters.eagle import EagleDrafter

    head = load_eagle3(folder, hidden_size(runner), runner.vocab_size, num_layers(runner))
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    lookup = manifest.get("draft_lookup")  # lookup first, as measured best for a shipped head
    return EagleDrafter(runner, head, lookup=PromptLookupConfig(**lookup) if lookup else None)
