"""A tiny Hugging Face model directory (character tokenizer + random weights), as a user would have."""

from __future__ import annotations

import string
from pathlib import Path

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
