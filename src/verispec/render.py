"""Terminal output: streamed text coloured by how each token was produced, and a stats table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from verispec.api import GenerationResult

STYLES = {"accepted": "green", "recovered": "yellow", "bonus": "cyan", "plain": ""}


class StreamPrinter:
    """Prints a sequence's new text as steps commit it, accepted drafts in one colour and the
    recovered / bonus token in others. Text is decoded from all tokens so far, so multi-byte
    characters split across tokens print correctly."""

    def __init__(self, console: Console, decode, plain_decoding: bool) -> None:
        self.console = console
        self.decode = decode
        self.plain = plain_decoding
        self.printed = 0

    def _emit(self, text: str, style: str) -> None:
        if len(text) > self.printed:
            self.console.print(Text(text[self.printed :], style=style), end="", soft_wrap=True)
            self.printed = len(text)

    def step(self, generated: list[int], accepted_committed: int, last_is_bonus: bool, total_committed: int, text_end: int | None) -> None:
        start = len(generated) - total_committed
        cut = (lambda t: t[:text_end]) if text_end is not None else (lambda t: t)
        self._emit(cut(self.decode(generated[: start + accepted_committed])), STYLES["accepted"])
        kind = "plain" if self.plain else ("bonus" if last_is_bonus else "recovered")
        self._emit(cut(self.decode(generated)), STYLES[kind])


def legend(plain: bool) -> Text:
    if plain:
        return Text("plain target decoding (no drafter)", style="dim")
    text = Text("tokens: ", style="dim")
    for kind in ("accepted", "recovered", "bonus"):
        text.append(kind, style=STYLES[kind])
        text.append(" ")
    return text


def stats_table(result: GenerationResult) -> Table:
    s = result.stats
    table = Table(title="verispec", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("target / draft", f"{result.target} / {result.draft}"),
        ("dtype", result.dtype),
        ("new tokens", str(s.new_tokens)),
        ("finish reason", result.finish_reason),
        ("target forward passes", str(s.target_forward_passes)),
        ("tokens per target pass", f"{s.tokens_per_target_pass:.2f}"),
        ("draft tokens / accepted", f"{s.draft_tokens} / {s.accepted_tokens}"),
        ("acceptance rate", f"{s.acceptance_rate:.1%}"),
        ("accepted per position", " ".join(f"{a}/{d}" for a, d in zip(s.accepted_per_position, s.drafted_per_position)) or "-"),
        ("recovered / bonus tokens", f"{s.recovered_tokens} / {s.bonus_tokens}"),
        ("wall time", f"{s.wall_seconds:.2f} s (draft {s.draft_seconds:.2f} s, target {s.target_seconds:.2f} s)"),
        ("speed", f"{s.tokens_per_second:.2f} tokens/s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
