"""The torch route with a static, position-indexed key/value cache and compiled passes (the GPU decode path).

The cache is transformers' `StaticCache`: per layer, keys and values of shape (B, H, capacity, D) allocated once
and written at the cache's length, which only moves. A pass writes its W columns at [L, L + W) and advances L;
rollback moves L back over the columns that are dead in every row (gpt-fast's way: nothing is copied or freed).
Rows are ragged exactly as in `ModelRunner` (this class only changes how the cache is held): columns are shared,
each row's `valid` mask says which columns hold its live tokens, and padded columns are holes.

Every pass runs at one of a few widths (`WIDTHS`: a pass over 3 tokens runs at 4, its last column a hole) and its
mask always spans the whole capacity, so the model sees a handful of fixed shapes per batch size, which
`torch.compile` captures once each (with CUDA graphs, mode "reduce-overhead", on a GPU) up to COMPILED_WIDTH.
Wider passes (a prompt) run eagerly on the same cache: compiling a prefill of every length would cost more than it
saves. The cache is allocated with the state, so a graph never sees a cache that is not yet initialized. The LM head runs
outside the compiled call, on the kept positions only.

Off the CPU the logits stay on the device: the engine samples and verifies there, with per-sequence generators
made there (`SpeculativeEngine.device`), and reads back only what a decision needs (the accepted count, the
recovered or bonus token). So a seeded request on a GPU draws from another generator than on the CPU: its output
is reproducible on each, and differs between them. The hidden states draft heads read are copied to the host
(the heads run there).

Trees work as in `ModelRunner` (their 4D mask padded to the capacity). Logits equal `ModelRunner`'s to float
tolerance (attention reduces over more, masked, columns), and greedy tokens exactly (`tests/test_static_runner.py`).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from verispec.errors import VerispecError
from verispec.models.runners.hf import KVState, ModelRunner

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # the widths a pass is padded to
COMPILED_WIDTH = 32  # passes up to this width run compiled (decode, verification, trees); wider ones (prompts) eagerly
BACKENDS = ("inductor", "cudagraphs")  # torch.compile backends: fused kernels, or the eager kernels graph-captured
DEFAULT_CAPACITY = 4096  # cache columns per row unless the model's context window is shorter
RECOMPILE_LIMIT = 256  # graphs kept per compiled frame: len(WIDTHS) per batch size a server reaches, and then some


class StaticKVState(KVState):
    """A batch's static cache: `valid` covers columns 0 .. L - 1, the layers' tensors run to the capacity."""

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def checkpoint(self):
        """None: a pass may first compact the cache (`StaticRunner._make_room`), so it is not brought back after a
        pass that raised (a fault in the pass ends its rows)."""
        return None

    @torch.inference_mode()
    def set_length(self, length: int) -> None:
        """Move the cache's write position to `length` (columns past it are free)."""
        for layer in self._layers():
            layer.cumulative_length.fill_(length)

    def truncate(self, length: int) -> None:
        """Move the write position back to `length`: the entries past it stay until overwritten, never attended."""
        self.valid = self.valid[:, :length]
        self.set_length(length)

    @torch.inference_mode()
    def _rebuild(self, change) -> None:
        """Replace every layer's tensors by change(tensor) (rows kept or added), keeping them static addresses."""
        for layer in self._layers():
            layer.keys, layer.values = change(layer.keys), change(layer.values)
            layer.batch_size = layer.keys.shape[0]
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(layer.keys)
                torch._dynamo.mark_static_address(layer.values)

    def select(self, rows: torch.Tensor) -> None:
        self._no_speculative("select")
        self._rebuild(lambda t: t[rows.to(t.device)].contiguous())
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]
        self._compact()

    def extend(self, num_rows: int) -> None:
        self._no_speculative("extend")
        self._rebuild(lambda t: torch.cat([t, t.new_zeros((num_rows, *t.shape[1:]))]))
        self.valid = torch.cat([self.valid, torch.zeros(num_rows, self.valid.shape[1], dtype=torch.bool)])
        self.lengths = torch.cat([self.lengths, torch.zeros(num_rows, dtype=torch.long)])

    @torch.inference_mode()
    def _compact(self) -> None:
        """Move the live columns to the front, in order, and the write position after them."""
        live = self.valid.any(dim=0)  # (L,)
        if bool(live.all()):
            return
        columns = live.nonzero().squeeze(1)  # (L',)
        n = columns.numel()
        for layer in self._layers():
            index = columns.to(layer.keys.device)
            layer.keys[:, :, :n] = layer.keys.index_select(2, index)
            layer.values[:, :, :n] = layer.values.index_select(2, index)
        self.valid = self.valid[:, columns]
        self.set_length(n)


