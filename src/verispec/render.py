"""Terminal output: streamed text coloured by how each token was produced, and a stats table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from verispec.api import GenerationResult
from verispec.stats import GenerationStats

STYLES = {"accepted": "green", "forced": "magenta", "recovered": "yellow", "bonus": "cyan", "plain": ""}


class StreamPrinter:
    """Prints a sequence's new text as steps commit it, accepted drafts in one colour and the
    recovered / bonus token in others. Text is decoded from all tokens so far, so multi-byte
    characters split across tokens print correctly. `console` None only computes the pieces
    (for a trace without terminal output)."""

    def __init__(self, console: Console | None, decode, plain_decoding: bool) -> None:
        self.console = console
        self.decode = decode
        self.plain = plain_decoding
        self.printed = 0

    def pieces(self, generated: list[int], accepted_committed: int, last_is_bonus: bool, total_committed: int,
               text_end: int | None, forced: bool = False) -> list[tuple[str, str]]:
        """This step's new text as (text, kind) pieces, kind in STYLES; advances what counts as printed.
        `forced`: the accepted drafts were tokens a structured-output constraint forced."""
        start = len(generated) - total_committed
        cut = (lambda t: t[:text_end]) if text_end is not None else (lambda t: t)
        kind = "plain" if self.plain else ("bonus" if last_is_bonus else "recovered")
        out = []
        for text, style in ((cut(self.decode(generated[: start + accepted_committed])), "forced" if forced else "accepted"),
                            (cut(self.decode(generated)), kind)):
            if len(text) > self.printed:
                out.append((text[self.printed :], style))
                self.printed = len(text)
        return out

    def step(self, generated: list[int], accepted_committed: int, last_is_bonus: bool, total_committed: int,
             text_end: int | None, forced: bool = False) -> list[tuple[str, str]]:
        """Print this step's new text; returns the pieces printed."""
        pieces = self.pieces(generated, accepted_committed, last_is_bonus, total_committed, text_end, forced)
        if self.console is not None:
            print_pieces(self.console, pieces)
        return pieces


def print_pieces(console: Console, pieces) -> None:
    """Print (text, kind) pieces in the colours of STYLES."""
    for text, kind in pieces:
        console.print(Text(text, style=STYLES[kind]), end="", soft_wrap=True)


