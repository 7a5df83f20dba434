"""`verispec train-heads --kind eagle3`: collect the target's answers (or read a corpus `verispec collect` wrote),
train with checkpoints, write the head (through `heads.common.Partial`: OUT appears only complete, `--resume` goes
on from OUT.partial)."""

from __future__ import annotations

import dataclasses

import torch

from verispec.console import notice
from verispec.errors import VerispecError
from verispec.head_training.common import Partial, split
from verispec.head_training.eagle3_train import (EagleTrainConfig, aux_layers_for, collect, draft_vocabulary, new_head,
                                         train, validate)
from verispec.models.heads.eagle3_ttt import Sample
from verispec.models.heads.shipped import final_norm, lm_head_rows


class EmbeddingTable:
    """The target's embedding rows of the tokens in the data, looked up once (the native runner dequantizes)."""

    def __init__(self, runner, samples: list[Sample]) -> None:
        ids = torch.unique(torch.cat([s.tokens for s in samples]))
        self.index = torch.zeros(runner.vocab_size, dtype=torch.long)
        self.index[ids] = torch.arange(ids.numel())
        self.rows = runner.token_embeddings(ids)  # (n, E)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rows[self.index[tokens]]


def train_eagle3(decoder, prompts: list[list[int]], config: EagleTrainConfig, partial: Partial,
                 device: str = "cpu", corpus: tuple[list[dict], list[dict]] | None = None) -> int:
    """corpus: (training records, validation records) of a collected corpus (`heads.corpus.read_corpus`): their
    features and labels are recomputed by prefill passes (`prefill_samples`) instead of collecting answers."""
    runner = decoder.runner
    aux_layers = aux_layers_for(runner)
    if corpus is not None:
        train_records, val_records = corpus
        notice(f"training an EAGLE-3 head for {decoder.target.name} on a corpus of {len(train_records)} answers "
               f"({sum(len(r['answer'][: config.tokens]) for r in train_records)} tokens; {len(val_records)} held out), "
               f"features entering layers {list(aux_layers)}")
        from verispec.head_training.features import corpus_samples

        train_set = corpus_samples(runner, train_records, config, aux_layers)
        val_set = corpus_samples(runner, val_records, config, aux_layers)
        samples = train_set + val_set
    else:
        def answers() -> list[dict]:
            notice(f"training an EAGLE-3 head for {decoder.target.name} on its answers to {len(prompts)} prompts "
                   f"({config.tokens} tokens each), features entering layers {list(aux_layers)}")
            return [dataclasses.asdict(s) for s in collect(runner, prompts, config, aux_layers)]

        samples = [Sample(**s) for s in partial.answers(answers)]
        train_set, val_set = split(samples, config.val_fraction, config.seed)
    if not train_set or not val_set:
        raise VerispecError(f"{len(samples)} answer(s) cannot be split into training and validation; give more prompts")
    ids = draft_vocabulary(train_set, config.draft_vocab, runner.vocab_size)
    head = new_head(runner, config, aux_layers, ids, lm_head_rows(runner, ids), final_norm(runner)).to(device)
    embed = EmbeddingTable(runner, samples)
    before = validate(head, val_set, embed, config.ttt, config.batch_size)
    log = train(head, train_set, val_set, embed, config, resume=partial.checkpoint_to_resume(config.steps, device),
                checkpoint=partial.checkpoint)
    log.update(config=dataclasses.asdict(config), device=device, aux_layers=list(aux_layers), train_answers=len(train_set),
               val_answers=len(val_set), train_tokens=sum(s.tokens.numel() - s.start for s in train_set),
               validation_before=before)
    if corpus is not None:  # what the data was: by source and category, answers and answer tokens of each split
        from verispec.head_training.corpus import tally_key

        mix: dict[str, dict[str, int]] = {}
        for r in corpus[0] + corpus[1]:
            row = mix.setdefault(tally_key(r), {"answers": 0, "tokens": 0})
            row["answers"] += 1
            row["tokens"] += len(r["answer"][: config.tokens])
        log["data"] = {"corpora": sorted({r["corpus"] for r in corpus[0] + corpus[1]}), "mix": mix}
    partial.finish(head.cpu().save, runner, decoder.target.name, log)
    last = log["validation"][-1] if log["validation"] else before
    notice(f"validation (held-back answers, greedy): agreement by draft position {last['agreement']}, "
           f"tau {last['tau']} (before training: {before['tau']}); trained in {log['seconds']} s; saved to "
           f"{partial.out} (--draft eagle:{partial.out})")
    return 0
