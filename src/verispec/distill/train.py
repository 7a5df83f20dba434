"""Distillation of the tiny draft from the target's labels (DistillSpec, Zhou et al. 2024).

Loss, per position (the draft's softmax runs over its own vocabulary, OTHER excluded):
  * labelled positions: forward KL from the target, KL(p || q) = sum_x p(x) (log p(x) - log q(x)),
    with p the target's top-k distribution restricted to the draft vocabulary and renormalised
    (only the cross-entropy term depends on q);
  * unlabelled text: next-token cross-entropy, where the next token is in the draft vocabulary.

Validation (on labelled sequences the draft never trains on) reports what speculative decoding
will see: `greedy_acceptance`, how often the draft's argmax equals the target's on the target's
own text (the per-token acceptance rate of greedy speculation), and `overlap`, sum_x min(p(x), q(x))
over the target's top-k at temperature 1 (a lower bound of the sampling acceptance rate).

Training checkpoints every `checkpoint_every` steps (model, optimiser, step, data order) and resumes
from the last checkpoint; the result is exported as a distilled draft directory (`model.py`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.atomic import atomic_path, atomic_write_text
from verispec.distill.data import Record
from verispec.models.distilled import TinyDraftConfig, VocabMap, save_distilled
from verispec.errors import VerispecError


@dataclass(frozen=True)
class TrainConfig:
    """steps, batch_size sequences of seq_len tokens, AdamW at lr (warm-up, then cosine to lr / 10).

    labelled_fraction: share of each batch drawn from windows with target labels (the rest from
    plain text), so a small labelled set is not drowned by a large corpus.
    """

    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    eval_every: int = 100
    checkpoint_every: int = 100
    labelled_fraction: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise VerispecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise VerispecError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.labelled_fraction <= 1.0:
            raise VerispecError(f"labelled_fraction must be in [0, 1], got {self.labelled_fraction}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Example:
    """A record in draft ids. inp: (T,) long; hard: (T,) long next draft id or -100; soft_ids, soft_w:
    (T, k) draft ids and renormalised target probabilities (weights 0 where a position has none)."""

    inp: torch.Tensor
    hard: torch.Tensor
    soft_ids: torch.Tensor
    soft_w: torch.Tensor


def to_example(record: Record, vocab: VocabMap, k: int) -> Example:
    T = record.tokens.numel()
    inp = vocab.to_draft[record.tokens]  # (T,)
    hard = torch.full((T,), -100, dtype=torch.long)
    nxt = inp[1:]
    hard[:-1] = torch.where(nxt == vocab.other, torch.full_like(nxt, -100), nxt)
    soft_ids = torch.full((T, k), vocab.other, dtype=torch.long)
    soft_w = torch.zeros(T, k)
    L = min(record.topk_ids.shape[0], T - record.label_start)
    if L > 0:
        ids = vocab.to_draft[record.topk_ids[:L, :k]]  # (L, k)
        w = record.topk_logprobs[:L, :k].exp() * (ids != vocab.other)  # (L, k)
        mass = w.sum(-1, keepdim=True)  # (L, 1)
        w = torch.where(mass > 0, w / mass.clamp_min(1e-12), w)
        kk = ids.shape[1]
        soft_ids[record.label_start : record.label_start + L, :kk] = ids
        soft_w[record.label_start : record.label_start + L, :kk] = w
        labelled = torch.zeros(T, dtype=torch.bool)
        labelled[record.label_start : record.label_start + L] = mass[:, 0] > 0
        hard[labelled] = -100  # the soft label replaces the hard one
    return Example(inp, hard, soft_ids, soft_w)


def windows(examples: list[Example], seq_len: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(example index, start) of every window of seq_len tokens with a training signal: (labelled, plain).

    A labelled window ends at the last labelled position, so its context reaches as far back as it can."""
    labelled, plain = [], []
    for i, ex in enumerate(examples):
        has_soft = (ex.soft_w > 0).any(-1)  # (T,)
        if bool(has_soft.any()):
            last = int(has_soft.nonzero().max()) + 1
            first = int(has_soft.nonzero().min())
            for end in range(last, first, -seq_len):
                labelled.append((i, max(0, end - seq_len)))
        for start in range(0, max(1, ex.inp.numel() - 1), seq_len):
            if bool((ex.hard[start : start + seq_len] >= 0).any()):
                plain.append((i, start))
    return labelled, plain


