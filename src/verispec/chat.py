"""Chat templating in one place: messages -> the token ids the target reads (its own template, the assistant's turn
opened). The API, the server and the distillation pipeline all encode chats through here."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def user_turn(prompt: str) -> list[dict]:
    """One user message."""
    return [{"role": "user", "content": prompt}]


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """`messages` ([{"role", "content"}, ...]) under the tokenizer's chat template, ending where the assistant's
    answer begins (the template's own checks, such as role order, raise its own errors); `tools` (OpenAI's
    [{"type": "function", "function": {...}}]) rendered by the template where given."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def chat_text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a templated chat: the template's text already holds its special tokens, so none are added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the chat template (`chat_text`, then `chat_text_ids`)."""
    return chat_text_ids(tokenizer, chat_text(tokenizer, messages))
