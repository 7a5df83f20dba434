"""The target minus some sublayers: self-speculation's draft model (Draft & Verify, SWIFT, LayerSkip).

A `SkipSet` names the attention and MLP sublayers of a decoder to skip: a skipped sublayer adds nothing to
the residual stream (x + 0 is x, bit for bit), so the draft is the target's own computation with holes in
it, over the target's own weights (nothing is copied). Early exit at layer L (LayerSkip) is the skip set
that skips every sublayer from layer L on: the draft then goes from layer L's output through the final norm
and the LM head.

Written on the command line as `self:SKIP`, SKIP a comma-separated list of items, layers numbered from 0:
`12` (both sublayers of layer 12), `a12` (its attention only), `m12` (its MLP only), ranges `4-9`,
`a4-9`, and open ranges `20-` (from layer 20 to the last: early exit at 20). One more item, `h32768`,
gives the draft an LM head over the first 32768 token ids only (its logits are -inf above, so q is 0
there): on a small model with a large vocabulary the head is a large share of a pass (a fifth of the
1.5B Qwen's bytes), and byte-level BPE numbers its pieces by merge order, so low ids are the common ones.

The runners that run a skip set are in `verispec.models.runners.skipping`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from verispec.core.protocols import NativeWeights, TorchWeights
from verispec.errors import VerispecError

SKIP_FORMAT = "verispec-skip/1"
_ITEM = re.compile(r"^([am]?)(\d+)(?:(-)(\d*))?$")
_HEAD = re.compile(r"^h(\d+)$")


@dataclass(frozen=True)
class SkipSet:
    """Sublayers to skip in a decoder of `layers` layers (numbered from 0)."""

    layers: int
    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()
    head: int | None = None  # the draft's LM head keeps token ids below this (None: all)

    def __post_init__(self) -> None:
        if self.head is not None and (self.head < 16 or self.head % 16):
            raise VerispecError(f"the draft head's size must be a multiple of 16 (at least 16), got h{self.head}")
        bad = sorted(i for i in self.attention | self.mlp if not 0 <= i < self.layers)
        if bad:
            raise VerispecError(f"the skip set names layer {bad[0]}, but the model has {self.layers} layers "
                                f"(0..{self.layers - 1})")
        if len(self.attention) == self.layers and len(self.mlp) == self.layers:
            raise VerispecError("the skip set skips every layer: the draft would compute nothing")

    @classmethod
    def parse(cls, text: str, layers: int) -> SkipSet:
        """`a4-9,m12,20-` -> SkipSet (see the module docstring)."""
        attention: set[int] = set()
        mlp: set[int] = set()
        head = None
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or not all(items):
            raise VerispecError(f"'{text}' is not a skip set: expected items like 12, a12, m12, 4-9 or 20- "
                                "separated by commas")
        for item in items:
            if _HEAD.match(item):
                head = int(item[1:])
                continue
            match = _ITEM.match(item)
            if match is None:
                raise VerispecError(f"'{item}' in skip set '{text}' is not a layer (12), a sublayer (a12, m12), "
                                    "a range (4-9, a4-9, 20-) or a head size (h32768)")
            kind, first, dash, last = match.groups()
            low = int(first)
            high = (layers - 1 if last == "" else int(last)) if dash else low
            if high < low:
                raise VerispecError(f"'{item}' in skip set '{text}' is an empty range")
            chosen = range(low, high + 1)
            if kind in ("", "a"):
                attention.update(chosen)
            if kind in ("", "m"):
                mlp.update(chosen)
        return cls(layers, frozenset(attention), frozenset(mlp), head)

    @classmethod
    def early_exit(cls, exit_layer: int, layers: int) -> SkipSet:
        """Draft from the output of layers 0 .. exit_layer - 1 (LayerSkip)."""
        return cls(layers, frozenset(range(exit_layer, layers)), frozenset(range(exit_layer, layers)))

    @property
    def text(self) -> str:
        """The shortest item list `parse` reads back into this set."""
        both = self.attention & self.mlp
        items = [(prefix, sorted(chosen)) for prefix, chosen in
                 (("", both), ("a", self.attention - both), ("m", self.mlp - both))]
        out = []
        for prefix, chosen in items:
            for low, high in _runs(chosen):
                if low == high:
                    out.append(f"{prefix}{low}")
                elif high == self.layers - 1 and prefix == "":
                    out.append(f"{low}-")
                else:
                    out.append(f"{prefix}{low}-{high}")
        if self.head is not None:
            out.append(f"h{self.head}")
        return ",".join(out) or "none"

    @property
    def size(self) -> int:
        """Sublayers skipped."""
        return len(self.attention) + len(self.mlp)

    @property
    def fraction(self) -> float:
        """The share of the decoder's 2 x layers sublayers skipped."""
        return self.size / (2 * self.layers)

    @property
    def first(self) -> int:
        """The first layer with a skipped sublayer (`layers` when none is): layers before it run in full."""
        chosen = self.attention | self.mlp
        return min(chosen) if chosen else self.layers

    def bits(self) -> np.ndarray:
        """(layers,) int32: bit 1 skips a layer's attention, bit 2 its MLP (the native kernels' argument)."""
        out = np.zeros(self.layers, np.int32)
        for i in self.attention:
            out[i] |= 1
        for i in self.mlp:
            out[i] |= 2
        return out

    def toggled(self, kind: str, layer: int) -> SkipSet:
        """This set with one sublayer ("attention" or "mlp" of `layer`) flipped between skipped and run."""
        chosen = set(self.attention if kind == "attention" else self.mlp) ^ {layer}
        if kind == "attention":
            return SkipSet(self.layers, frozenset(chosen), self.mlp, self.head)
        return SkipSet(self.layers, self.attention, frozenset(chosen), self.head)

    def with_head(self, head: int | None) -> SkipSet:
        return SkipSet(self.layers, self.attention, self.mlp, head)

    def sublayers(self) -> list[tuple[str, int]]:
        """Every sublayer of the decoder, as (kind, layer)."""
        return [(kind, i) for i in range(self.layers) for kind in ("attention", "mlp")]

    def skips(self, kind: str, layer: int) -> bool:
        return layer in (self.attention if kind == "attention" else self.mlp)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted ints -> maximal runs of consecutive values, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


