"""The distilled tiny draft: a small Qwen2-style transformer over a reduced draft vocabulary.

DistillSpec (Zhou et al. 2024) trains a draft to agree with the target. Here the draft is tiny
(a few million parameters) and its vocabulary is the Vd most frequent target tokens on the
training data, so its embedding and output layer are small too. Tokens are mapped both ways:

    to_draft:  (Vt,) long, target id -> draft id; ids outside the draft vocabulary map to OTHER (= Vd),
               an input-only token the draft reads but never proposes
    to_target: (Vd,) long, draft id -> target id

The draft's distribution over the target's vocabulary is zero outside `to_target`; the verifier
handles that exactly (a token with q = 0 is never proposed, and its target mass stays in the
residual). A distilled draft lives in a directory:

    config.json                 the TinyDraftConfig
    model.safetensors           weights (float16 on disk, float32 in memory)
    vocab.safetensors           to_target
    verispec-distilled.json     the target it was distilled from, the sha256 of the target's
                                vocabulary and of both weight files, and a training summary
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.errors import VerispecError

MANIFEST = "verispec-distilled.json"
WEIGHTS = "model.safetensors"
VOCAB = "vocab.safetensors"
CONFIG = "config.json"


@dataclass(frozen=True)
class TinyDraftConfig:
    """Shape of a tiny draft (a Qwen2 decoder).

    draft_vocab_size: Vd, target tokens the draft can propose. hidden_size, intermediate_size,
    num_layers, num_heads, num_kv_heads: the transformer. rope_theta and max_positions follow the
    target so positions mean the same thing.
    """

    draft_vocab_size: int = 16384
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    rope_theta: float = 1_000_000.0
    max_positions: int = 32768

    def __post_init__(self) -> None:
        for name in ("draft_vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) < 1:
                raise VerispecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise VerispecError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")

    def build(self) -> torch.nn.Module:
        """A freshly initialised model: vocabulary Vd + 1 (the last id is OTHER)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=self.draft_vocab_size + 1, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_positions, rope_theta=self.rope_theta, tie_word_embeddings=True,
        )
        return Qwen2ForCausalLM(config)


@dataclass(frozen=True)
class VocabMap:
    """Target ids <-> draft ids. to_target: (Vd,) long; to_draft: (Vt,) long with OTHER = Vd outside."""

    to_target: torch.Tensor
    to_draft: torch.Tensor

    @classmethod
    def from_target_ids(cls, to_target: torch.Tensor, target_vocab_size: int) -> VocabMap:
        to_target = to_target.to(torch.long)
        if to_target.unique().numel() != to_target.numel():
            raise VerispecError("the draft vocabulary lists a target token twice")
        if int(to_target.max()) >= target_vocab_size or int(to_target.min()) < 0:
            raise VerispecError(f"the draft vocabulary holds ids outside the target vocabulary (size {target_vocab_size})")
        to_draft = torch.full((target_vocab_size,), to_target.numel(), dtype=torch.long)  # (Vt,)
        to_draft[to_target] = torch.arange(to_target.numel())
        return cls(to_target, to_draft)

    @property
    def draft_vocab_size(self) -> int:
        return self.to_target.numel()

    @property
    def other(self) -> int:
        return self.draft_vocab_size

    def scatter(self, draft_logits: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
        """(..., Vd + 1) draft logits -> (..., Vt) logits, -inf outside the draft vocabulary (q = 0 there)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], target_vocab_size), float("-inf"))
        out[..., self.to_target] = draft_logits[..., : self.draft_vocab_size]
        return out


def choose_vocabulary(token_streams, size: int, always: list[int], target_vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target tokens over `token_streams` (iterables of ids), `always` included first."""
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for ids in token_streams:
        counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=target_vocab_size)
    counts[torch.as_tensor(always, dtype=torch.long)] = counts.max() + 1
    return counts.topk(min(size, target_vocab_size)).indices.sort().values  # (Vd,)


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's token -> id table: two tokenizers agree on every id iff these match."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _sha256(path: Path) -> str:
    from verispec.models.registry import sha256_file

    return sha256_file(path)


def is_distilled_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def save_distilled(out: Path, config: TinyDraftConfig, model: torch.nn.Module, vocab: VocabMap, meta: dict) -> Path:
    """Write a distilled draft directory (weights as float16) with its manifest of sha256 sums. The directory
    is built aside and renamed into place whole (`atomic.atomic_dir`): a kill leaves the previous draft, never
    new weights beside an old vocabulary or manifest."""
    from safetensors.torch import save_file

    from verispec.atomic import atomic_dir, atomic_write_json

    out = Path(out)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    with atomic_dir(out) as folder:
        save_file(state, str(folder / WEIGHTS))
        save_file({"to_target": vocab.to_target.to(torch.int32).contiguous()}, str(folder / VOCAB))
        atomic_write_json(folder / CONFIG, asdict(config), indent=2)
        manifest = {**meta, "sha256": {WEIGHTS: _sha256(folder / WEIGHTS), VOCAB: _sha256(folder / VOCAB)}}
        atomic_write_json(folder / MANIFEST, manifest, indent=2)
    return out


def load_distilled(path: Path, target_tokenizer=None, target_vocab_size: int | None = None):
    """Load a distilled draft directory: (model, VocabMap, manifest), float32, eval mode.

    Checks every file's sha256 against the manifest, and, given the target's tokenizer, that the
    draft was distilled for this tokenizer (same token -> id table).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not is_distilled_dir(path):
        raise VerispecError(f"{path} is not a distilled draft directory (no {MANIFEST})")
    manifest = json.loads((path / MANIFEST).read_text())
    for name, digest in manifest.get("sha256", {}).items():
        if not (path / name).is_file():
            raise VerispecError(f"distilled draft {path}: file {name} is missing")
        actual = _sha256(path / name)
        if actual != digest:
            raise VerispecError(f"distilled draft {path}: {name} has sha256 {actual[:12]}..., expected {digest[:12]}... "
                                "(the file is damaged: reinstall verispec or re-export the draft)")
    if target_tokenizer is not None and manifest.get("target_vocab_sha256") not in (None, vocab_fingerprint(target_tokenizer)):
        raise VerispecError(f"distilled draft {path} was trained for another tokenizer (target "
                            f"'{manifest.get('target', '?')}'); it cannot draft for this target")
    config = TinyDraftConfig(**json.loads((path / CONFIG).read_text()))
    model = config.build()
    state = {k: v.float() for k, v in load_file(str(path / WEIGHTS)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise VerispecError(f"distilled draft {path}: weights do not fit its config (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    model.tie_weights()
    to_target = load_file(str(path / VOCAB))["to_target"].long()
    vocab_size = target_vocab_size or int(manifest.get("target_vocab_size") or int(to_target.max()) + 1)
    vocab = VocabMap.from_target_ids(to_target, vocab_size)
    return model.eval(), vocab, manifest
