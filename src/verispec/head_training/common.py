"""What both kinds of `verispec train-heads` share: the split into training and validation answers and the
OUT.partial folder.

The collected answers (`answers.pt`) and a checkpoint every 100 steps (`checkpoint.pt`: the model, the
optimizer, the step) go to OUT.partial, each written atomically (`verispec.atomic`: a kill leaves the last
complete file). `--resume` goes on from there (the answers are not collected again). The head is built in a
folder of its own beside OUT and renamed to OUT only when it is complete; OUT.partial is removed only after
that, so a failure while saving the head (a full disk, a kill) loses no answers and no training.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from verispec.atomic import atomic_dir, atomic_path, atomic_write_json
from verispec.console import notice
from verispec.errors import VerispecError

ANSWERS, CHECKPOINT = "answers.pt", "checkpoint.pt"


def split(answers: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded split of the answers into training and validation ones (at least one held back, given two)."""
    order = np.random.default_rng(seed).permutation(len(answers))
    n_val = max(1, int(round(len(answers) * val_fraction))) if len(answers) > 1 else 0
    return [answers[i] for i in order[n_val:]], [answers[i] for i in order[:n_val]]


class Partial:
    """OUT.partial: where a training run keeps its answers and checkpoints until its head is complete."""

    def __init__(self, out: Path, resume: bool) -> None:
        self.out, self.folder, self.resume = out, out.with_name(out.name + ".partial"), resume
        if resume and not self.folder.is_dir():
            raise VerispecError(f"--resume: {self.folder} does not exist (nothing to go on from)")

    def answers(self, collect) -> list[dict]:
        """The answers saved by an earlier run (with --resume), else collect()'s, saved for a later resume.
        collect: () -> one dict of tensors per answer."""
        path = self.folder / ANSWERS
        if self.resume and path.is_file():
            answers = torch.load(path, weights_only=True)
            notice(f"resuming: {len(answers)} answers read from {path}")
            return answers
        answers = collect()
        with atomic_path(path) as tmp:
            torch.save(answers, tmp)
        return answers

    def checkpoint_to_resume(self, steps: int, device: str = "cpu") -> dict | None:
        """The last checkpoint ({"model", "optimizer", "step"}) when resuming and there is one, else None."""
        path = self.folder / CHECKPOINT
        if not (self.resume and path.is_file()):
            return None
        saved = torch.load(path, weights_only=True, map_location=device)
        notice(f"resuming at step {saved['step']} of {steps}")
        return saved

    def checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Save a checkpoint (written beside under a name of its own, then renamed over the last one)."""
        with atomic_path(self.folder / CHECKPOINT) as tmp:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)

    def finish(self, save, runner, target_name: str, log: dict) -> None:
        """save(folder) the head into a fresh folder, write training.json and the manifest (sha256, the target's
        fingerprint) there, and rename that folder to OUT: it appears only complete. Only then is OUT.partial
        (the answers, the checkpoint) removed; if anything before raises, it is kept for --resume."""
        from verispec.models.heads.shipped import write_manifest

        with atomic_dir(self.out) as folder:
            save(folder)
            atomic_write_json(folder / "training.json", log, indent=1)
            write_manifest(folder, runner, {"target": target_name})
        shutil.rmtree(self.folder, ignore_errors=True)
