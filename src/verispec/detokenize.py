"""The text of a growing list of tokens, decoded a few tokens at a time.

Decoding the whole answer after every step costs time proportional to its length, so a long answer costs its
length squared; stop strings and streaming both need the text after every step. `IncrementalText` decodes only
a short window: the tokens since the last point where the text was known to be complete, together with the
tokens before that point which are needed to decode them the same way (a tokenizer may strip a word's leading
space at the start of a decode, or need a previous byte to complete a character). Text is appended only once
its window decodes to more than the window's prefix did and does not end in an incomplete UTF-8 character
("\ufffd"), so `text` is always a prefix of the whole list's decode, and equals it after `finish`.

This is the scheme of Hugging Face's text streamers and vLLM's detokenizer; `tests/test_detokenize.py` checks it
against the full decode on the tokenizers the project ships and tests with.
"""

from __future__ import annotations

from collections.abc import Callable

INCOMPLETE = "\ufffd"  # what a decode ends in while a multi-byte character still waits for its last bytes


class IncrementalText:
    """Text of a token list that only grows (`update` it after each append).

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped as everywhere else).
    Attributes:
        text: the decoded text so far: a prefix of decode(tokens), complete after `finish`.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.text = ""
        self._prefix = 0  # the decode window starts at this token
        self._read = 0  # tokens whose text is in `text`
        self._prefix_text = ""  # decode(tokens[_prefix:_read]), cached

    def update(self, tokens: list[int]) -> str:
        """Decode what `tokens` (the whole list; earlier entries unchanged) added; returns the new text."""
        if len(tokens) <= self._read:
            return ""
        window = self.decode(tokens[self._prefix :])
        if window.startswith(self._prefix_text):
            new = window[len(self._prefix_text) :]
        else:  # the window decodes its prefix otherwise than alone (rare): decode everything once
            whole = self.decode(tokens)
            new = whole[len(self.text) :] if whole.startswith(self.text) else ""
        if not new or new.endswith(INCOMPLETE):
            return ""  # nothing complete yet: wait for more tokens
        self.text += new
        self._prefix, self._read = self._read, len(tokens)
        self._prefix_text = self.decode(tokens[self._prefix : self._read])
        return new

    def finish(self, tokens: list[int]) -> str:
        """The list is complete: `text` becomes decode(tokens) (an incomplete character decodes as it is);
        returns what was added."""
        whole = self.decode(tokens)
        new = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text = whole
        self._prefix = self._read = len(tokens)
        self._prefix_text = ""
        return new