# ---------------------------------------------------------------------- which model a skip set was made for


def fingerprint(runner) -> dict:
    """What identifies the target's weights across formats (a GGUF file, its Hugging Face original): its
    shape and a probe of its token embedding (rows 0..7, first 32 columns), compared by cosine similarity
    (`same_model`): quantization moves the values a little, another model moves them entirely."""
    if isinstance(runner, NativeWeights):
        c = runner.gguf.config
        probe = runner.gguf.embed.take_rows(np.arange(8, dtype=np.int64))[:, :32]
        shape = (c.layers, c.hidden, c.vocab)
    else:
        embedding = _torch_model(runner).get_input_embeddings().weight.detach()
        probe = embedding[:8, :32].float().numpy()
        shape = (num_layers(runner), int(embedding.shape[1]), int(embedding.shape[0]))
    return {"layers": shape[0], "hidden": shape[1], "vocab": shape[2],
            "probe": [round(float(v), 5) for v in np.asarray(probe, np.float64).reshape(-1)]}


def same_model(a: dict, b: dict) -> bool:
    if any(a.get(key) != b.get(key) for key in ("layers", "hidden", "vocab")):
        return False
    x, y = np.asarray(a.get("probe", []), np.float64), np.asarray(b.get("probe", []), np.float64)
    if x.shape != y.shape or x.size == 0:
        return False
    return float(x @ y) / max(1e-12, float(np.linalg.norm(x) * np.linalg.norm(y))) > 0.95


def num_layers(runner) -> int:
    if isinstance(runner, NativeWeights):
        return int(runner.gguf.config.layers)
    return len(decoder_layers(_torch_model(runner)))


def _torch_model(runner) -> torch.nn.Module:
    if not isinstance(runner, TorchWeights):
        raise VerispecError(f"the '{type(runner).__name__}' runner shows no weights to read here (native or torch)")
    return runner.model


