"""A draft model whose LM head keeps only N token ids (after FR-Spec, Zhao et al. 2025, which restricts a draft's
head to frequent tokens): the head is the largest single matrix of a small draft (the 0.5B draft's 151,936 x 896).
The N kept are the first N of a ranking: for a tokenizer verispec ships one for (assets/*/ranks.safetensors, made
by scripts/build_token_ranks.py from the default target's own answers), the ids the target wrote most often, then
the rest in id order; for any other, ids in order (a byte-pair vocabulary's low ids are its earliest merges).
Exact: the draft's logits are -inf outside the kept ids, so q is 0 there and the verifier's residual max(0, p - q)
keeps the target's mass on them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from verispec.errors import VerispecError

ASSETS = Path(__file__).resolve().parents[2] / "assets"
GROUP_ROWS = 16  # the packed head's rows come in groups of 16: N is rounded down to a multiple


def token_ranks(tokenizer, vocab_size: int) -> np.ndarray:
    """(vocab_size,) every token id, most likely first: a shipped ranking of this tokenizer, else id order."""
    from safetensors import safe_open

    from verispec.ngram.table import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    ranked = np.empty(0, np.int64)
    for path in sorted(ASSETS.glob("*/ranks.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("tokenizer_sha256") == fingerprint:
                ranked = f.get_tensor("ids").astype(np.int64)
                break
    ranked = ranked[ranked < vocab_size]
    rest = np.setdiff1d(np.arange(vocab_size), ranked, assume_unique=True)  # ascending
    return np.concatenate([ranked, rest])


def head_weight(model, ids: np.ndarray):
    """The GGUF model's LM head over these token ids, in this order: their rows read from the file and repacked."""
    from verispec.models.gguf.gguf_file import GGUFFile
    from verispec.models.gguf.ops import Weight, check_tensor

    try:
        reader = GGUFFile(model.path)
        name = "output.weight" if "output.weight" in reader.tensors else "token_embd.weight"  # tied: the embedding
        tensor = reader.tensors[name]
        rows, cols = model.config.vocab, model.config.hidden
        row_bytes = check_tensor(name, tensor.qtype, tensor.nbytes, rows, cols)
        table = np.frombuffer(reader.read(name), np.uint8).reshape(rows, row_bytes)
    except (OSError, KeyError, ValueError) as err:
        raise VerispecError(f"--draft-vocab reads the draft's LM head from its GGUF file {model.path}: {err}") from None
    return Weight.from_raw(name, tensor.qtype, np.ascontiguousarray(table[ids]), len(ids), cols)


class HeadRowsRunner:
    """A native runner (`models.gguf.NativeRunner`) whose LM head keeps `rows` token ids (the first of
    `token_ranks`, a multiple of 16); logits are the full head's at those ids, -inf elsewhere. A `Runner` and a
    `NativeWeights` view: each member is that of a runner over the same layers with the cut head (`cut`), which runs
    every pass; nothing else is passed through."""

    def __init__(self, runner, rows: int, tokenizer=None) -> None:
        from verispec.models.gguf.runner import NativeRunner

        if not isinstance(runner, NativeRunner):
            raise VerispecError("--draft-vocab cuts a draft model's LM head on the native runner only (a .gguf draft "
                                "or a named default with the default backend)")
        if rows < GROUP_ROWS:
            raise VerispecError(f"--draft-vocab needs at least {GROUP_ROWS} token ids, got {rows}")
        vocab = runner.vocab_size
        self.rows = min(vocab, rows // GROUP_ROWS * GROUP_ROWS)
        self.ids = torch.from_numpy(token_ranks(tokenizer, vocab)[: self.rows].copy())  # (N,) kept target ids
        cut = replace(runner.gguf, head=head_weight(runner.gguf, self.ids.numpy()))
        self.cut = NativeRunner(cut, threads=runner.threads, initial_capacity=runner.initial_capacity,
                                source=runner._source, fused=runner.fused)  # the same layers, its own head

    @property
    def vocab_size(self) -> int:
        return self.cut.vocab_size

    @property
    def context_window(self) -> int:
        return self.cut.context_window

    @property
    def device(self) -> torch.device:
        return self.cut.device

    @property
    def gguf(self):
        """The model with the cut head (`core.protocols.NativeWeights`)."""
        return self.cut.gguf

    def cache_bytes(self, tokens: int) -> int:
        return self.cut.cache_bytes(tokens)

    def new_state(self, batch_size: int):
        return self.cut.new_state(batch_size)

    def commit(self, state, paths: list[list[int]]) -> None:
        self.cut.commit(state, paths)

    def forward(self, state, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """(B, M, V) logits: the kept ids' from the cut head, -inf at every other id."""
        kept = self.cut.forward(state, tokens, num_logits, parents, head_rows=self.rows)[..., : self.rows]  # (B, M, N)
        out = kept.new_full((*kept.shape[:-1], self.cut.vocab_size), float("-inf"))  # (B, M, V)
        out[..., self.ids] = kept
        return out
