"""A tiny Hugging Face model directory (character tokenizer + random weights), as a user would have."""

from __future__ import annotations

import string
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model

SPECIALS = ["<unk>", "<s>", "</s>"]
CHARS = list(string.ascii_lowercase + " .,:?!\n'") + list("0123456789")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def char_tokenizer(chat: bool = True, chars: list[str] | None = None) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + (chars or CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0, chat: bool = True, sharpness: float = 30.0,
                        vocab_chars: list[str] | None = None) -> Path:
    tokenizer = char_tokenizer(chat, vocab_chars)
    vocab = len(tokenizer)
    model = tiny_model(arch, vocab=vocab, seed=seed, sharpness=sharpness)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


HEAD_SCALE = 30.0 * torch.randn(32, generator=torch.Generator().manual_seed(0)).sign()  # (H,): sharpness, random signs


def tiny_dir_with_head_from_embedding(path: Path) -> Path:
    """A tiny model directory whose output head is its input embedding times a diagonal (HEAD_SCALE, untied), so
    that a draft with tied embeddings (a distilled draft's) computes the same logits with its final norm's weight
    times that diagonal. (A head of the embedding times the sharpness alone would make the target repeat its last
    token: each token's embedding is most like itself; the random signs undo that.)"""
    save_tiny_model_dir(path, "llama", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * HEAD_SCALE)  # (V, H)
    model.save_pretrained(str(path))
    return path


def distilled_copy_of(target: Path, vocab):
    """(TinyDraftConfig, model): a distilled draft (a Qwen2 with tied embeddings) of the tiny target's shape holding
    the target's weights (`tiny_dir_with_head_from_embedding`): the same transformer, the embeddings of the tokens in
    `vocab` (a VocabMap), the head's diagonal in the final norm and zero attention biases, so that its greedy guesses
    are mostly accepted (they differ where the target writes a token outside `vocab`, and where float16 or int8
    weights break a near-tie)."""
    from verispec.models.distilled import TinyDraftConfig

    shape = TinyDraftConfig(draft_vocab_size=vocab.draft_vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, rope_theta=10000.0, max_positions=128)  # conftest.tiny_model's
    weights = transformers.AutoModelForCausalLM.from_pretrained(str(target)).state_dict()
    draft = shape.build()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name == "model.embed_tokens.weight":
                p[:-1] = weights[name][vocab.to_target]  # (Vd, H): draft id -> target id
                p[-1] = weights[name][0]  # OTHER: the target's <unk>, which it never writes
            elif name == "model.norm.weight":
                p.copy_(weights[name] * HEAD_SCALE)
            elif name.endswith(".bias"):
                p.zero_()  # Qwen2's q, k, v biases; Llama has none
            else:
                p.copy_(weights[name])
    return shape, draft.eval()
