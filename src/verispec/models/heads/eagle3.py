"""EAGLE-3 draft heads (Li et al. 2025): one decoder layer drafting on the target's own features.

The target's verification pass already computes, for every token it reads, the hidden states entering
three of its layers (low, middle, high: by default 2, L / 2 and L - 3). The head fuses them, `fc`:
(3 E_target) -> E, into one feature f_t per position. Its single decoder layer (`midlayer`) takes, at
position t, the normed embedding of the token after t and the normed feature, concatenated (2E wide into
q, k, v), with f_t as the residual; its output o_t, after `norm` and `lm_head` over a reduced draft
vocabulary, guesses the token two places after t. Drafting goes on autoregressively on the head's own
outputs: the next position's feature is o_t itself (not fused again), with the embedding of the token just
drafted. The layer keeps its own keys and values per position, like any decoder layer.

Draft vocabulary: `lm_head` has `draft_vocab_size` rows; draft id i is target id i + d2t[i] (`t2d` marks the
target ids covered). q over the target's vocabulary is 0 outside them: exact, as for any reduced-vocabulary
draft.

Checkpoint format (SpecForge / the EAGLE repository, so a published head loads as it is): a folder with
`config.json` (`architectures: ["LlamaForCausalLMEagle3"]`, `hidden_size`, `intermediate_size`,
`num_attention_heads`, `num_key_value_heads`, optional `head_dim`, `rms_norm_eps`, `rope_theta`,
`rope_scaling`, `vocab_size` (the target's), `draft_vocab_size`, optional `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`) and weights (`model.safetensors`,
shards, or `pytorch_model.bin`): `midlayer.*` (or `layers.0.*`), `fc.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`, optionally `embed_tokens.weight` (else the target's own embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from verispec.errors import VerispecError

EAGLE = "eagle"
CONFIG = "config.json"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose entering hidden states EAGLE-3 fuses when a checkpoint names none: 2, L/2, L-3."""
    clamp = lambda i: min(max(i, 0), num_layers - 1)  # noqa: E731 - tiny models in the tests
    return clamp(2), clamp(num_layers // 2), clamp(num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape. hidden: its width (the target's, whose embedding it reads); target_hidden: the width of
    each fused feature; vocab: the target's vocabulary; aux_layers: None takes `default_aux_layers`."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_positions: int = 32768
    aux_layers: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, written back as they were

    def hf_config(self):
        """A transformers LlamaConfig with this shape (its RoPE, norm and MLP classes build from it)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_positions, vocab_size=self.vocab, num_hidden_layers=1,
                           hidden_act="silu")

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update(architectures=[ARCHITECTURES[0]], model_type="llama", hidden_size=self.hidden,
                   intermediate_size=self.intermediate, num_attention_heads=self.heads,
                   num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_eps,
                   rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                   max_position_embeddings=self.max_positions, vocab_size=self.vocab,
                   draft_vocab_size=self.draft_vocab, target_hidden_size=self.target_hidden, num_hidden_layers=1,
                   hidden_act="silu", tie_word_embeddings=False)
        if self.aux_layers is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        return out

    @classmethod
    def from_json(cls, config: dict) -> "Eagle3Config":
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        nested = config.get("eagle_config") or {}
        aux = config.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))
        known = {"architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size",
                 "num_hidden_layers", "hidden_act", "tie_word_embeddings", "eagle_config",
                 "eagle_aux_hidden_state_layer_ids"}
        return cls(hidden=hidden, intermediate=int(config["intermediate_size"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads), vocab=int(config["vocab_size"]),
                   draft_vocab=int(config.get("draft_vocab_size") or config["vocab_size"]),
                   target_hidden=int(config.get("target_hidden_size") or hidden),
                   rms_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(config.get("rope_theta", 10000.0)),
                   rope_scaling=config.get("rope_scaling"),
                   max_positions=int(config.get("max_position_embeddings") or 32768),
                   aux_layers=None if aux is None else tuple(int(i) for i in aux),
                   extra={k: v for k, v in config.items() if k not in known})


class MidLayer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding), norm(feature)] (2E wide), then an MLP."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hf = config.hf_config()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.input_layernorm = LlamaRMSNorm(config.hidden, config.rms_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden, config.rms_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden, config.rms_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * config.hidden, config.heads * config.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)
        self.mlp = LlamaMLP(hf)

    def qkv(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """embeds, features: (n, E); cos, sin: (n, D) -> q (n, Hq, D), k, v (n, Hkv, D), RoPE applied."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)  # (n, 2E)
        attn = self.self_attn
        q = attn.q_proj(x).view(-1, self.heads, self.head_dim)  # (n, Hq, D)
        k = attn.k_proj(x).view(-1, self.kv_heads, self.head_dim)  # (n, Hkv, D)
        v = attn.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # cos, sin broadcast over the heads (dim 1)
        return q, k, v

    def finish(self, attended: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """attended: (n, Hq D) attention output; features: (n, E) the residual -> (n, E) the layer's output."""
        h = features + self.self_attn.o_proj(attended)  # (n, E)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc, midlayer, norm, lm_head and the draft-to-target vocabulary map (d2t, t2d)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden, config.hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = LlamaRMSNorm(config.hidden, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden, config.draft_vocab, bias=False)
        self.rotary = LlamaRotaryEmbedding(config.hf_config())
        self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))  # draft id -> offset
        self.register_buffer("t2d", torch.zeros(config.vocab, dtype=torch.bool))  # target ids the head covers
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own embedding, if it has one

    def set_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target: (draft_vocab,) long target ids of the draft ids, increasing."""
        ids = draft_to_target.long()
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """(draft_vocab,) long: the target id of each draft id."""
        return torch.arange(self.config.draft_vocab, device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) positions -> cos, sin (n, D)."""
        dummy = torch.zeros(1, device=positions.device)  # gives the rotary module its dtype and device
        cos, sin = self.rotary(dummy, positions[None])
        return cos[0], sin[0]

    def new_kv(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
        """A pass over n new positions is `new_kv`, the caller writing k, v into its cache, then `attend`.
        (n, E) embeddings of the next tokens, (n, E) features, (n,) positions -> q (n, Hq, D), k, v (n, Hkv, D)."""
        cos, sin = self.rope(positions)
        return self.midlayer.qkv(embeds, features, cos, sin)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               features: torch.Tensor) -> torch.Tensor:
        """q: (n, Hq, D); keys, values: (m, Hkv, D); mask: (n, m) bool; features: (n, E) residual -> (n, E)."""
        group = self.config.heads // self.config.kv_heads
        k = keys.transpose(0, 1).repeat_interleave(group, 0)  # (Hq, m, D)
        v = values.transpose(0, 1).repeat_interleave(group, 0)
        out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask[None])  # (Hq, n, D)
        return self.midlayer.finish(out.transpose(0, 1).reshape(q.shape[0], -1), features)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """(n, E) layer outputs -> (n, V) float32 logits over the target's vocabulary (-inf off the draft's)."""
        draft = self.lm_head(self.norm(outputs)).float()  # (n, V_draft)
        out = torch.full((outputs.shape[0], self.config.vocab), float("-inf"))  # (n, V)
        out[:, self.target_ids] = draft
        return out

    def save(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write the SpecForge format: config.json and model.safetensors (weights in `dtype`)."""
        from safetensors.torch import save_file

        from verispec.atomic import atomic_path, atomic_write_json

        folder = Path(folder)
        tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous()
                   for name, t in self.state_dict().items() if not name.startswith("rotary.")}
        with atomic_path(folder / "model.safetensors") as tmp:
            save_file(tensors, str(tmp))
        atomic_write_json(folder / CONFIG, self.config.to_json(), indent=1)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("."))  # not a writer's temp file
    try:
        if files:
            from safetensors.torch import load_file

            tensors = {}
            for f in files:
                tensors.update(load_file(str(f)))
            return tensors
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line
        raise VerispecError(f"{folder}: the head's weights cannot be read ({type(err).__name__}: {str(err)[:120]})") from None
    raise VerispecError(f"{folder}: no EAGLE-3 weights (*.safetensors or pytorch_model.bin)")


def load_eagle3(folder: str | Path, hidden: int, vocab: int, num_layers: int) -> Eagle3Head:
    """Read an EAGLE-3 checkpoint and check it fits a target of this hidden size, vocabulary and depth."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise VerispecError(f"{folder} is not an EAGLE-3 head folder: {CONFIG} is missing")
    try:
        raw = json.loads((folder / CONFIG).read_text())
        config = Eagle3Config.from_json(raw)
    except (ValueError, KeyError, TypeError) as err:
        raise VerispecError(f"{folder / CONFIG}: not an EAGLE-3 config ({type(err).__name__}: {err})") from None
    architectures = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise VerispecError(f"{folder / CONFIG}: architectures {architectures} name no EAGLE-3 head "
                            f"({' or '.join(ARCHITECTURES)})")
    tensors = _read_tensors(folder)
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    for name in ("fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"):
        if name not in tensors:
            raise VerispecError(f"{folder}: tensor '{name}' is missing")
    fused = tensors["fc.weight"].shape[1]
    if fused % 3 or fused // 3 != hidden:
        raise VerispecError(f"{folder}: the head fuses three features of width {fused / 3:g}; this target's hidden "
                            f"states are {hidden} wide")
    config = Eagle3Config(**{**config.__dict__, "target_hidden": fused // 3})
    if config.vocab != vocab:
        raise VerispecError(f"{folder}: the head was made for a vocabulary of {config.vocab} tokens; this target has {vocab}")
    aux = config.aux_layers if config.aux_layers is not None else default_aux_layers(num_layers)
    if len(aux) != 3 or any(not 0 <= i < num_layers for i in aux):
        raise VerispecError(f"{folder}: the head reads the target's layers {list(aux)}; this target has "
                            f"{num_layers} (0..{num_layers - 1})")
    config = Eagle3Config(**{**config.__dict__, "aux_layers": tuple(aux)})
    d2t = tensors.get("d2t")
    if d2t is None:
        raise VerispecError(f"{folder}: tensor 'd2t' (draft id -> target id) is missing; without it the head's "
                            "tokens cannot be placed in the target's vocabulary")
    if d2t.numel() != config.draft_vocab:
        raise VerispecError(f"{folder}: d2t has {d2t.numel()} entries for a draft vocabulary of {config.draft_vocab}")
    if config.draft_vocab < vocab and not bool(d2t.any()):
        raise VerispecError(f"{folder}: d2t is all zeros for a reduced draft vocabulary ({config.draft_vocab} of "
                            f"{vocab} tokens): the map was not saved, and every draft would be the wrong token")
    target_ids = torch.arange(config.draft_vocab) + d2t.long()
    if bool((target_ids < 0).any() | (target_ids >= vocab).any()) or target_ids.unique().numel() != target_ids.numel():
        raise VerispecError(f"{folder}: d2t maps draft ids outside the target's vocabulary or onto one id twice")
    head = Eagle3Head(config)
    wanted = {name for name in head.state_dict() if not name.startswith("rotary.")} - {"t2d"}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise VerispecError(f"{folder}: tensor '{missing[0]}' is missing ({len(missing)} in all)")
    for name in wanted:
        expected = head.state_dict()[name].shape
        if tuple(tensors[name].shape) != tuple(expected):
            raise VerispecError(f"{folder}: tensor '{name}' has shape {tuple(tensors[name].shape)}, the config "
                                f"says {tuple(expected)}")
    head.load_state_dict({name: tensors[name].float() if tensors[name].is_floating_point() else tensors[name]
                          for name in wanted}, strict=False)
    head.set_vocabulary(target_ids)
    embed = tensors.get("embed_tokens.weight")
    if embed is not None:
        if tuple(embed.shape) != (vocab, config.hidden):
            raise VerispecError(f"{folder}: embed_tokens.weight has shape {tuple(embed.shape)}, not ({vocab}, {config.hidden})")
        head.embed_tokens = nn.Embedding.from_pretrained(embed.float())
    elif config.hidden != hidden:
        raise VerispecError(f"{folder}: the head is {config.hidden} wide and has no embedding of its own; this "
                            f"target's embedding is {hidden} wide")
    return head.eval()