def make_batch(examples: list[Example], picks: list[tuple[int, int]], seq_len: int, pad: int):
    """Stack windows: inp, hard (B, S); soft_ids, soft_w (B, S, k); mask (B, S) real tokens."""
    k = examples[0].soft_ids.shape[1]
    B = len(picks)
    inp = torch.full((B, seq_len), pad, dtype=torch.long)
    hard = torch.full((B, seq_len), -100, dtype=torch.long)
    soft_ids = torch.full((B, seq_len, k), pad, dtype=torch.long)
    soft_w = torch.zeros(B, seq_len, k)
    mask = torch.zeros(B, seq_len, dtype=torch.long)
    for b, (i, start) in enumerate(picks):
        ex = examples[i]
        n = min(seq_len, ex.inp.numel() - start)
        inp[b, :n], hard[b, :n] = ex.inp[start : start + n], ex.hard[start : start + n]
        soft_ids[b, :n], soft_w[b, :n] = ex.soft_ids[start : start + n], ex.soft_w[start : start + n]
        mask[b, :n] = 1
    return inp, hard, soft_ids, soft_w, mask


def draft_log_probs(model: torch.nn.Module, inp: torch.Tensor, mask: torch.Tensor, other: int) -> torch.Tensor:
    """(B, S) draft ids -> (B, S, Vd + 1) log q over the draft vocabulary (OTHER gets -inf)."""
    logits = model(input_ids=inp, attention_mask=mask).logits.float()  # (B, S, Vd + 1)
    logits[..., other] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def distill_loss(logq: torch.Tensor, hard: torch.Tensor, soft_ids: torch.Tensor, soft_w: torch.Tensor) -> torch.Tensor:
    """Mean over positions with a signal of: soft cross-entropy -sum_x p(x) log q(x), or -log q(next)."""
    soft = -(soft_w * logq.gather(-1, soft_ids).clamp_min(-1e4)).sum(-1)  # (B, S)
    has_soft = soft_w.sum(-1) > 0  # (B, S)
    has_hard = hard >= 0
    hard_nll = -logq.gather(-1, hard.clamp_min(0)[..., None])[..., 0]  # (B, S)
    total = (soft * has_soft).sum() + (hard_nll * has_hard).sum()
    return total / (has_soft.sum() + has_hard.sum()).clamp_min(1)


LOOKUP_CHOICES = (0, 1, 2, 3)  # "lookup first" minimum n-gram sizes tried at export (0: off)


@torch.no_grad()
def choose_lookup(model: torch.nn.Module, records: list[Record], vocab: VocabMap, seq_len: int = 512) -> dict:
    """Greedy agreement with the target on `records` when the draft copies from the context first
    (prompt lookup with n-grams of 4 down to N, else its own argmax), for N in LOOKUP_CHOICES.
    Returns {"agreement": {N: rate}, "best": N}; N = 0 is the draft alone."""
    from verispec.config import PromptLookupConfig
    from verispec.drafters.prompt_lookup import lookup

    model.eval()
    hits = dict.fromkeys(LOOKUP_CHOICES, 0)
    n = 0
    for rec in records:
        tokens = rec.tokens.tolist()
        L = rec.topk_ids.shape[0]
        for start in range(rec.label_start, rec.label_start + L, seq_len):
            hi = min(start + seq_len, rec.label_start + L)
            lo_ctx = max(0, hi - seq_len)
            ctx = vocab.to_draft[rec.tokens[lo_ctx:hi]][None]  # (1, W)
            own = vocab.to_target[draft_log_probs(model, ctx, torch.ones_like(ctx), vocab.other)[0].argmax(-1)]  # (W,)
            for pos in range(start, hi):
                truth = int(rec.topk_ids[pos - rec.label_start, 0])
                mine = int(own[pos - lo_ctx])
                n += 1
                for choice in LOOKUP_CHOICES:
                    copied = lookup(tokens[: pos + 1], 1, PromptLookupConfig(4, choice)) if choice else []
                    hits[choice] += (copied[0] if copied else mine) == truth
    model.train()
    rates = {c: hits[c] / max(n, 1) for c in LOOKUP_CHOICES}
    return {"agreement": rates, "best": max(LOOKUP_CHOICES, key=lambda c: (rates[c], -c))}


@torch.no_grad()
def evaluate(model: torch.nn.Module, records: list[Record], vocab: VocabMap, seq_len: int = 512) -> dict:
    """greedy_acceptance and overlap (see module docstring) over the labelled positions of `records`."""
    model.eval()
    agree = overlap = n = 0.0
    for rec in records:
        L = rec.topk_ids.shape[0]
        if L == 0:
            continue
        for start in range(0, rec.tokens.numel(), seq_len):  # windows of context from the record start
            lo, hi = max(start, rec.label_start), min(start + seq_len, rec.label_start + L)
            if lo >= hi:
                continue
            ctx = vocab.to_draft[rec.tokens[max(0, hi - seq_len) : hi]][None]  # (1, W)
            logq = draft_log_probs(model, ctx, torch.ones_like(ctx), vocab.other)[0]  # (W, Vd + 1)
            offset = max(0, hi - seq_len)
            rows = logq[lo - offset : hi - offset]  # (n, Vd + 1)
            top = rec.topk_ids[lo - rec.label_start : hi - rec.label_start]  # (n, k) target ids
            p = rec.topk_logprobs[lo - rec.label_start : hi - rec.label_start].exp()  # (n, k)
            agree += float((vocab.to_target[rows.argmax(-1)] == top[:, 0]).sum())
            draft_ids = vocab.to_draft[top]  # (n, k)
            q = torch.where(draft_ids == vocab.other, torch.zeros_like(p), rows.exp().gather(-1, draft_ids))
            overlap += float(torch.minimum(p, q).sum())
            n += hi - lo
    model.train()
    return {"greedy_acceptance": agree / max(n, 1), "overlap": overlap / max(n, 1), "positions": int(n)}


