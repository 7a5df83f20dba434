"""`verispec train-heads --kind medusa`: collect the target's answers, train tied heads with checkpoints, write
them (through `heads.common.Partial`: OUT appears only complete, `--resume` goes on from OUT.partial)."""

from __future__ import annotations

import dataclasses

import torch

from verispec.console import notice
from verispec.head_training.common import Partial
from verispec.head_training.medusa_train import Answers, MedusaTrainConfig, split, target_answers, train_heads
from verispec.models.heads.shipped import lm_head_rows


def train_medusa(decoder, prompts: list[list[int]], config: MedusaTrainConfig, partial: Partial,
                 device: str = "cpu") -> int:
    runner = decoder.runner
    rows = min(config.rows, runner.vocab_size)
    lm_head = lm_head_rows(runner, torch.arange(rows))

    def answers() -> list[dict]:
        notice(f"training {config.heads} tied Medusa heads for {decoder.target.name} on its answers to "
               f"{len(prompts)} prompts ({config.tokens} tokens each), LM head rows 0..{rows - 1}")
        return target_answers(runner, prompts, config).records()

    train, val = split(Answers.from_records(partial.answers(answers)), config.val_fraction, config.seed)
    heads, log = train_heads(train, val, lm_head, runner.vocab_size, config,
                             resume=partial.checkpoint_to_resume(config.steps), checkpoint=partial.checkpoint,
                             device=device)
    log.update(config=dataclasses.asdict(config), device=device, train_answers=len(train), val_answers=len(val))
    partial.finish(lambda folder: heads.save(folder, base_model=decoder.target.name), runner, decoder.target.name, log)
    notice(f"validation agreement by head (greedy, target's own answers): {log['validation_agreement']}; "
           f"trained in {log['seconds']} s; saved to {partial.out} (--draft medusa:{partial.out})")
    return 0
