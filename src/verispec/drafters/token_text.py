"""Tokens as text: the bytes each id of a tokenizer stands for, and what two tokenizers share.

A draft with another tokenizer than the target's (`verispec.drafters.cross_tokenizer`) meets the target only in
text. `TokenText` gives each id of one tokenizer its bytes, read from the tokenizer's vocabulary the way its decoder
reads it: byte-level BPE (GPT-2, Qwen, SmolLM: each character of a token stands for one byte), SentencePiece with
byte fallback (Llama 2, Gemma: '▁' is a space, '<0x0A>' one byte) or plain strings. Added tokens (`<|im_end|>`,
`<end_of_turn>`) stand for their content, so a special token of one tokenizer is the other's where both have it
and plain text where only one does. Bytes, not str: a byte-level token can hold half of a UTF-8 character.

`VocabBridge` is the pair: the ids whose bytes both vocabularies hold (the token-level intersection), how much each
shares, and the round-trip check that a tokenizer gives back the text it read (normalisers that lowercase, strip or
add a leading space would make a draft's text and the target's differ where they should not).
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from verispec.errors import VerispecError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Character -> byte of byte-level BPE: the inverse of GPT-2's table, as transformers builds it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _decoder_kind(tokenizer) -> str:
    """'byte-level', 'sentencepiece' or 'plain', from the tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = repr(getattr(backend, "decoder", None))
    if "ByteLevel" in described:
        return "byte-level"
    if "ByteFallback" in described or "▁" in described or "Metaspace" in described:
        return "sentencepiece"
    return "plain"


class TokenText:
    """One tokenizer's ids as bytes.

    Args:
        tokenizer: a Hugging Face fast tokenizer.
        vocab_size: the model's logits width (a model may have more rows than its tokenizer has tokens: those ids
            have no text and are never drafted).
        name: for messages.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, name: str = "tokenizer") -> None:
        self.tokenizer, self.name = tokenizer, name
        self.kind = _decoder_kind(tokenizer)
        size = vocab_size or len(tokenizer)
        added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        strings = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
        self.pieces: list[bytes] = [b""] * size  # per id: the bytes it stands for (b"": none, never drafted)
        self.added: set[int] = set(added)  # ids of added tokens (their content is their text)
        for i, s in enumerate(strings):
            if i in added:
                self.pieces[i] = added[i].encode()
            elif s is not None:
                self.pieces[i] = self._bytes(s)
        self.usable = torch.tensor([bool(p) for p in self.pieces])  # (V,) ids with text
        # ids the tokenizer puts before a text of its own (a BOS): the draft reads them before the prompt
        with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
        bare = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.prefix: list[int] = with_specials[: len(with_specials) - len(bare)] \
            if with_specials[len(with_specials) - len(bare):] == bare else []

    def _bytes(self, token: str) -> bytes:
        if self.kind == "byte-level":
            table = _byte_level_table()
            try:
                return bytes(table[c] for c in token)
            except KeyError:  # not a byte-level piece (a token added without the byte mapping)
                return token.encode()
        if self.kind == "sentencepiece":
            byte = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode()
        return token.encode()

    def bytes_of(self, ids) -> bytes:
        return b"".join(self.pieces[i] if 0 <= i < len(self.pieces) else b"" for i in ids)

    def encode(self, text: bytes) -> list[int]:
        """The tokenizer's ids of `text` (no BOS / EOS added); bytes that are not UTF-8 are read as U+FFFD."""
        string = text.decode("utf-8", errors="replace")
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(string, add_special_tokens=False).ids
        return self.tokenizer(string, add_special_tokens=False)["input_ids"]

    def check_round_trip(self, text: bytes) -> None:
        """Raise where encoding `text` and reading the ids' bytes does not give `text` back."""
        back = self.bytes_of(self.encode(text))
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            raise VerispecError(
                f"the {self.name} tokenizer cannot round-trip text (a {self.kind} tokenizer): "
                f"{text[max(0, at - 12):at + 12].decode(errors='replace')!r} comes back as "
                f"{back[max(0, at - 12):at + 12].decode(errors='replace')!r}; a draft with another tokenizer needs "
                "both to give back the text they read")


class VocabBridge:
    """What a draft's vocabulary shares with the target's: ids with the same bytes in both.

    draft_to_target: (Vd,) long, the target id of each draft id whose bytes are a target token (-1: none).
    shared_draft / shared_target: (S,) long, the shared pairs (each byte string once: its lowest ids).
    """

    def __init__(self, target: TokenText, draft: TokenText) -> None:
        self.target, self.draft = target, draft
        by_bytes: dict[bytes, int] = {}
        for i, piece in enumerate(target.pieces):
            if piece and piece not in by_bytes:
                by_bytes[piece] = i
        self.draft_to_target = torch.full((len(draft.pieces),), -1, dtype=torch.long)
        seen: set[bytes] = set()
        for j, piece in enumerate(draft.pieces):
            if piece and piece in by_bytes and piece not in seen:
                seen.add(piece)
                self.draft_to_target[j] = by_bytes[piece]
        self.shared_draft = torch.nonzero(self.draft_to_target >= 0).flatten()  # (S,)
        self.shared_target = self.draft_to_target[self.shared_draft]  # (S,)

    def shares(self) -> tuple[int, float, float]:
        """(shared tokens, their share of the draft's tokens with text, of the target's)."""
        shared = int(self.shared_draft.numel())
        return (shared, shared / max(1, int(self.draft.usable.sum())), shared / max(1, int(self.target.usable.sum())))

    def text_share(self, text: bytes) -> float:
        """Of the target's tokens of `text`, the share whose bytes are a draft token too."""
        ids = self.target.encode(text)
        shared = set(self.shared_target.tolist())
        return sum(1 for i in ids if i in shared) / max(1, len(ids))

    def sample_text(self, count: int = 400) -> bytes:
        """Text the target can write: `count` of its tokens spread over its vocabulary (UTF-8, no added tokens),
        joined by spaces. It checks that both tokenizers round-trip what the target says."""
        ids = [i for i in range(len(self.target.pieces)) if self.target.pieces[i] and i not in self.target.added]
        step = max(1, len(ids) // count)
        words = []
        for i in ids[::step]:
            piece = self.target.pieces[i]
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if self.target.bytes_of(self.target.encode(piece)) == piece:  # the target writes it as it reads it
                words.append(piece)
        return b" ".join(words)
