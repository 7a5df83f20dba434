"""Where a model runs: `--device auto|cpu|cuda[:N]` and the dtype it defaults to there.

auto is CUDA when torch sees a GPU, else the CPU. On CUDA models run on the torch route with a static cache and
compiled passes (`models.runners.static`), in bfloat16 unless a dtype is named; on the CPU in float32 (greedy output
then equals token-by-token decoding). The native and llama.cpp runners are CPU runners.
"""

from __future__ import annotations

import torch

from verispec.errors import VerispecError

DEVICES = "auto, cpu, cuda or cuda:N"


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> torch.device:
    """'auto' / 'cpu' / 'cuda' / 'cuda:N' -> the device; a GPU that is not there is one clear line."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda") if cuda_count() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise VerispecError(f"unknown device '{name}': choose {DEVICES}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise VerispecError(f"unknown device '{name}': choose {DEVICES}")
    count = cuda_count()
    if not count:
        raise VerispecError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__}"
                            f"{', a CPU-only build' if torch.version.cuda is None else ''})")
    if device.index is not None and device.index >= count:
        raise VerispecError(f"--device {name}: torch sees {count} CUDA device(s), numbered 0 to {count - 1}")
    return device


def default_dtype(device: torch.device) -> str:
    """The compute dtype a model runs in where none is named."""
    return "bfloat16" if device.type == "cuda" else "float32"
