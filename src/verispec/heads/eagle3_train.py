"""Training an EAGLE-3 head on the target's own answers, with the training-time test (Li et al. 2025).

1. Data (`collect`): the target answers training prompts greedily on the runner that will serve; every token
   it reads leaves the hidden states entering the head's three layers (`runner.aux_features`), every answer
   position its top-k next-token distribution (soft labels). Kept in float16.
2. Draft vocabulary: the `draft_vocab` target ids most frequent in the answers' labels (ties by id), d2t / t2d
   written from them. The head's LM head starts as the target's own rows for those ids and `norm` as the
   target's final norm, `fc` as the identity on the highest fused layer: before training the head is the
   target's logit lens at layer L - 3.
3. Training-time test: the layer is unrolled `ttt` steps. Step 0 at index t is position t: the target's fused
   feature f_t and the embedding of token t + 1. Step j at index t is position t + j: the head's own output of
   step j - 1 at index t and the embedding of token t + j + 1; it attends to step 0's entries at indices
   <= t and to its own and earlier steps' entries at index t only, exactly what drafting j + 1 tokens past
   committed position t attends to. Step j's loss is the soft cross-entropy against the target's distribution
   of token t + j + 2, over the draft vocabulary (renormalised there), weighted 0.8^j; answer positions only.
4. Validation: the same unrolled pass on held-back answers; per step the rate at which the head's argmax is the
   target's greedy token (drafts before it right), and tau = 1 + a_0 + a_0 a_1 + ..., the tokens per target
   pass a greedy chain of `ttt` drafts would give.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.console import progress
from verispec.errors import VerispecError
from verispec.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers


@dataclass(frozen=True)
class EagleTrainConfig:
    """Attributes: draft_vocab, intermediate, heads, kv_heads (the head's shape; head_dim is the target's),
    tokens (answer length per prompt), top_k (soft-label width), ttt (unrolled steps), window (tokens of
    prompt kept before an answer), steps, batch_size (answers per step), lr, val_fraction, seed, bf16 (matmuls in
    bfloat16 under autocast, weights and optimizer in float32: "auto" where the hardware has bf16 instructions
    (AVX-512 BF16 / AMX, or CUDA), "on", "off")."""

    draft_vocab: int = 8192
    intermediate: int = 2048
    heads: int = 8
    kv_heads: int = 2
    tokens: int = 128
    top_k: int = 16
    ttt: int = 3
    window: int = 128
    steps: int = 800
    batch_size: int = 4
    lr: float = 8e-4
    val_fraction: float = 0.1
    seed: int = 0
    bf16: str = "auto"

    def __post_init__(self) -> None:
        if self.bf16 not in ("auto", "on", "off"):
            raise VerispecError(f"bf16 must be auto, on or off, got '{self.bf16}'")
        if self.draft_vocab < 16 or self.intermediate < 1 or self.heads < 1 or self.kv_heads < 1:
            raise VerispecError("train-heads --kind eagle3 needs draft_vocab >= 16 and a head of at least one unit")
        if self.heads % self.kv_heads:
            raise VerispecError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.tokens < 4 or self.top_k < 1 or self.ttt < 1 or self.window < 1:
            raise VerispecError("train-heads needs tokens >= 4, top_k >= 1, ttt >= 1 and window >= 1")
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0 or not 0 < self.val_fraction < 1:
            raise VerispecError("train-heads needs steps >= 1, batch_size >= 1, lr > 0 and 0 < val_fraction < 1")


@dataclass
class Sample:
    """One answer: tokens (T,) long (prompt window, then answer); aux (T, 3E) float16, the states entering the
    head's layers for each token; label ids / probs (T, k): the target's distribution of the token after each
    position (rows before `start` are prompt positions: zeros, never used)."""

    tokens: torch.Tensor
    aux: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor
    start: int  # the first position whose label is kept (the last prompt token's)


def collect(runner, prompts: list[list[int]], config: EagleTrainConfig, aux_layers: tuple[int, ...],
            show: bool = True, batch_size: int = 16) -> list[Sample]:
    """The target's greedy answers with its layers' states and top-k labels at every answer position.

    `batch_size` prompts are answered together, one ragged pass per token (on 2 cores a 16-token pass costs
    about 4 one-token passes: four times the tokens per second of answering one prompt at a time)."""
    runner.aux_layers = tuple(aux_layers)
    samples = []
    with progress("the target answers the training prompts", len(prompts), show) as advance:
        for first in range(0, len(prompts), batch_size):
            group = [p[-config.window :] for p in prompts[first : first + batch_size]]
            state = runner.new_state(len(group))
            logits = runner.forward(state, group, [1] * len(group))[:, 0]  # (B, V)
            tokens = [list(p) for p in group]
            aux = [[a] for a in runner.aux_features]
            ids, probs = [[] for _ in group], [[] for _ in group]
            for _ in range(config.tokens):
                top = torch.softmax(logits.float(), -1).topk(config.top_k)  # (B, k)
                nxt = logits.argmax(-1).tolist()
                for b in range(len(group)):
                    ids[b].append(top.indices[b])
                    probs[b].append(top.values[b])
                    tokens[b].append(nxt[b])
                logits = runner.forward(state, [[t] for t in nxt], [1] * len(group))[:, 0]
                for b, a in enumerate(runner.aux_features):
                    aux[b].append(a)
            for b, prompt in enumerate(group):
                n, start = len(tokens[b]), len(prompt) - 1
                label_ids = torch.zeros(n, config.top_k, dtype=torch.long)
                label_probs = torch.zeros(n, config.top_k)
                label_ids[start : start + config.tokens] = torch.stack(ids[b])
                label_probs[start : start + config.tokens] = torch.stack(probs[b])
                samples.append(Sample(torch.tensor(tokens[b]), torch.cat(aux[b]).half(), label_ids, label_probs, start))
            advance(len(group))
    return samples


def draft_vocabulary(samples: list[Sample], size: int, vocab: int) -> torch.Tensor:
    """(size,) increasing target ids: the most frequent among the answers' labels (weighted by probability)."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in samples:
        counts.index_add_(0, s.ids[s.start :].reshape(-1), s.probs[s.start :].reshape(-1).double())
    order = sorted(range(vocab), key=lambda i: (-float(counts[i]), i))[: min(size, vocab)]
    return torch.tensor(sorted(order), dtype=torch.long)


