"""The training features of a collected corpus, computed once and kept beside its shards.

A corpus keeps token ids only; an EAGLE-3 head trains on the states entering three target layers and the
target's top-k labels, which a prefill pass recomputes (`eagle3_train.prefill_sample`, about 140 tokens a second
on 2 cores: two hours for a million). Every training run on the same corpus would pay that again, so the samples
are written to `CORPUS/features-KEY/shard-NNNNN.pt`, one file per shard of the corpus holding the records of that
shard computed so far, KEY naming what they depend on (the runner, the prompt window, the answer length, the
label width, the layers read). Float16 features: about 9 KB a token for the default target.

Each shard's file is written whole (`verispec.atomic`) after its missing records are computed, so a kill loses at
most one shard's work. Each sample is kept with a digest of its record's prompt and answer, and read back only
where the record still matches (a shard collected again differently, or another corpus in the same folder, is
computed again). The store is a cache: a full disk says so in one line and training goes on without it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from collections import defaultdict
from pathlib import Path

import torch

from verispec.atomic import atomic_path
from verispec.console import notice, progress
from verispec.head_training.eagle3_train import EagleTrainConfig, prefill_sample
from verispec.models.heads.eagle3_ttt import Sample

FORMAT = 2  # of a shard's file: {"format", "samples": {slot: {"digest", "sample"}}}; other formats are recomputed


def store_folder(corpus: Path, runner, config: EagleTrainConfig, aux_layers: tuple[int, ...]) -> Path:
    """Where the features of `corpus` for this runner and these settings are kept."""
    layers = ".".join(str(i) for i in aux_layers)
    key = f"{type(runner).__name__}-w{config.window}-t{config.tokens}-k{config.top_k}-L{layers}"
    return Path(corpus) / f"features-{key}"


def corpus_samples(runner, records: list[dict], config: EagleTrainConfig, aux_layers: tuple[int, ...],
                   show: bool = True) -> list[Sample]:
    """The samples of `records` (from `heads.corpus.read_corpus`: each knows its corpus folder, shard and slot), in
    their order, empty answers left out: read from the store where computed before, else computed by prefill and
    added to it."""
    runner.aux_layers = tuple(aux_layers)
    by_shard: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        by_shard[(record["corpus"], record["shard"])].append(i)
    found: dict[int, Sample | None] = {}
    todo: dict[tuple[str, int], dict] = {}
    for (corpus, shard), indices in by_shard.items():
        path = store_folder(Path(corpus), runner, config, aux_layers) / f"shard-{shard:05d}.pt"
        saved = _read(path)
        for i in indices:
            kept = saved.get(records[i]["slot"])
            if kept is not None and kept["digest"] == _digest(records[i]):
                found[i] = None if kept["sample"] is None else Sample(**kept["sample"])
        if any(i not in found for i in indices):
            todo[(corpus, shard)] = {"path": path, "saved": saved, "indices": indices}
    missing = sum(1 for job in todo.values() for i in job["indices"] if i not in found)
    if found:
        notice(f"features of {len(found)} answers read from the corpus's store; {missing} to compute")
    writable = True
    with progress("the target reads the corpus's answers (features and labels)", missing, show) as advance:
        for job in todo.values():
            for i in job["indices"]:
                if i in found:
                    continue
                found[i] = prefill_sample(runner, records[i], config)
                job["saved"][records[i]["slot"]] = {"digest": _digest(records[i]),
                                                     "sample": None if found[i] is None else _fields(found[i])}
                advance()
            writable = writable and _write(job["path"], job["saved"])
            job["saved"] = None
    return [found[i] for i in range(len(records)) if found[i] is not None]


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps([record["prompt"], record["answer"]]).encode()).hexdigest()[:16]


def _fields(sample: Sample) -> dict:
    return {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}  # the tensors shared, not copied


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        saved = torch.load(path, weights_only=True)
        if saved.get("format") != FORMAT:
            raise ValueError("another format")
        return saved["samples"]
    except Exception as err:  # a file another version wrote, or damaged: computed again
        notice(f"ignoring the features in {path} ({type(err).__name__}: {err}); computing them again")
        return {}


def _write(path: Path, saved: dict) -> bool:
    """Write one shard's features; False (said once, in one line) where the disk is full."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save({"format": FORMAT, "samples": saved}, tmp)
        return True
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        notice(f"no space left to keep the features in {path.parent}; training goes on without keeping them")
        return False
