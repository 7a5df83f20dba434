"""Messages to the user on stderr (never mixed into --json output on stdout)."""

from __future__ import annotations

from functools import lru_cache

from rich.console import Console


@lru_cache(maxsize=1)
def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True, highlight=False)


def notice(message: str) -> None:
    """Print a rich-markup message on stderr without wrapping it (paths stay greppable)."""
    stderr_console().print(message)
