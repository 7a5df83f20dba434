"""Faster CPU matmuls for decoding: linear layers with weights pre-packed by oneDNN.

PyTorch's default CPU linear is efficient for one row (a matrix-vector product) but, on the CPUs
measured here, a pass over 2-16 rows costs 2-5x a one-row pass, which eats the gain of verifying
several draft tokens at once. oneDNN's packed-weight kernels keep a pass over ~8 rows within about
1.5x of a one-row pass. Packing changes only the order of floating-point accumulation (same dtype,
same weights), so logits move by rounding only (about 1e-6 in float32).
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """A drop-in nn.Linear whose weight lives in oneDNN's packed layout."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.weight_dtype = weight.dtype

    @property
    def weight(self) -> torch.Tensor:  # shape/dtype information for code that inspects layers
        return torch.empty(self.out_features, self.in_features, dtype=self.weight_dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build can pack weights of this dtype (probed on a tiny layer)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = torch.nn.Linear(16, 8).to(dtype)
        x = torch.randn(3, 16, dtype=dtype)
        return bool(torch.allclose(PackedLinear(layer)(x).float(), layer(x).float(), atol=1e-2))
    except RuntimeError:
        return False


def pack_linear_layers(model: torch.nn.Module, batch_hint: int = 8) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear, in place; returns how many were packed.

    The output layer is packed too; an input embedding tied to it keeps its own (unpacked) weight.
    """
    dtype = next(model.parameters()).dtype
    if not packing_supported(dtype):
        return 0
    return replace_linear_layers(model, lambda linear: PackedLinear(linear, batch_hint))


def replace_linear_layers(model: torch.nn.Module, make) -> int:
    """Replace every nn.Linear of `model` by make(linear), in place; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, make(child))
                count += 1
    return count
