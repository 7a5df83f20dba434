"""A runner over llama.cpp (through `llama-cpp-python`, an optional extra): its kernels, our verifier.

llama.cpp evaluates the GGUF with its own quantized kernels (several times faster than dequantized
float32 weights on a CPU); verispec keeps drafting and verification. The runner has the same
interface as `ModelRunner` (new_state / forward / rollback), for one sequence at a time. A pass asks
llama.cpp for logits only at the positions verification reads (the last `num_logits` of the new
tokens), through its batch API with a logits flag per token: the prompt's positions skip the output
layer (151k x 1536 for the Qwen pair) and nothing is copied into llama-cpp-python's full score
matrix (`logits_all`, n_ctx x vocab floats: 2.5 GB for the Qwen target at 4096 tokens). Rollback
truncates the token counter and removes the rejected positions from llama.cpp's KV cache.

Exactness holds with respect to the target as llama.cpp computes it in a verification pass; like
any batched evaluation, a pass over several tokens can differ from token-by-token passes by rounding
(see README, "Floating point").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
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

    def __init__(self, gguf: Path, context_window: int = 8192, threads: int | None = None) -> None:
        if not llamacpp_available():
            raise VerispecError(
                "the llama.cpp backend needs llama-cpp-python (an optional extra that compiles llama.cpp, "
                "about 10 minutes): see README, 'llama.cpp backend'"
            )
        from llama_cpp import Llama

        threads = threads or torch.get_num_threads()
        # n_threads_batch too: llama-cpp-python defaults it to every core, and passes over several tokens
        # (prompts, verification) would then run more threads than asked for (oversubscribed, ggml's
        # spinning threads slow every process on the machine to a crawl)
        self.llm = Llama(model_path=str(gguf), n_ctx=context_window, verbose=False, n_threads=threads,
                         n_threads_batch=threads, n_batch=512)
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
        """Append tokens[0] (at least one token); return (1, M, V) logits of its last M = num_logits[0]."""
        import llama_cpp

        self._check(state)
        row, m = tokens[0], max(1, num_logits[0])
        if not row or m > len(row):
            raise VerispecError(f"a llama.cpp pass needs at least num_logits={m} new tokens, got {len(row)}")
        llm, batch = self.llm, self.llm._batch.batch
        n_past = llm.n_tokens
        llm._ctx.kv_cache_seq_rm(-1, n_past, -1)
        rows: list[np.ndarray] = []
        for start in range(0, len(row), llm.n_batch):
            chunk = row[start : start + llm.n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i] = token, n_past + start + i
                batch.seq_id[i][0], batch.n_seq_id[i] = 0, 1
                batch.logits[i] = start + i >= len(row) - m
            llm._ctx.decode(llm._batch)
            for i in range(len(chunk)):
                if batch.logits[i]:
                    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i)
                    rows.append(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy())  # (V,)
        llm.n_tokens = n_past + len(row)
        state.lengths = torch.tensor([llm.n_tokens])
        return torch.from_numpy(np.stack(rows))[None]  # (1, M, V)

    def rollback(self, state: LlamaCppState, num_dropped: list[int]) -> None:
        self._check(state)
        drop = num_dropped[0]
        if drop:
            keep = self.llm.n_tokens - drop
            self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
            self.llm.n_tokens = keep
            state.lengths = torch.tensor([keep])
