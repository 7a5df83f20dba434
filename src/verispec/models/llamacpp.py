"""A runner over llama.cpp (through `llama-cpp-python`, an optional extra): its kernels, our verifier.

llama.cpp evaluates the GGUF with its own quantized kernels (several times faster than dequantized
float32 weights on a CPU); verispec keeps drafting and verification. The runner has the same
interface as `ModelRunner` (new_state / forward / rollback), for one sequence at a time: a pass
returns logits for every new position (`logits_all`), and rollback truncates the token counter and
removes the rejected positions from llama.cpp's KV cache.

Exactness holds with respect to the target as llama.cpp computes it in a verification pass; like
any batched evaluation, a pass over several tokens can differ from token-by-token passes by rounding
(see README, "Floating point").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.errors import VerispecError


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LlamaCppState:
    """One sequence's position in llama.cpp's context. lengths: (1,) long."""

    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return 1

    def extend(self, num_rows: int) -> None:
        raise VerispecError("the llama.cpp backend decodes one sequence at a time")

    def select(self, rows: torch.Tensor) -> None:
        if rows.numel() > 1:
            raise VerispecError("the llama.cpp backend decodes one sequence at a time")


class LlamaCppRunner:
    """ModelRunner-compatible wrapper of a `llama_cpp.Llama` built with logits for every position."""

    def __init__(self, gguf: Path, context_window: int = 4096, threads: int | None = None) -> None:
        if not llamacpp_available():
            raise VerispecError(
                "the llama.cpp backend needs llama-cpp-python (an optional extra that compiles llama.cpp, "
                "about 10 minutes): see README, 'llama.cpp backend'"
            )
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=context_window, logits_all=True, verbose=False,
                         n_threads=threads or torch.get_num_threads(), n_batch=512)
        self.vocab_size = int(self.llm.n_vocab())
        self.context_window = context_window
        self.dtype = torch.float32
        self.owner: LlamaCppState | None = None

    def new_state(self, batch_size: int) -> LlamaCppState:
        if batch_size != 1:
            raise VerispecError("the llama.cpp backend decodes one sequence at a time (batch size 1)")
        self.llm.reset()
        self.owner = LlamaCppState(torch.zeros(1, dtype=torch.long))
        return self.owner

    def _check(self, state: LlamaCppState) -> None:
        if state is not self.owner:
            raise VerispecError("a llama.cpp context holds one sequence: this state was replaced by a newer one")

    def forward(self, state: LlamaCppState, tokens: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Append tokens[0]; return (1, M, V) logits of its last num_logits[0] positions."""
        self._check(state)
        row, m = tokens[0], max(1, num_logits[0])
        if row:
            self.llm.eval(row)
        n = self.llm.n_tokens
        state.lengths = torch.tensor([n])
        return torch.from_numpy(self.llm.scores[n - m : n].copy())[None].float()  # (1, M, V)

    def rollback(self, state: LlamaCppState, num_dropped: list[int]) -> None:
        self._check(state)
        drop = num_dropped[0]
        if drop:
            keep = self.llm.n_tokens - drop
            self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
            self.llm.n_tokens = keep
            state.lengths = torch.tensor([keep])