class StaticRunner(ModelRunner):
    """`ModelRunner` on a static cache, its passes compiled (see the module docstring).

    Args:
        model: a transformers causal LM (on the device it runs on).
        capacity: cache columns per row (a row's live tokens plus the holes between them); None: the model's context
            window, at most DEFAULT_CAPACITY.
        compile: compile the passes up to COMPILED_WIDTH with `torch.compile` (False: the same code eagerly).
        mode: torch.compile's mode for the inductor backend (None: "reduce-overhead", CUDA graphs, on CUDA; the
            default mode elsewhere).
        backend: "inductor" (fused kernels; a compile of the whole decoder per batch size and width) or
            "cudagraphs" (the eager kernels captured in CUDA graphs: no kernel compilation, seconds per shape, but
            2.9x slower decoding of an 8B shape on an H200: it copies its inputs, the cache too, at every replay).
    """

    def __init__(self, model: torch.nn.Module, capacity: int | None = None, compile: bool = True,
                 mode: str | None = None, backend: str = "inductor") -> None:
        super().__init__(model)
        self.capacity = int(capacity or min(self.context_window, DEFAULT_CAPACITY))
        if self.capacity < WIDTHS[-1]:
            raise VerispecError(f"a static cache needs at least {WIDTHS[-1]} columns, got {self.capacity}")
        self.device = next(model.parameters()).device
        self._base = model.model  # the decoder stack: embeddings, layers, final norm
        if compile:
            # one graph per (batch size, width): more than dynamo's default of 8 recompilations of one frame, after
            # which it would run the rest eagerly without a word
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
            if backend not in BACKENDS:
                raise VerispecError(f"unknown compile backend '{backend}': choose {' or '.join(BACKENDS)}")
            if backend == "cudagraphs":
                self._step = torch.compile(self._base, backend="cudagraphs", dynamic=False, fullgraph=False)
            else:
                mode = mode or ("reduce-overhead" if self.device.type == "cuda" else None)
                self._step = torch.compile(self._base, mode=mode, dynamic=False, fullgraph=False)
        else:
            self._step = self._base

    def cache_bytes(self, tokens: int) -> int:
        """A row holds `capacity` columns whatever its length."""
        return super().cache_bytes(self.capacity)

    @torch.inference_mode()
    def new_state(self, batch_size: int) -> StaticKVState:
        """A batch's cache, allocated now (not at its first pass): a compiled pass then always finds the same
        initialized layers, and one graph serves a batch size and width whether or not the cache is new."""
        config = self.model.config
        cache = StaticCache(config=config, max_cache_len=self.capacity)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        cache.early_initialization(batch_size, heads, head_dim, self.dtype, self.device)
        return StaticKVState(
            cache=cache,
            valid=torch.zeros(batch_size, 0, dtype=torch.bool),
            lengths=torch.zeros(batch_size, dtype=torch.long),
        )

    @torch.inference_mode()
    def forward(self, state: StaticKVState, tokens: list[list[int]], num_logits: list[int],
                parents: list[list[int]] | None = None) -> torch.Tensor:
        self._make_room(state, max(len(t) for t in tokens))
        return super().forward(state, tokens, num_logits, parents)

    def _make_room(self, state: StaticKVState, width: int) -> None:
        """Before a pass: compact the cache if the pass would run past its capacity, else refuse in one line."""
        width = self._width(max(1, width))
        if state.valid.shape[1] + width > self.capacity and not state.speculative:
            state._compact()
        need = state.valid.shape[1] + width
        if need > self.capacity:
            raise VerispecError(f"the static cache holds {self.capacity} columns per row and this pass needs {need}: "
                                "load the model with a larger capacity")

    def _width(self, width: int) -> int:
        return next((w for w in WIDTHS if w >= width), width)

    def _fit(self, mask: torch.Tensor) -> torch.Tensor:
        """Pad the mask's columns to the capacity (the columns past L + W are free: never attended)."""
        return torch.nn.functional.pad(mask, (0, self.capacity - mask.shape[-1]))

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pass's input built on the host, on the device without a host sync: a copy from pageable memory waits
        for the GPU (on an H200 the 8B shape's decode step spent its time in four such copies a pass), one from
        pinned memory (torch's caching host allocator: a block is reused only once its copy is done) does not."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _run(self, state: StaticKVState, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        step = self._step if input_ids.shape[1] <= COMPILED_WIDTH else self._base  # a prompt runs eagerly
        out = step(input_ids=self._upload(input_ids), position_ids=self._upload(position_ids),
                   attention_mask=self._upload(attention_mask), past_key_values=state.cache, use_cache=True,
                   output_hidden_states=bool(self.aux_layers))
        final = out.last_hidden_state  # (B, W, E) after the final norm
        index = self._upload(keep)[:, :, None].expand(-1, -1, final.shape[-1])  # (B, M, E)
        kept = final.gather(1, index)  # (B, M, E)
        if self.keep_features:
            self.features = kept.float().cpu()
        if self.aux_layers:
            aux = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1).float().cpu()  # (B, W, A E)
            self.aux_features = [aux[b, : int(n)].clone() for b, n in enumerate(counts)]
        return self.model.get_output_embeddings()(kept).float()  # (B, M, V) where the engine samples and verifies