def init_embeddings_from_target(model: torch.nn.Module, target_embeddings: torch.Tensor, vocab: VocabMap) -> None:
    """Start the draft's (tied) embedding from the target's, projected on its top principal directions."""
    rows = target_embeddings[vocab.to_target].float()  # (Vd, Ht)
    rows = rows - rows.mean(0, keepdim=True)
    hidden = model.get_input_embeddings().weight.shape[1]
    _, _, V = torch.pca_lowrank(rows, q=hidden, center=False)
    proj = rows @ V[:, :hidden]  # (Vd, H)
    proj = proj * (0.02 / proj.std().clamp_min(1e-8))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[: vocab.draft_vocab_size] = proj
        emb[vocab.other] = proj.mean(0)


def train(model: torch.nn.Module, config: TinyDraftConfig, vocab: VocabMap, train_records: list[Record],
          val_records: list[Record], cfg: TrainConfig, out: Path, meta: dict, resume: bool = True,
          log=print) -> dict:
    """Run (or resume) distillation into `out`; export the distilled draft to `out / "draft"`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from verispec.console import stderr_console

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    k = max((r.topk_ids.shape[1] for r in train_records if r.topk_ids.numel()), default=1)
    examples = [to_example(r, vocab, k) for r in train_records]
    labelled, plain = windows(examples, cfg.seq_len)
    if not labelled and not plain:
        raise VerispecError("the training data holds no position to learn from")
    fraction = cfg.labelled_fraction if labelled and plain else float(bool(labelled))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    rng = torch.Generator().manual_seed(cfg.seed)
    step, history = 0, []
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)  # tensors, numbers, strings: nothing to unpickle
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.set_state(state["rng"])
        step, history = state["step"], state["history"]
        log(f"resumed from {ckpt} at step {step}")
    model.train()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    started, tokens_seen = time.perf_counter(), 0
    with Progress(*columns, console=stderr_console()) as progress:
        task = progress.add_task("distill", total=cfg.steps, completed=step)
        while step < cfg.steps:
            n_lab = int(torch.binomial(torch.tensor(float(cfg.batch_size)), torch.tensor(fraction), generator=rng))
            picks = [labelled[int(i)] for i in torch.randint(len(labelled) or 1, (n_lab,), generator=rng)]
            picks += [plain[int(i)] for i in torch.randint(len(plain) or 1, (cfg.batch_size - n_lab,), generator=rng)]
            inp, hard, soft_ids, soft_w, mask = make_batch(examples, picks, cfg.seq_len, vocab.other)
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            loss = distill_loss(draft_log_probs(model, inp, mask, vocab.other), hard, soft_ids, soft_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += int(mask.sum())
            progress.update(task, advance=1, description=f"distill loss {loss.item():.3f}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                metrics = evaluate(model, val_records, vocab) if val_records else {}
                entry = {"step": step, "loss": round(loss.item(), 4), "lr": cfg.lr_at(step),
                         "tokens_per_second": round(tokens_seen / (time.perf_counter() - started), 1),
                         **{m: round(v, 4) if isinstance(v, float) else v for m, v in metrics.items()}}
                history.append(entry)
                # the whole history, rewritten atomically: a kill never leaves half a line, and a resumed run
                # (whose history comes from its checkpoint) does not log again the steps it redoes
                atomic_write_text(out / "log.jsonl", "".join(json.dumps(e) + "\n" for e in history))
                progress.console.print(" ".join(f"{m}={v}" for m, v in entry.items()))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                with atomic_path(ckpt) as tmp:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.get_state(),
                                "step": step, "history": history}, tmp)
    model.eval()
    summary = {**meta, "train_config": asdict(cfg), "draft_config": asdict(config), "history": history[-5:]}
    if val_records:
        chosen = choose_lookup(model, val_records, vocab)
        log(f"greedy agreement on validation with lookup first (min n-gram: rate; 0 = the draft alone): "
            + ", ".join(f"{c}: {r:.3f}" for c, r in chosen["agreement"].items()))
        summary["lookup_agreement"] = {str(c): round(r, 4) for c, r in chosen["agreement"].items()}
        if chosen["best"]:
            summary["draft_lookup"] = {"max_ngram": 4, "min_ngram": chosen["best"]}
    save_distilled(out / "draft", config, model, vocab, summary)
    return summary