def legend(plain: bool, constrained: bool = False) -> Text:
    if plain:
        return Text("plain target decoding (no drafter)", style="dim")
    text = Text("tokens: ", style="dim")
    for kind in ("accepted", *(("forced",) if constrained else ()), "recovered", "bonus"):
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
        ("mean accepted length", f"{s.mean_accepted_length:.2f} per target pass"),
        ("draft tokens / accepted", f"{s.draft_tokens} / {s.accepted_tokens}"),
        ("acceptance rate", f"{s.acceptance_rate:.1%}"),
        ("accepted per position", " ".join(f"{a}/{d}" for a, d in zip(s.accepted_per_position, s.drafted_per_position)) or "-"),
        ("recovered / bonus tokens", f"{s.recovered_tokens} / {s.bonus_tokens}"),
        *((("forced tokens (free drafts)", str(s.forced_tokens)),) if s.forced_tokens else ()),
        *((("prediction tokens accepted / rejected",
            f"{s.accepted_prediction_tokens} / {s.rejected_prediction_tokens}"),)
          if s.accepted_prediction_tokens or s.rejected_prediction_tokens else ()),
        ("wall time", f"{s.wall_seconds:.2f} s (draft {s.draft_seconds:.2f} s, target {s.target_seconds:.2f} s)"),
        ("speed", f"{s.tokens_per_second:.2f} tokens/s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def result_from_dict(d: dict) -> GenerationResult:
    """A GenerationResult back from its `to_dict()` (as saved in a trace)."""
    fields = GenerationStats.__dataclass_fields__
    stats = GenerationStats(**{k: v for k, v in d["stats"].items() if k in fields})
    return GenerationResult(text=d["text"], prompt_token_ids=d["prompt_token_ids"], token_ids=d["token_ids"],
                            finish_reason=d["finish_reason"], stats=stats, dtype=d["dtype"], target=d["target"],
                            draft=d["draft"], target_weights=d.get("target_weights", "dense"),
                            draft_weights=d.get("draft_weights"))


MARKS = {"accepted": ("green", "ok"), "rejected": ("red", "REJECTED"), "discarded": ("dim", "discarded"),
         "not tried": ("dim", "not tried")}


def step_details(step: dict) -> Text:
    """One trace step as a line: each draft token with p, q, min(1, p/q), u and its verdict, then the
    recovered or bonus token, coloured as in the stream. A tree step: see `tree_step_details`."""
    if "tree" in step:
        return tree_step_details(step)
    marks = MARKS
    line = Text(f"\nstep {step['step']}: ", style="bold")
    for d in step["drafts"]:
        style, word = marks[d["verdict"]]
        u = "-" if d["uniform"] is None else f"{d['uniform']:.3f}"
        line.append(f"{d.get('text', d['token'])!r}", style=style)
        line.append(f" p={d['p']:.3f} q={d['q']:.3f} min(1,p/q)={d['accept_probability']:.3f} u={u} {word}; ", style="dim")
    kind = "bonus" if step["bonus"] else "recovered"
    line.append(f"{kind} {step.get('token_text', step['token'])!r}", style=STYLES[kind])
    return line


def tree_summary(tree: dict, num_draft_tokens: int | None) -> Text:
    """The tree a trace speculated with (its spec's `tree`, a TreeConfig as a dict), as a dim line."""
    if tree.get("shape"):
        what = f"static tree, shape {','.join(map(str, tree['shape']))}"
    else:
        what = f"dynamic tree, {tree['budget']} nodes, depth K = {num_draft_tokens}, top-k {tree['top_k']}"
    return Text(f"tree speculation: {what}; green text is each step's accepted path", style="dim")


def tree_step_details(step: dict) -> Text:
    """One tree step: its size and depth, the accepted path, then each tried node in the order the walk
    tried it (depth, parent, p and q of the pair it was checked against, min(1, p/q), u, verdict),
    then the recovered or bonus token."""
    tree = step["tree"]
    nodes = tree["nodes"]
    name = lambda n: repr(n.get("text", n["token"]))  # noqa: E731
    text = Text(f"\nstep {step['step']}: ", style="bold")
    text.append(f"tree of {tree['size']} nodes, depth {tree['depth']}, {tree['siblings']} children; ", style="dim")
    text.append("accepted path: ")
    if tree["path"]:
        for k, i in enumerate(tree["path"]):
            text.append((" -> " if k else "") + name(nodes[i]), style="green")
    else:
        text.append("(none)", style="dim")
    kind = "bonus" if step["bonus"] else "recovered"
    text.append(f", then {kind} {step.get('token_text', step['token'])!r}", style=STYLES[kind])
    tried = sorted((n for n in nodes if n["try"] is not None), key=lambda n: n["try"])
    for n in tried:
        style, word = MARKS[n["verdict"]]
        parent = "root" if n["parent"] < 0 else f"node {n['parent']}"
        u = "-" if n["uniform"] is None else f"{n['uniform']:.3f}"
        text.append(f"\n  node {n['node']} (depth {n['depth']}, after {parent}) ", style="dim")
        text.append(name(n), style=style)
        text.append(f" p={n['p']:.3f} q={n['q']:.3f} min(1,p/q)={n['accept_probability']:.3f} u={u} {word}", style="dim")
    untried = len(nodes) - len(tried)
    if untried:
        text.append(f"\n  {untried} node(s) not tried (below a rejected node, or after an accepted sibling)", style="dim")
    text.append("\n")
    return text