def new_head(runner, config: EagleTrainConfig, aux_layers: tuple[int, ...], target_ids: torch.Tensor,
             lm_head_rows: torch.Tensor, final_norm: torch.Tensor) -> Eagle3Head:
    """A head for this target, started as its logit lens at the highest fused layer (see the module doc)."""
    from verispec.models.heads import hidden_size

    hidden = hidden_size(runner)
    c = getattr(runner, "config", None)
    head_dim = int(c.head_dim) if hasattr(c, "head_dim") else int(runner.model.config.hidden_size // runner.model.config.num_attention_heads)
    rope_theta = float(c.rope_theta) if hasattr(c, "rope_theta") else float(getattr(runner.model.config, "rope_theta", 10000.0))
    eps = float(c.rms_eps) if hasattr(c, "rms_eps") else float(getattr(runner.model.config, "rms_norm_eps", 1e-6))
    shape = Eagle3Config(hidden=hidden, intermediate=config.intermediate, heads=config.heads, kv_heads=config.kv_heads,
                         head_dim=head_dim, vocab=runner.vocab_size, draft_vocab=int(target_ids.numel()),
                         target_hidden=hidden, rms_eps=eps, rope_theta=rope_theta, aux_layers=tuple(aux_layers))
    torch.manual_seed(config.seed)
    head = Eagle3Head(shape)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.02 / math.sqrt(3))
        head.fc.weight[:, 2 * hidden :] += torch.eye(hidden)
        head.lm_head.weight.copy_(lm_head_rows)
        head.norm.weight.copy_(final_norm)
        for linear in (head.midlayer.self_attn.o_proj, head.midlayer.mlp.down_proj):
            linear.weight.mul_(0.1)  # the layer starts close to passing its residual through
    head.set_vocabulary(target_ids)
    return head


