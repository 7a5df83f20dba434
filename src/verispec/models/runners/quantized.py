"""Weight-only int8 linear layers for the draft model.

A draft only has to be cheap and agree often; its weights never touch the output distribution,
which speculative sampling keeps exactly the target's whatever q is. So the draft may be
quantized: per-output-channel symmetric int8 weights, bfloat16 activations, through PyTorch's
`_weight_int8pack_mm` CPU kernel (about 4x less memory traffic than float32 per token).
The target is never quantized here.
"""

from __future__ import annotations

import torch

from verispec.models.runners.packed import replace_linear_layers


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 rows times a per-row scale."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (out,)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # shape/dtype information for code that inspects layers
        return torch.empty(self.out_features, self.in_features, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def int8_supported() -> bool:
    try:
        layer = torch.nn.Linear(32, 16)
        x = torch.randn(2, 32)
        return bool(torch.allclose(Int8Linear(layer)(x), layer(x), atol=0.05))
    except (RuntimeError, AttributeError):
        return False


def quantize_linear_layers(model: torch.nn.Module) -> int:
    """Replace every nn.Linear by an Int8Linear, in place; returns how many (0 if unsupported)."""
    if not int8_supported():
        return 0
    return replace_linear_layers(model, Int8Linear)


def dequantize_linear_layers(model: torch.nn.Module) -> int:
    """Replace every Int8Linear by a float32 nn.Linear holding its dequantized weights (qweight x scale),
    in place; returns how many. The result computes what the int8 layers compute, up to rounding."""
    def dense(layer: Int8Linear) -> torch.nn.Linear:
        linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(layer.qweight.float() * layer.scales.float()[:, None])  # (out, in)
            if layer.bias is not None:
                linear.bias.copy_(layer.bias.float())
        return linear

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, dense(child))
                count += 1
    return count
