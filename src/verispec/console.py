"""Messages to the user on stderr (never mixed into --json output on stdout)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

from rich.console import Console


@lru_cache(maxsize=1)
def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True, highlight=False)


def notice(message: str) -> None:
    """Print a rich-markup message on stderr without wrapping it (paths stay greppable)."""
    stderr_console().print(message)


@contextmanager
def progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A transient progress bar on stderr for long work; yields `advance(n=1)` (n steps done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console(), disable=not enabled, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
