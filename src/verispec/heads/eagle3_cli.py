"""`verispec train-heads --kind eagle3`: collect, train with checkpoints, resume, write the head atomically.

Everything goes to OUT.partial first: the collected answers (`answers.pt`), a checkpoint every 100 steps
(`checkpoint.pt`: the head, the optimizer, the step), then the head itself. `--resume` goes on from there
(the answers are not collected again). OUT appears, by a rename, only when the head is complete; the answers
and the checkpoint are not part of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from verispec.console import notice
from verispec.errors import VerispecError
from verispec.heads.eagle3_train import (EagleTrainConfig, Sample, aux_layers_for, collect, draft_vocabulary, new_head,
                                         split, train, validate)

ANSWERS, CHECKPOINT = "answers.pt", "checkpoint.pt"


def target_rows(runner, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's LM head rows for these ids (k, E) and its final norm's weight (E,), float32."""
    gguf = getattr(runner, "gguf", None)
    if gguf is not None:
        return torch.from_numpy(gguf.head.take_rows(ids.numpy().astype(np.int64))), torch.from_numpy(np.asarray(gguf.norm, np.float32))
    weight = runner.model.get_output_embeddings().weight
    if weight.device.type == "meta":
        raise VerispecError("train-heads reads the target's LM head: run it with --target-weights dense or on a GGUF")
    return weight[ids].detach().float(), runner.model.model.norm.weight.detach().float()


class EmbeddingTable:
    """The target's embedding rows of the tokens in the data, looked up once (the native runner dequantizes)."""

    def __init__(self, runner, samples: list[Sample]) -> None:
        ids = torch.unique(torch.cat([s.tokens for s in samples]))
        self.index = torch.zeros(runner.vocab_size, dtype=torch.long)
        self.index[ids] = torch.arange(ids.numel())
        self.rows = runner.token_embeddings(ids)  # (n, E)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rows[self.index[tokens]]


def train_eagle3(decoder, prompts: list[list[int]], config: EagleTrainConfig, out: Path, partial: Path,
                 resume: bool, device: str = "cpu") -> int:
    runner = decoder.runner
    aux_layers = aux_layers_for(runner)
    partial.mkdir(parents=True, exist_ok=True)
    if resume and (partial / ANSWERS).is_file():
        samples = [Sample(**s) for s in torch.load(partial / ANSWERS, weights_only=True)]
        notice(f"resuming: {len(samples)} answers read from {partial / ANSWERS}")
    else:
        notice(f"training an EAGLE-3 head for {decoder.target.name} on its answers to {len(prompts)} prompts "
               f"({config.tokens} tokens each), features entering layers {list(aux_layers)}")
        samples = collect(runner, prompts, config, aux_layers)
        torch.save([dataclasses.asdict(s) for s in samples], partial / ANSWERS)
    train_set, val_set = split(samples, config.val_fraction, config.seed)
    if not train_set or not val_set:
        raise VerispecError(f"{len(samples)} answer(s) cannot be split into training and validation; give more prompts")
    ids = draft_vocabulary(train_set, config.draft_vocab, runner.vocab_size)
    rows, norm = target_rows(runner, ids)
    head = new_head(runner, config, aux_layers, ids, rows, norm).to(device)
    embed = EmbeddingTable(runner, samples)
    start, optimizer_state = 0, None
    if resume and (partial / CHECKPOINT).is_file():
        saved = torch.load(partial / CHECKPOINT, weights_only=True, map_location=device)
        head.load_state_dict(saved["head"])
        start, optimizer_state = int(saved["step"]), saved["optimizer"]
        notice(f"resuming at step {start} of {config.steps}")
    before = validate(head, val_set, embed, config.ttt, config.batch_size)

    def checkpoint(step: int, optimizer) -> None:
        tmp = partial / (CHECKPOINT + ".tmp")
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        tmp.replace(partial / CHECKPOINT)

    log = train(head, train_set, val_set, embed, config, start, optimizer_state, checkpoint)
    for name in (ANSWERS, CHECKPOINT):
        (partial / name).unlink(missing_ok=True)
    head.cpu().save(partial)
    log.update(config=dataclasses.asdict(config), device=device, aux_layers=list(aux_layers), train_answers=len(train_set),
               val_answers=len(val_set), train_tokens=sum(s.tokens.numel() - s.start for s in train_set),
               validation_before=before)
    from verispec.heads.cli import finish

    finish(partial, out, runner, decoder.target.name, log)
    last = log["validation"][-1] if log["validation"] else before
    notice(f"validation (held-back answers, greedy): agreement by draft position {last['agreement']}, "
           f"tau {last['tau']} (before training: {before['tau']}); trained in {log['seconds']} s; saved to {out} "
           f"(--draft eagle:{out})")
    return 0
