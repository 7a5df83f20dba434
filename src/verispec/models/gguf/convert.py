"""A transformers Llama / Qwen2 model as a `GGUFModel` in memory, its matmul weights quantized to Q8_0
(gguf's own quantizer), so a small torch draft (the distilled draft) runs on the native kernels.

Transformers' RoPE rotates halves, so the model runs with `neox` RoPE and no permutation of Q and K. The
draft's numbers change only its speed and acceptance, never the output distribution.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.models.gguf.model import GGUFConfig, GGUFModel, Layer, check_config
from verispec.models.gguf.ops import Activations, Weight

Q8_0 = 8


def _weight(name: str, tensor: torch.Tensor, qtype: int) -> Weight:
    from gguf import GGMLQuantizationType, quants

    w = tensor.detach().float().numpy()  # (rows, cols)
    rows, cols = w.shape
    if qtype == 0:
        return Weight.from_raw(name, 0, np.ascontiguousarray(w), rows, cols)
    return Weight.from_raw(name, qtype, quants.quantize(w, GGMLQuantizationType(qtype)), rows, cols)


def _vector(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.detach().float().numpy().copy()


def model_from_torch(model: torch.nn.Module, source: str = "", qtype: int = Q8_0) -> GGUFModel:
    """model: a transformers LlamaForCausalLM / Qwen2ForCausalLM. qtype: Q8_0 (8) or F32 (0)."""
    config = model.config
    if config.model_type not in ("llama", "qwen2"):
        raise VerispecError(f"the native runner takes Llama / Qwen2 drafts, not '{config.model_type}'")
    if qtype and (config.hidden_size % 32 or config.intermediate_size % 32):
        raise VerispecError("Q8_0 weights need hidden and feed-forward sizes that are multiples of 32")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    factors, mscale = _rope_factors(model, float(theta), head_dim)
    c = GGUFConfig(
        architecture=config.model_type, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=config.num_key_value_heads, head_dim=head_dim, ffn=config.intermediate_size,
        vocab=int(model.get_output_embeddings().weight.shape[0]), context=config.max_position_embeddings,
        rope_theta=float(theta), rms_eps=float(config.rms_norm_eps), neox=True, rope_attn_factor=mscale,
    )
    check_config(c, source or type(model).__name__)  # the kernels' limits hold for converted drafts too
    base = model.model
    layers = []
    for i, block in enumerate(base.layers):
        attn, mlp = block.self_attn, block.mlp
        p = f"blk.{i}."
        layers.append(Layer(
            attn_norm=_vector(block.input_layernorm.weight),
            q=_weight(p + "attn_q", attn.q_proj.weight, qtype), k=_weight(p + "attn_k", attn.k_proj.weight, qtype),
            v=_weight(p + "attn_v", attn.v_proj.weight, qtype),
            q_bias=_vector(attn.q_proj.bias), k_bias=_vector(attn.k_proj.bias), v_bias=_vector(attn.v_proj.bias),
            out=_weight(p + "attn_output", attn.o_proj.weight, qtype), ffn_norm=_vector(block.post_attention_layernorm.weight),
            gate=_weight(p + "ffn_gate", mlp.gate_proj.weight, qtype), up=_weight(p + "ffn_up", mlp.up_proj.weight, qtype),
            down=_weight(p + "ffn_down", mlp.down_proj.weight, qtype),
        ))
    head_tensor = model.get_output_embeddings().weight
    embed = _weight("token_embd", base.embed_tokens.weight, qtype)
    tied = head_tensor.data_ptr() == base.embed_tokens.weight.data_ptr()
    head = embed if tied else _weight("output", head_tensor, qtype)
    return GGUFModel(Path(source), c, embed, layers, _vector(base.norm.weight), head, factors)


STATIC_ROPE = ("llama3", "linear", "yarn")  # scalings whose frequencies do not change with the sequence's length


def _rope_factors(model: torch.nn.Module, theta: float, head_dim: int) -> tuple[np.ndarray | None, float]:
    """A scaled RoPE (Llama 3's, linear, YaRN) as per-pair frequency divisors and cos / sin's factor, read from the
    model's own rotary embedding (its inverse frequencies, its attention scaling); (None, 1.0) without scaling. A
    scaling whose frequencies follow the sequence's length (dynamic, LongRoPE in transformers) is refused: a cache
    written at one length would be read at another."""
    config = model.config
    params = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return None, 1.0
    if kind not in STATIC_ROPE:
        raise VerispecError(f"RoPE scaling '{kind}' is not supported by verispec's CPU runner for converted drafts "
                            f"(supported: {', '.join(STATIC_ROPE)})")
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().double().numpy()  # (D/2,) scaled
    plain = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (D/2,)
    return (plain / inv_freq).astype(np.float32), float(getattr(rotary, "attention_scaling", 1.0))


class NativeLinear(torch.nn.Module):
    """A bias-free torch Linear run by the native kernels with its weight quantized (Q8_0 by default): a small
    draft head beside a native target reads a quarter of the bytes per drafted token. Inference only."""

    def __init__(self, linear: torch.nn.Linear, qtype: int = Q8_0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_q = _weight("head", linear.weight, qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = np.ascontiguousarray(x.detach().reshape(-1, self.in_features).float().numpy())  # (n, in)
        return torch.from_numpy(self.weight_q(Activations(flat))).reshape(*x.shape[:-1], self.out_features)


def native_linears(module: torch.nn.Module, qtype: int = Q8_0) -> int:
    """Replace, in place, every bias-free Linear of `module` whose shape the kernels take (inputs a multiple of
    32, outputs of 16) by a NativeLinear; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) and child.bias is None and child.in_features % 32 == 0 \
                and child.out_features % 16 == 0:
            setattr(module, name, NativeLinear(child, qtype))
            count += 1
        else:
            count += native_linears(child, qtype)
    return count
