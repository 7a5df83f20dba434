"""Training an EAGLE-3 head on the target's own answers, with the training-time test (Li et al. 2025).

1. Data (`collect`): the target answers training prompts greedily on the runner that will serve; every token
   it reads leaves the hidden states entering the head's three layers (`runner.aux_features`), every answer
   position its top-k next-token distribution (soft labels). Kept in float16.
2. Draft vocabulary: the `draft_vocab` target ids most frequent in the answers' labels (ties by id), d2t / t2d
   written from them. The head's LM head starts as the target's own rows for those ids and `norm` as the
   target's final norm, `fc` as the identity on the highest fused layer: before training the head is the
   target's logit lens at layer L - 3.
3. Training-time test (`models.heads.eagle3_ttt`): the layer unrolled `ttt` steps on its own outputs, soft
   cross-entropy over the draft vocabulary weighted 0.8^j; answer positions only.
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
from verispec.core.protocols import NativeWeights
from verispec.errors import VerispecError
from verispec.models.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from verispec.models.heads.eagle3_ttt import Sample, tau, training_batch, unrolled


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


def prefill_samples(runner, records: list[dict], config: EagleTrainConfig, aux_layers: tuple[int, ...],
                    show: bool = True) -> list[Sample]:
    """Samples from a collected corpus (`heads.corpus`: prompt and answer ids): one prefill pass over each prompt
    window and its answer gives what `collect` keeps while decoding, the states entering the head's layers for
    every token and the target's top-k distribution at every answer position, without decoding again. Records
    with an empty answer give none. `heads.features` keeps them beside the corpus, to compute them once."""
    runner.aux_layers = tuple(aux_layers)
    samples = []
    with progress("the target reads the corpus's answers (features and labels)", len(records), show) as advance:
        for record in records:
            sample = prefill_sample(runner, record, config)
            if sample is not None:
                samples.append(sample)
            advance()
    return samples


def prefill_sample(runner, record: dict, config: EagleTrainConfig) -> Sample | None:
    """One record's sample (see prefill_samples; runner.aux_layers set), None for an empty answer.

    Rows are read one per pass: the logits of a whole answer are (n, V) floats, 150 MB at n = 256 for the default
    target, and a batch of them would take gigabytes."""
    prompt, answer = record["prompt"][-config.window :], record["answer"][: config.tokens]
    if not answer:
        return None
    tokens = prompt + answer
    state = runner.new_state(1)
    n = len(answer)
    logits = runner.forward(state, [tokens], [n + 1])[0, :n]  # (n, V): after the last prompt token, then each answer token but the last
    top = torch.softmax(logits.float(), -1).topk(config.top_k)  # (n, k)
    start = len(prompt) - 1
    ids = torch.zeros(len(tokens), config.top_k, dtype=torch.long)
    probs = torch.zeros(len(tokens), config.top_k)
    ids[start : start + n], probs[start : start + n] = top.indices, top.values
    return Sample(torch.tensor(tokens), runner.aux_features[0].half(), ids, probs, start)


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
    from verispec.models.heads.shipped import hidden_size

    hidden = hidden_size(runner)
    if isinstance(runner, NativeWeights):  # the GGUF's config
        c = runner.gguf.config
        head_dim, rope_theta, eps = int(c.head_dim), float(c.rope_theta), float(c.rms_eps)
    else:  # the transformers model's
        c = runner.model.config
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        rope_theta, eps = float(getattr(c, "rope_theta", 10000.0)), float(getattr(c, "rms_norm_eps", 1e-6))
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


@torch.no_grad()
def validate(head: Eagle3Head, samples: list[Sample], embed, ttt: int, batch_size: int) -> dict:
    totals = np.zeros((ttt, 2))
    for i in range(0, len(samples), batch_size):
        _, stats = unrolled(head, *training_batch(samples[i : i + batch_size], head, embed, ttt), ttt)
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
    buckets = length_buckets(train_set, config.batch_size)
    generator = torch.Generator().manual_seed(config.seed + start_step)
    device = head.fc.weight.device
    bf16 = bf16_enabled(device, config.bf16)
    log = {"loss": [], "validation": []}
    began = time.perf_counter()
    with progress("training the EAGLE-3 head", config.steps - start_step, show) as advance:
        for step in range(start_step, config.steps):
            pick = batch_of_like_lengths(buckets, config.batch_size, generator)
            head.train()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = unrolled(head, *training_batch([train_set[i] for i in pick], head, embed, config.ttt), config.ttt)
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


def length_buckets(samples: list[Sample], batch_size: int, per_bucket: int = 8) -> list[list[int]]:
    """The samples' indices sorted by length and cut into buckets of `per_bucket` batches (the last one merged into
    the one before when shorter): a batch drawn from one bucket pads little, and every sample is drawn about as
    often as with uniform sampling (all buckets but the last of equal size)."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].tokens.numel(), i))
    size = max(1, batch_size * per_bucket)
    buckets = [order[i : i + size] for i in range(0, len(order), size)]
    if len(buckets) > 1 and len(buckets[-1]) < size:
        last = buckets.pop()
        buckets[-1] = buckets[-1] + last
    return buckets


def batch_of_like_lengths(buckets: list[list[int]], batch_size: int, generator: torch.Generator) -> list[int]:
    """`batch_size` sample indices drawn (with replacement) from one bucket, the bucket drawn by its size."""
    sizes = torch.tensor([len(b) for b in buckets], dtype=torch.float)
    bucket = buckets[int(torch.multinomial(sizes, 1, generator=generator))]
    return [bucket[i] for i in torch.randint(len(bucket), (batch_size,), generator=generator).tolist()]


def aux_layers_for(runner) -> tuple[int, int, int]:
    from verispec.models.skip import num_layers

    return default_aux_layers(num_layers(runner))
