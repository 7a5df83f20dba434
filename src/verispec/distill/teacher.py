"""The target as teacher: its next-token distributions (top-k log-probabilities) on training text.

Two kinds of labels (DistillSpec's data choices, Zhou et al. 2024, section 4):
  * `generate`: the target answers prompts itself (greedy or sampled) and every step's distribution
    is kept: on-policy text for the target, the text a draft meets when it drafts for it;
  * `label`: teacher forcing over fixed text (package sources and docs): one pass, labels at every
    position.

Two backends compute them: `TorchTeacher` (any verispec `ModelRunner`; used by the tests with tiny
models) and `LlamaCppTeacher` (the GGUF target through llama.cpp's kernels, several sequences per
batch; optional extra, see README).
"""

from __future__ import annotations

import torch

from verispec.distill.data import Record


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits -> top-k (ids (N, k) long, log-probabilities (N, k) float32) of softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    values, ids = logp.topk(k, dim=-1)
    return ids, values


def choose_next(logits: torch.Tensor, temperature: float, rng: torch.Generator) -> torch.Tensor:
    """(B, V) -> (B,) next tokens: argmax at temperature 0, else a sample at that temperature."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng)[:, 0]


class TorchTeacher:
    """Teacher passes through a verispec `ModelRunner` (ragged batches, KV cache)."""

    def __init__(self, runner, eos_token_ids: set[int], slots: int = 16) -> None:
        self.runner, self.eos, self.slots = runner, set(eos_token_ids), slots
        self.vocab_size = runner.vocab_size

    def answer_all(self, prompts: list[list[int]], max_new_tokens: int, k: int, temperature: float,
                   rng: torch.Generator, on_record) -> None:
        """Answer every prompt, `slots` at a time (`generate`'s batches); `on_record(index, record)` sees each
        batch's records as it ends (the teachers' one contract with `distill.pipeline`)."""
        for start in range(0, len(prompts), self.slots):
            for j, rec in enumerate(self.generate(prompts[start : start + self.slots], max_new_tokens, k,
                                                  temperature, rng)):
                on_record(start + j, rec)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, k: int, temperature: float = 0.0,
                 rng: torch.Generator | None = None) -> list[Record]:
        """Answer every prompt (one batch); label every generated position."""
        rng = rng or torch.Generator().manual_seed(0)
        state = self.runner.new_state(len(prompts))
        tokens = [list(p) for p in prompts]
        ids: list[list[torch.Tensor]] = [[] for _ in prompts]
        logps: list[list[torch.Tensor]] = [[] for _ in prompts]
        inputs, running = [list(p) for p in prompts], list(range(len(prompts)))
        for _ in range(max_new_tokens):
            logits = self.runner.forward(state, inputs, [1 if row else 0 for row in inputs])[:, 0]  # (B, V)
            top_ids, top_logp = topk_logprobs(logits, k)
            nxt = choose_next(logits, temperature, rng)  # (B,)
            inputs = [[] for _ in prompts]
            for b in list(running):
                ids[b].append(top_ids[b])
                logps[b].append(top_logp[b])
                token = int(nxt[b])
                tokens[b].append(token)
                if token in self.eos:
                    running.remove(b)
                else:
                    inputs[b] = [token]
            if not running:
                break
        return [Record(torch.tensor(tokens[b]), len(prompts[b]) - 1, torch.stack(ids[b]), torch.stack(logps[b]))
                for b in range(len(prompts))]

    def label(self, texts: list[list[int]], k: int) -> list[Record]:
        """Teacher forcing: the distribution of the next token at every position of each text."""
        records = []
        for text in texts:
            state = self.runner.new_state(1)
            logits = self.runner.forward(state, [text], [len(text)])[0]  # (T, V)
            top_ids, top_logp = topk_logprobs(logits[:-1], k)
            records.append(Record(torch.tensor(text), 0, top_ids, top_logp))
        return records


class LlamaCppTeacher:
    """Teacher passes through llama.cpp: `slots` sequences decode together, one token each per batch.

    A finished sequence's slot is refilled with the next prompt at once (continuous batching), so
    the batch stays full; every slot has its own KV cells (sequence id = slot).
    """

    def __init__(self, gguf: str, eos_token_ids: set[int], slots: int = 16, context_per_slot: int = 2048,
                 threads: int | None = None) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self.llama_cpp, self.eos, self.slots = llama_cpp, set(eos_token_ids), slots
        llama_cpp.llama_backend_init()
        self.model = _internals.LlamaModel(path_model=str(gguf), params=llama_cpp.llama_model_default_params(),
                                           verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = slots * context_per_slot, slots
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads or torch.get_num_threads()
        self.ctx = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=slots, verbose=False)
        self.vocab_size = int(self.model.n_vocab())
        self.context_per_slot = context_per_slot

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """items: (token, position, slot, wants logits) -> (n_wanted, V) logits in item order."""
        b = self.batch.batch
        b.n_tokens = len(items)
        for i, (token, pos, slot, wants) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = slot
        self.ctx.decode(self.batch)
        rows = [self.llama_cpp.llama_get_logits_ith(self.ctx.ctx, i) for i, item in enumerate(items) if item[3]]
        import numpy as np

        if not rows:
            return torch.zeros(0, self.vocab_size)

        return torch.from_numpy(np.stack([np.ctypeslib.as_array(r, shape=(self.vocab_size,)) for r in rows]).copy())

    def _prefill(self, tokens: list[int], slot: int) -> torch.Tensor:
        self.ctx.kv_cache_seq_rm(slot, 0, -1)
        last = None
        for start in range(0, len(tokens), 512):
            chunk = tokens[start : start + 512]
            last = self._decode([(t, start + i, slot, start + i == len(tokens) - 1) for i, t in enumerate(chunk)])
        return last[0]  # (V,)

    def answer_all(self, prompts: list[list[int]], max_new_tokens: int, k: int, temperature: float,
                   rng: torch.Generator, on_record) -> None:
        """Answer every prompt, `slots` decoding together; `on_record(index, record)` sees each as it ends."""
        self.generate(prompts, max_new_tokens, k, temperature, rng, on_record)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, k: int, temperature: float = 0.0,
                 rng: torch.Generator | None = None, on_record=None) -> list[Record]:
        """Answer every prompt; label every generated position. `on_record(index, record)` sees each as it ends."""
        rng = rng or torch.Generator().manual_seed(0)
        budget = lambda p: min(max_new_tokens, self.context_per_slot - len(p) - 1)
        todo = [i for i, p in enumerate(prompts) if budget(p) > 0]
        records: dict[int, Record] = {}
        live: dict[int, dict] = {}  # slot -> {"index", "tokens", "ids", "logps", "logits"}

        def admit(slot: int) -> None:
            i = todo.pop(0)
            logits = self._prefill(prompts[i], slot)
            live[slot] = {"index": i, "tokens": list(prompts[i]), "ids": [], "logps": [], "logits": logits}

        for slot in range(self.slots):
            if todo:
                admit(slot)
        while live:
            slots = sorted(live)
            logits = torch.stack([live[s]["logits"] for s in slots])  # (B, V)
            top_ids, top_logp = topk_logprobs(logits, k)
            nxt = choose_next(logits, temperature, rng)
            step: list[tuple[int, int, int, bool]] = []
            for j, s in enumerate(slots):
                run = live[s]
                run["ids"].append(top_ids[j])
                run["logps"].append(top_logp[j])
                token = int(nxt[j])
                run["tokens"].append(token)
                i = run["index"]
                if token in self.eos or len(run["ids"]) >= budget(prompts[i]):
                    rec = Record(torch.tensor(run["tokens"]), len(prompts[i]) - 1, torch.stack(run["ids"]),
                                 torch.stack(run["logps"]))
                    records[i] = rec
                    if on_record is not None:
                        on_record(i, rec)
                    del live[s]
                    self.ctx.kv_cache_seq_rm(s, 0, -1)
                    if todo:
                        admit(s)
                else:
                    step.append((token, len(run["tokens"]) - 1, s, True))
            if step:
                out = self._decode(step)
                for row, (_, _, s, _) in zip(out, step):
                    live[s]["logits"] = row
        return [records[i] for i in sorted(records)]
