"""A runner over llama.cpp (through `llama-cpp-python`, an optional extra): its kernels, our verifier.

llama.cpp evaluates the GGUF with its own quantized kernels (several times faster than dequantized
float32 weights on a CPU); verispec keeps drafting and verification. The runner has the same
interface as every runner (`core.protocols.Runner`: new_state / forward / commit), for one sequence at a time. A pass asks
llama.cpp for logits only at the positions verification reads (the last `num_logits` of the new
tokens), through its batch API with a logits flag per token: the prompt's positions skip the output
layer (151k x 1536 for the Qwen pair) and nothing is copied into llama-cpp-python's full score
matrix (`logits_all`, n_ctx x vocab floats: 2.5 GB for the Qwen target at 4096 tokens).

Chains: draft nodes that form a chain are read as llama.cpp reads any tokens, in sequence 0 at consecutive
positions (its causal mask is the chain's), and `commit` truncates the token counter and removes the rejected
positions from the KV cache. Should a tree pass follow such nodes (a draft growing a tree one depth at a time),
they are first moved into the tree's layout below (sequence ids copied, nothing recomputed).

Trees use llama.cpp's sequence ids: a query token attends to the cached
entries that belong to its first sequence id, at positions up to its own. Tree node number `slot` has
its own sequence, 1 + slot, which holds the committed prefix (copied from sequence 0, or from its
parent's sequence) and, from the pass on, the node itself and its ancestors; a node's entry also
belongs to the sequences of its descendants in the same pass. So each node sees the prefix, its
ancestors and itself, and no sibling or cousin (they are in other sequences). Committing a path adds
sequence 0 to the path's entries and removes every node sequence, which frees the other entries.

Exactness holds with respect to the target as llama.cpp computes it in a verification pass; like
any batched evaluation, a pass over several tokens can differ from token-by-token passes by rounding
(see README, "Floating point").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.models.passes import forward_nodes


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


TREE_SEQUENCES = 256  # sequence ids in a llama.cpp context (its maximum): 0 committed, 1 + slot a tree node


@dataclass
class LlamaCppState:
    """One sequence's position in llama.cpp's context. lengths: (1,) long, committed tokens in the cache.
    tree_depths[slot]: depth of draft node `slot` (1: a child of the last committed token), and
    tree_parents[slot] its parent slot (-1: the last committed token), for the nodes since the last commit.
    in_sequence_0: the nodes form a chain read in sequence 0 (the chain layout), not one sequence per node."""

    lengths: torch.Tensor
    tree_depths: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    in_sequence_0: bool = False

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

    device = torch.device("cpu")  # where its logits are (core.protocols.Runner)

    def __init__(self, gguf: Path, context_window: int = 8192, threads: int | None = None,
                 flash_attention: bool = False) -> None:
        """flash_attention: use llama.cpp's flash attention kernel instead of its default on a CPU (the
        other one). With it, a tree node's logits equal those of a chain pass of the same width over the
        node's path bit for bit (the tests use it to check the tree masks); the default kernel's move by up
        to ~0.3 where masked entries lie between a node's ancestors (rounding, as between pass widths).
        Off by default: it is what llama.cpp itself runs, and was 2-4% slower end to end here."""
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
        # llama.cpp rounds its context up to a multiple of 256 cells; asked for less, llama-cpp-python sized its
        # batch to the smaller figure and the first pass aborted the process (an assertion on the outputs' count)
        cells = -(-max(context_window, 1) // 256) * 256
        self.llm = Llama(model_path=str(gguf), n_ctx=cells, verbose=False, n_threads=threads,
                         n_threads_batch=threads, n_batch=512)
        self._reopen_with_tree_sequences(flash_attention)
        self.vocab_size = int(self.llm.n_vocab())
        self.context_window = context_window
        self.dtype = torch.float32
        self.owner: LlamaCppState | None = None

    def _reopen_with_tree_sequences(self, flash_attention: bool) -> None:
        """Rebuild the context with a KV cache that many sequence ids share (trees need one per node):
        llama-cpp-python has no argument for it, and its default cache holds one sequence."""
        from llama_cpp import _internals

        llm = self.llm
        llm._ctx.close()
        llm.context_params.n_seq_max, llm.context_params.kv_unified = TREE_SEQUENCES, True
        if flash_attention:
            llm.context_params.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
        llm._ctx = llm._stack.enter_context(contextlib.closing(
            _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)))

    def cache_bytes(self, tokens: int) -> int:
        """llama.cpp allocates its context's cache when the model loads: a request adds nothing."""
        return 0

    def new_state(self, batch_size: int) -> LlamaCppState:
        import llama_cpp

        if batch_size != 1:
            raise VerispecError("the llama.cpp backend decodes one sequence at a time (batch size 1)")
        self.llm.reset()
        llama_cpp.llama_memory_clear(self.llm._ctx.memory, False)  # tree entries a dropped state left behind
        self.owner = LlamaCppState(torch.zeros(1, dtype=torch.long))
        return self.owner

    def _check(self, state: LlamaCppState) -> None:
        if state is not self.owner:
            raise VerispecError("a llama.cpp context holds one sequence: this state was replaced by a newer one")

    def forward(self, state: LlamaCppState, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        """Append tokens[0] (committed tokens, then draft nodes with parent slots parents[0]); return (1, M, V)
        logits of its last M = num_logits[0] positions (`core.protocols.Runner`)."""
        self._check(state)
        held = len(state.tree_depths)
        if not held and (parents is None or not parents[0]):
            return self._forward_committed(state, tokens[0], num_logits[0])
        return forward_nodes(tokens, num_logits, parents, lambda chains, nodes, parents, root: self._forward_nodes(
            state, chains[0], nodes[0], parents[0], root[0]))

    def _forward_nodes(self, state: LlamaCppState, chain: list[int], new: list[int], new_parents: list[int],
                       root: bool) -> torch.Tensor:
        """Committed tokens, then draft nodes: in sequence 0 while the nodes form a chain, else as a tree."""
        held = len(state.tree_depths)
        if chain and held:
            raise ValueError("committed tokens cannot follow draft nodes: commit first")
        for j, parent in enumerate(new_parents):
            if not -1 <= parent < held + j:
                raise ValueError(f"node {j} has parent slot {parent}, which does not exist yet")
        if (not held or state.in_sequence_0) and new_parents == list(range(held - 1, held - 1 + len(new))):
            return self._forward_chain(state, chain, new, root)
        if state.in_sequence_0:
            self._chain_to_tree(state)
        return self._forward_tree(state, chain, new, new_parents, root)

    def _forward_committed(self, state: LlamaCppState, row: list[int], num_logits: int) -> torch.Tensor:
        m = max(1, num_logits)
        if not row or m > len(row):
            raise VerispecError(f"a llama.cpp pass needs at least num_logits={m} new tokens, got {len(row)}")
        n_past = self.llm.n_tokens
        self.llm._ctx.kv_cache_seq_rm(0, n_past, -1)
        logits = self._decode(row, list(range(n_past, n_past + len(row))), [[0]] * len(row),
                              [i >= len(row) - m for i in range(len(row))])
        self.llm.n_tokens = n_past + len(row)
        state.lengths = torch.tensor([self.llm.n_tokens])
        return logits

    def _forward_chain(self, state: LlamaCppState, chain: list[int], new: list[int], root: bool) -> torch.Tensor:
        """Committed tokens, then draft nodes that continue the chain of those held, all in sequence 0: (1, M, V)
        logits after the last committed token (if `root`) and each node."""
        held = len(state.tree_depths)
        n_past = self.llm.n_tokens
        start = n_past + held  # the first new entry's position: after the committed tokens and the held nodes
        self.llm._ctx.kv_cache_seq_rm(0, start, -1)
        tokens = chain + new
        wanted = [root and i == len(chain) - 1 for i in range(len(chain))] + [True] * len(new)
        logits = self._decode(tokens, list(range(start, start + len(tokens))), [[0]] * len(tokens), wanted)
        state.tree_depths += [held + j + 1 for j in range(len(new))]
        state.tree_parents += [held + j - 1 for j in range(len(new))]
        state.in_sequence_0 = bool(state.tree_depths)
        self.llm.n_tokens = n_past + len(chain)
        state.lengths = torch.tensor([self.llm.n_tokens])
        return logits

    def _chain_to_tree(self, state: LlamaCppState) -> None:
        """Move the chain of nodes held in sequence 0 into the tree layout: node `slot`'s own sequence 1 + slot
        holds the committed prefix, its ancestors and itself."""
        import llama_cpp

        memory, base = self.llm._ctx.memory, self.llm.n_tokens
        for slot in range(len(state.tree_depths)):
            llama_cpp.llama_memory_seq_cp(memory, 0, 1 + slot, -1, base + slot + 1)
        llama_cpp.llama_memory_seq_rm(memory, 0, base, -1)
        state.in_sequence_0 = False

    def _decode(self, tokens: list[int], positions: list[int], seq_ids: list[list[int]], wanted: list[bool]) -> torch.Tensor:
        """One llama.cpp evaluation (in chunks of n_batch) of tokens at these positions, each in these
        sequences; returns (1, M, V) logits of the M wanted tokens, in order."""
        import llama_cpp

        llm, batch = self.llm, self.llm._batch.batch
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), llm.n_batch):
            end = min(start + llm.n_batch, len(tokens))
            batch.n_tokens = end - start
            for i in range(start, end):
                j = i - start
                batch.token[j], batch.pos[j], batch.logits[j] = tokens[i], positions[i], wanted[i]
                batch.n_seq_id[j] = len(seq_ids[i])
                for k, seq in enumerate(seq_ids[i]):
                    batch.seq_id[j][k] = seq
            status = llama_cpp.llama_decode(llm._ctx.ctx, batch)
            if status != 0:
                raise VerispecError(f"llama.cpp could not evaluate a pass of {len(tokens)} tokens at position "
                                    f"{positions[0]} (llama_decode returned {status}; 1 means the context is full)")
            for j in range(end - start):
                if batch.logits[j]:
                    pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, j)
                    rows.append(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy())  # (V,)
        if not rows:
            return torch.zeros(1, 0, self.vocab_size)
        return torch.from_numpy(np.stack(rows))[None]  # (1, M, V)

    def _forward_tree(self, state: LlamaCppState, chain: list[int], new: list[int], new_parents: list[int],
                      root: bool) -> torch.Tensor:
        """Committed tokens, then tree nodes with parent slots new_parents; (1, M, V) logits after the last
        committed token (if `root`) and after each node."""
        import llama_cpp

        held = len(state.tree_depths)
        if 1 + held + len(new) > TREE_SEQUENCES:
            raise VerispecError(f"a llama.cpp tree holds at most {TREE_SEQUENCES - 1} nodes between commits, "
                                f"this one would hold {held + len(new)}: use a smaller --tree-budget")
        memory, n_past = self.llm._ctx.memory, self.llm.n_tokens
        if chain:
            self.llm._ctx.kv_cache_seq_rm(0, n_past, -1)
        base = n_past + len(chain)  # the committed length once the chain is read: a depth-1 node's position
        node_seqs: list[list[int]] = []  # per new node: its own sequence, then its descendants' in this pass
        for j, parent in enumerate(new_parents):
            slot = held + j
            state.tree_depths.append(1 if parent == -1 else state.tree_depths[parent] + 1)
            state.tree_parents.append(parent)
            llama_cpp.llama_memory_seq_cp(memory, 0 if parent == -1 else 1 + parent, 1 + slot, -1, -1)
            node_seqs.append([1 + slot])
            while parent >= held:  # ancestors in this pass hold this node's sequence too
                node_seqs[parent - held].append(1 + slot)
                parent = state.tree_parents[parent]
        own = [1 + held + j for j in range(len(new))]
        tokens = chain + new
        positions = list(range(n_past, base)) + [base + state.tree_depths[held + j] - 1 for j in range(len(new))]
        seq_ids = [[0, *own]] * len(chain) + node_seqs
        wanted = [root and i == len(chain) - 1 for i in range(len(chain))] + [True] * len(new)
        logits = self._decode(tokens, positions, seq_ids, wanted)  # (1, M, V); M = 0 when there is nothing to read
        self.llm.n_tokens = base
        state.lengths = torch.tensor([base])
        return logits

    def commit(self, state: LlamaCppState, paths: list[list[int]]) -> None:
        """Keep the draft nodes on paths[0] (slots from the root down) as committed tokens; drop the others."""
        import llama_cpp

        self._check(state)
        path, held = list(paths[0]), len(state.tree_depths)
        if not held:
            if path:
                raise ValueError("no draft nodes to commit")
            return
        for i, slot in enumerate(path):
            if not 0 <= slot < held or state.tree_parents[slot] != (-1 if i == 0 else path[i - 1]):
                raise ValueError(f"slots {path} are not a path from the root")
        if state.in_sequence_0:  # a chain's first len(path) nodes are already where committed tokens go
            keep = self.llm.n_tokens + len(path)
            self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
            state.tree_depths, state.tree_parents, state.in_sequence_0 = [], [], False
            self.llm.n_tokens = keep
            state.lengths = torch.tensor([keep])
            return
        memory, base = self.llm._ctx.memory, self.llm.n_tokens
        if path:  # the last node's sequence holds the path (and its descendants' entries, beyond it)
            last = 1 + path[-1]
            llama_cpp.llama_memory_seq_rm(memory, last, base + len(path), -1)
            llama_cpp.llama_memory_seq_cp(memory, last, 0, base, base + len(path))
        for slot in range(held):
            llama_cpp.llama_memory_seq_rm(memory, 1 + slot, -1, -1)
        state.tree_depths, state.tree_parents = [], []
        self.llm.n_tokens = base + len(path)
        state.lengths = torch.tensor([self.llm.n_tokens])
