"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head k guessing the token
k + 2 places ahead (the target's own LM head gives the next one).

Head k is `ResBlock^L` then an LM head: ResBlock(h) = h + SiLU(W h + b) (W starts at zero, so an untrained
head is the target's LM head on h). The checkpoint format is the Medusa repository's, so a published head
loads as it is: a folder with `config.json` (`medusa_num_heads`, `medusa_num_layers`, optionally
`base_model_name_or_path`) and `medusa_lm_head.safetensors` (or `.pt`) with `{k}.{j}.linear.weight`,
`{k}.{j}.linear.bias` for the ResBlocks j < L and `{k}.{L}.weight` for the LM head. The hidden state is the
target's after its final norm (what the Medusa repository feeds its heads).

Tied heads (verispec's extension of the format: `"tied_lm_head": N` in config.json, no `{k}.{L}.weight`):
each head is its ResBlocks only and shares the target's own LM head over its first N token ids (-inf above,
so q is 0 there). A head then ships as a few megabytes, and on the native runner its LM head is the
target's quantized one: a drafted token costs the ResBlock and N rows of the head, a few percent of a pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.errors import VerispecError

MEDUSA = "medusa"
CONFIG = "config.json"
WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.nn.functional.silu(self.linear(h))


class MedusaHeads(torch.nn.Module):
    """num_heads heads over hidden states of width `hidden`, each with `num_layers` ResBlocks and an LM head."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int, tied_rows: int | None = None) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise VerispecError(f"a Medusa head set needs >= 1 head and >= 0 layers, got {num_heads} and {num_layers}")
        if tied_rows is not None and not 0 < tied_rows <= vocab:
            raise VerispecError(f"a tied Medusa head covers 1 .. {vocab} token ids, got {tied_rows}")
        self.num_layers, self.hidden, self.vocab, self.tied_rows = num_layers, hidden, vocab, tied_rows
        def head() -> torch.nn.Sequential:  # each with its own LM head, unless tied to the target's
            own = [] if tied_rows is not None else [torch.nn.Linear(hidden, vocab, bias=False)]
            return torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], *own)

        self.heads = torch.nn.ModuleList(head() for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def forward(self, h: torch.Tensor, count: int | None = None, lm_head=None) -> torch.Tensor:
        """h (B, E) -> (B, count, V) float32 logits of the first `count` heads (all by default).
        lm_head: (n, E) -> (n, V) logits, the target's own head (tied heads only)."""
        heads = self.heads[: count or self.num_heads]
        out = torch.stack([head(h) for head in heads], dim=1)  # (B, count, V) or, tied, (B, count, E)
        if self.tied_rows is None:
            return out.float()
        if lm_head is None:
            raise VerispecError("tied Medusa heads need the target's LM head")
        B, count, E = out.shape
        return lm_head(out.reshape(B * count, E)).reshape(B, count, -1).float()

    def soft_loss(self, k: int, h: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's soft cross-entropy against the target's labels, what training and online adaptation minimise.
        h: (b, E) hidden states; ids, probs: (b, k') the target's top next-token ids at head k's distance and their
        probabilities (renormalised; ids of a tied head < its rows); rows: (R, E) float, the target's LM head rows
        (tied heads only). Returns the mean over the b states."""
        x = self.heads[k](h)  # (b, E) tied, else (b, V)
        logq = torch.log_softmax(x @ rows.T if self.tied_rows is not None else x.float(), -1)  # (b, R or V)
        return -(probs * logq.gather(1, ids)).sum(-1).mean()

    def save(self, folder: str | Path, base_model: str = "") -> None:
        """Write the Medusa repository's format (config.json and medusa_lm_head.safetensors)."""
        from safetensors.torch import save_file

        from verispec.atomic import atomic_path, atomic_write_json

        folder = Path(folder)
        tensors = {f"{k}.{name}": p.detach().contiguous() for k, head in enumerate(self.heads)
                   for name, p in head.state_dict().items()}
        with atomic_path(folder / WEIGHTS[0]) as tmp:
            save_file(tensors, str(tmp))
        config = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                  "hidden_size": self.hidden, "vocab_size": self.vocab, "base_model_name_or_path": base_model}
        if self.tied_rows is not None:
            config["tied_lm_head"] = self.tied_rows
        atomic_write_json(folder / CONFIG, config, indent=1)


def load_medusa(folder: str | Path, hidden: int, vocab: int) -> MedusaHeads:
    """Read a Medusa checkpoint and check it fits a target of this hidden size and vocabulary."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise VerispecError(f"{folder} is not a Medusa head folder: {CONFIG} is missing")
    try:
        config = json.loads((folder / CONFIG).read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        tied = None if config.get("tied_lm_head") is None else int(config["tied_lm_head"])
    except (ValueError, KeyError, TypeError) as err:
        raise VerispecError(f"{folder / CONFIG}: not a Medusa config ({type(err).__name__}: {err})") from None
    path = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
    if path is None:
        raise VerispecError(f"{folder}: no Medusa weights ({' or '.join(WEIGHTS)})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line
        raise VerispecError(f"{path}: cannot be read ({type(err).__name__}: {str(err)[:120]})") from None
    if tied is None:
        head = tensors.get(f"0.{num_layers}.weight")
        if head is None:
            raise VerispecError(f"{path}: tensor '0.{num_layers}.weight' (head 0's LM head) is missing")
        width, tokens = head.shape[1], head.shape[0]
    else:
        block = tensors.get("0.0.linear.weight")
        width, tokens = (block.shape[1] if block is not None else hidden), int(config.get("vocab_size", vocab))
    if width != hidden or tokens != vocab:
        raise VerispecError(f"{folder}: the heads take hidden states of width {width} and predict "
                            f"{tokens} tokens; this target has width {hidden} and {vocab} tokens")
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab, tied)
    wanted = {f"{k}.{name}" for k, h in enumerate(heads.heads) for name in h.state_dict()}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise VerispecError(f"{path}: tensor '{missing[0]}' is missing ({len(missing)} in all)")
    for k, h in enumerate(heads.heads):
        h.load_state_dict({name: tensors[f"{k}.{name}"].float() for name in h.state_dict()})
    return heads.eval()