def _batch(samples: list[Sample], head: Eagle3Head, embed, ttt: int):
    """Pad a batch: tokens' next embeddings, features, positions and per-step labels over the draft vocab.
    Returns embeds (B, T + ttt, E) (index t holds token t + 1's), aux (B, T, 3E), valid (B, T), label ids
    (B, T + ttt, k) as draft ids, probs (B, T + ttt, k) renormalised over the draft vocab (0 where unusable)."""
    T = max(s.aux.shape[0] for s in samples)
    B, k = len(samples), samples[0].ids.shape[1]
    to_draft = torch.full((head.config.vocab,), -1, dtype=torch.long)
    to_draft[head.target_ids.cpu()] = torch.arange(head.config.draft_vocab)
    aux = torch.zeros(B, T, samples[0].aux.shape[1])
    next_ids = torch.zeros(B, T + ttt, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.zeros(B, T + ttt, k, dtype=torch.long)
    probs = torch.zeros(B, T + ttt, k)
    for b, s in enumerate(samples):
        n = s.aux.shape[0]
        aux[b, :n] = s.aux.float()
        next_ids[b, : n - 1] = s.tokens[1:n]
        valid[b, : n - 1] = True  # the last token's next one is unknown
        d = to_draft[s.ids]  # (n, k)
        p = torch.where(d >= 0, s.probs, torch.zeros_like(s.probs))
        p[: s.start] = 0
        ids[b, :n], probs[b, :n] = d.clamp_min(0), p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    embeds = embed(next_ids.reshape(-1)).reshape(B, T + ttt, -1)
    device = head.fc.weight.device
    return tuple(t.to(device) for t in (embeds, aux, valid, ids, probs))


def unrolled(head: Eagle3Head, embeds, aux, valid, ids, probs, ttt: int):
    """The training-time test over a padded batch. Returns the loss and, per step, (right, counted) greedy
    agreement counts with the target's top label (drafts before it assumed right)."""
    B, T, _ = aux.shape
    mid, c = head.midlayer, head.config
    group = c.heads // c.kv_heads
    positions = torch.arange(T, device=aux.device)
    h = head.fc(aux)  # (B, T, E)
    causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()  # (T, T) step 0's entries at indices <= t
    keys, values, loss, stats = [], [], torch.zeros((), device=aux.device), []
    for j in range(ttt):
        cos, sin = head.rope(positions + j)  # (T, D)
        q, k, v = mid.qkv(embeds[:, j : j + T].reshape(B * T, -1), h.reshape(B * T, -1),
                          cos.repeat(B, 1), sin.repeat(B, 1))
        q = q.view(B, T, c.heads, c.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(group, 1)  # (B, Hq, T, D)
        v = v.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        keys.append(k)
        values.append(v)
        scale = c.head_dim ** -0.5
        first = (q @ keys[0].transpose(-1, -2)) * scale  # (B, Hq, T, T)
        first = first.masked_fill(~causal, float("-inf"))
        diagonal = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # (B, Hq, T, 1) each
        weights = torch.softmax(torch.cat([first, *diagonal], dim=-1), dim=-1)  # (B, Hq, T, T + j)
        out = weights[..., :T] @ values[0]  # (B, Hq, T, D)
        for i in range(1, j + 1):
            out = out + weights[..., T + i - 1 : T + i] * values[i]
        h = mid.finish(out.transpose(1, 2).reshape(B * T, -1), h.reshape(B * T, -1)).view(B, T, -1)
        p = probs[:, j + 1 : j + 1 + T]  # (B, T, k): the target's distribution of token t + j + 2
        use = valid & (p.sum(-1) > 0)
        if j:
            use = use & torch.nn.functional.pad(valid[:, j:], (0, j))  # the tokens fed at step j exist
        labels = ids[:, j + 1 : j + 1 + T][use]  # (n, k) at the positions with a label only (the LM head's cost)
        logq = torch.log_softmax(head.lm_head(head.norm(h[use])), -1)  # (n, V_draft)
        ce = -(p[use] * logq.gather(-1, labels)).sum(-1)  # (n,)
        loss = loss + 0.8 ** j * ce.sum() / max(1, ce.numel())
        with torch.no_grad():
            stats.append((int((logq.argmax(-1) == labels[:, 0]).sum()), int(ce.numel())))
    return loss, stats


def bf16_enabled(device: torch.device, setting: str) -> bool:
    """Whether training runs its matmuls in bfloat16 (see EagleTrainConfig.bf16)."""
    if setting != "auto":
        return setting == "on"
    if device.type == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "avx512_bf16" in flags or "amx_bf16" in flags  # else bfloat16 matmuls are emulated: slower


def tau(rates: list[float]) -> float:
    """Tokens per target pass of a greedy chain whose drafts are right at these rates (given the ones before)."""
    total, alive = 1.0, 1.0
    for a in rates:
        alive *= a
        total += alive
    return total


@torch.no_grad()
def validate(head: Eagle3Head, samples: list[Sample], embed, ttt: int, batch_size: int) -> dict:
    totals = np.zeros((ttt, 2))
    for i in range(0, len(samples), batch_size):
        _, stats = unrolled(head, *_batch(samples[i : i + batch_size], head, embed, ttt), ttt)
        totals += np.array(stats)
    rates = [round(float(r / max(n, 1)), 4) for r, n in totals]
    return {"agreement": rates, "tau": round(tau(rates), 3)}


def train(head: Eagle3Head, train_set: list[Sample], val_set: list[Sample], embed, config: EagleTrainConfig,
          resume: dict | None = None, checkpoint=None, show: bool = True) -> dict:
    """Train in place. resume: a checkpoint to go on from ({"model", "optimizer", "step"}); checkpoint(head,
    optimizer, step) is called every 100 steps and at the end. Returns the log (loss, validation by step, seconds)."""
    params = list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.01)
    start_step = 0
    if resume is not None:
        head.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        start_step = int(resume["step"])
    warmup = max(1, config.steps // 20)

    def rate(s: int) -> float:  # linear warm-up, then cosine to 0; s counts from start_step on a resume
        s += start_step
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, config.steps) / config.steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    generator = torch.Generator().manual_seed(config.seed + start_step)
    device = head.fc.weight.device
    bf16 = bf16_enabled(device, config.bf16)
    log = {"loss": [], "validation": []}
    began = time.perf_counter()
    with progress("training the EAGLE-3 head", config.steps - start_step, show) as advance:
        for step in range(start_step, config.steps):
            pick = torch.randint(len(train_set), (config.batch_size,), generator=generator).tolist()
            head.train()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = unrolled(head, *_batch([train_set[i] for i in pick], head, embed, config.ttt), config.ttt)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            if step % 25 == 0 or step == config.steps - 1:
                log["loss"].append((step, round(float(loss.detach()), 4)))
            if (step + 1) % 100 == 0 or step == config.steps - 1:
                head.eval()
                log["validation"].append({"step": step + 1, **validate(head, val_set, embed, config.ttt, config.batch_size)})
                if checkpoint is not None:
                    checkpoint(head, optimizer, step + 1)
            advance()
    head.eval()
    log["seconds"] = round(time.perf_counter() - began, 1)
    log["bf16"] = bf16
    return log


def aux_layers_for(runner) -> tuple[int, int, int]:
    from verispec.models.skip import num_layers

    return default_aux_layers(num_layers(runner))