@dataclass(frozen=True)
class SkipFile:
    """A skip set saved by `verispec self-tune`, with the model it was searched on and what was measured."""

    skip: SkipSet
    model: str  # the target's name when it was searched
    fingerprint: dict
    measured: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write atomically (`verispec.atomic`: a temporary file of its own renamed into place): never a
        half-written file, and two writers never share a temporary name."""
        from verispec.atomic import atomic_write_json

        payload = {"format": SKIP_FORMAT, "skip": self.skip.text, "layers": self.skip.layers,
                   "attention": sorted(self.skip.attention), "mlp": sorted(self.skip.mlp), "head": self.skip.head,
                   "model": self.model,
                   "fingerprint": self.fingerprint, "measured": self.measured}
        atomic_write_json(path, payload, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> SkipFile:
        path = Path(path)
        try:
            payload = json.loads(path.read_text())
        except FileNotFoundError:
            raise VerispecError(f"skip file {path} does not exist") from None
        except (OSError, ValueError) as err:
            raise VerispecError(f"skip file {path} cannot be read: {err}") from None
        if not isinstance(payload, dict) or payload.get("format") != SKIP_FORMAT:
            raise VerispecError(f"{path} is not a skip file (format '{SKIP_FORMAT}'); `verispec self-tune` writes them")
        try:
            head = payload.get("head")
            skip = SkipSet(int(payload["layers"]), frozenset(int(i) for i in payload["attention"]),
                           frozenset(int(i) for i in payload["mlp"]), None if head is None else int(head))
            return cls(skip, str(payload["model"]), dict(payload["fingerprint"]), dict(payload.get("measured", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise VerispecError(f"skip file {path} is missing or garbles a field ({err})") from None

    def check(self, runner, target_name: str, path: str | Path) -> SkipSet:
        """The skip set, once sure it was made for this target."""
        layers = num_layers(runner)
        if self.skip.layers != layers or not same_model(self.fingerprint, fingerprint(runner)):
            raise VerispecError(f"skip file {path} was made for another model ({self.model}, {self.skip.layers} "
                                f"layers), not {target_name} ({layers} layers): run `verispec self-tune` for it")
        return self.skip


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(
            all(hasattr(layer, name) for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
            for layer in layers):
        raise VerispecError("self-speculation needs a pre-norm decoder (Llama or Qwen2 layout: input_layernorm, "
                            "self_attn, post_attention_layernorm, mlp in every layer); this target has another")
    return layers


# ---------------------------------------------------------------------- --draft self[:SKIP|:FILE]

SELF = "self"


def tuned_folders() -> list[Path]:
    """Where `--draft self` looks for a skip set searched for its target: the cache (`verispec self-tune`'s
    default output), then the sets shipped with the package."""
    from verispec.models.registry import cache_dir

    return [cache_dir() / "self-tune", Path(__file__).resolve().parent.parent / "assets" / "self-tune"]


def find_tuned(runner) -> Path | None:
    """The first skip file in `tuned_folders` made for this target (matched by `fingerprint`), if any."""
    mine = fingerprint(runner)
    for folder in tuned_folders():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                if same_model(SkipFile.load(path).fingerprint, mine):
                    return path
            except VerispecError:
                continue  # a damaged file in the cache is not this target's
    return None


def default_skip(layers: int) -> SkipSet:
    """The skip set of a target nobody searched: the shape `verispec self-tune` found on Qwen2.5-Coder-1.5B
    (the MLPs of the early layers after the first: its early MLPs cost the least agreement per byte they
    save), scaled to the depth: every MLP of layers 1 .. L/5, then every other one up to L/2."""
    fifth = layers // 5
    return SkipSet(layers, frozenset(), frozenset(range(1, fifth + 1)) | frozenset(range(fifth + 2, layers // 2, 2)))


def check_skippable(runner) -> str:
    """"native" or "torch": the runners that can skip sublayers; any other is one clear line."""
    from verispec.models.gguf.runner import NativeRunner

    if isinstance(runner, NativeRunner):
        return "native"
    if isinstance(runner, TorchWeights) and hasattr(runner.model, "get_output_embeddings"):
        return "torch"
    raise VerispecError("self-speculation skips sublayers inside the target's forward pass; the "
                        f"'{type(runner).__name__}' runner cannot (use --backend native or torch)")


def resolve_skip(draft: str, runner, target_name: str) -> tuple[SkipSet, str]:
    """`self`, `self:SKIP` or `self:FILE` -> (the skip set, where it came from)."""
    check_skippable(runner)
    layers = num_layers(runner)
    if draft == SELF:
        path = find_tuned(runner)
        if path is not None:
            return SkipFile.load(path).check(runner, target_name, path), str(path)
        return default_skip(layers), "default"
    value = draft[len(SELF) + 1 :]
    if value.endswith(".json") or Path(value).is_file():
        return SkipFile.load(value).check(runner, target_name, value), value
    return SkipSet.parse(value, layers), "given"
