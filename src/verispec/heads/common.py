"""What both kinds of `verispec train-heads` share: the split into training and validation answers and the
OUT.partial folder.

Everything goes to OUT.partial first: the collected answers (`answers.pt`), a checkpoint every 100 steps
(`checkpoint.pt`: the model, the optimizer, the step), then the head itself. `--resume` goes on from there
(the answers are not collected again). OUT appears, by a rename, only when the head is complete; the answers
and the checkpoint are not part of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

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
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(answers, path)
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
        """Save a checkpoint (written beside, then renamed over the last one)."""
        tmp = self.folder / (CHECKPOINT + ".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        tmp.replace(self.folder / CHECKPOINT)

    def finish(self, save, runner, target_name: str, log: dict) -> None:
        """Empty the folder (the answers, the checkpoint, anything an earlier run left), save(folder) the head,
        write training.json and the manifest (sha256, the target's fingerprint), then rename the folder to OUT:
        it appears only complete."""
        from verispec.models.heads import write_manifest

        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        save(self.folder)
        (self.folder / "training.json").write_text(json.dumps(log, indent=1) + "\n")
        write_manifest(self.folder, runner, {"target": target_name})
        if self.out.exists():
            self.out.rmdir()
        self.folder.rename(self.out)
