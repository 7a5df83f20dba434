"""Per-step traces of verification: what `verispec generate --trace`, `verispec replay` and the
live view of `verispec viz` show.

A `Tracer` set as `engine.tracer` sees every verification: the target's p, the drafts with their q,
the uniforms u_i and the Verdict. It only reads them; the engine's arithmetic and its generator
draws are the same with or without it (tests/test_trace.py checks the tokens). Each step becomes a
JSON-able record:

    drafts      per draft token x_i: p_i(x_i), q_i(x_i), the acceptance probability min(1, p/q),
                the uniform u_i (None at temperature 0, where x_i is accepted iff it is argmax p_i)
                and the verdict: "accepted", "rejected" or "discarded" (after the first rejection)
    token       the recovered token (bonus False) or the bonus token (bonus True)
    positions   per position 0..n: sum_x min(p, q) (the chance the draft there is accepted) and the
                top candidates with p, q, overlap min(p, q), draft excess max(0, q - p) and the
                residual normalize(max(0, p - q)) a rejection samples from (None at the bonus position)
    committed   tokens the step appended to the output, counters, and the coloured text pieces
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.rejection import Verdict, acceptance_probability, residual_distribution

TRACE_FORMAT = "verispec-trace"
TRACE_VERSION = 1


def _r(x: float) -> float:
    return round(float(x), 6)


def one_hot_q(draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """q of a deterministic drafter: (n,) -> (n, V), one-hot at each draft token."""
    return torch.nn.functional.one_hot(draft_tokens, vocab).float()


def verification_record(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor | None, verdict: Verdict,
                        uniforms: torch.Tensor | None, top: int = 8) -> dict:
    """One step's verification as a JSON-able dict (fields in the module docstring).

    Args:
        p: (n + 1, V) target probabilities (one-hot at the argmax at temperature 0).
        draft_tokens: (n,) draft tokens.
        q: (n, V) draft probabilities, or None for a one-hot drafter (or a greedy step).
        verdict: the step's Verdict.
        uniforms: (n,) the uniforms drawn by `rejection.verify`, or None at temperature 0.
        top: candidates listed per position from each of p, q and the residual. Default 8.
    """
    n = draft_tokens.numel()
    q = one_hot_q(draft_tokens, p.shape[-1]) if q is None else q  # (n, V)
    idx = torch.arange(n)
    p_x, q_x = p[idx, draft_tokens], q[idx, draft_tokens]  # (n,), (n,)
    accept = acceptance_probability(p_x, q_x)  # (n,)
    drafts = []
    for i in range(n):
        verdict_i = "accepted" if i < verdict.num_accepted else ("rejected" if i == verdict.num_accepted else "discarded")
        drafts.append({"token": int(draft_tokens[i]), "p": _r(p_x[i]), "q": _r(q_x[i]),
                       "accept_probability": _r(accept[i]),
                       "uniform": None if uniforms is None else _r(uniforms[i]), "verdict": verdict_i})
    positions = []
    for i in range(n + 1):
        p_i = p[i]  # (V,)
        q_i = q[i] if i < n else torch.zeros_like(p_i)  # (V,) nothing is drafted at the bonus position
        residual = residual_distribution(p_i, q_i) if i < n else None  # (V,)
        picks = {int(t) for t in torch.topk(p_i, min(top, p_i.numel())).indices if p_i[t] > 0}
        picks |= {int(t) for t in torch.topk(q_i, min(top, q_i.numel())).indices if q_i[t] > 0}
        if residual is not None:
            picks |= {int(t) for t in torch.topk(residual, min(top, residual.numel())).indices if residual[t] > 0}
            picks.add(int(draft_tokens[i]))
        if i == verdict.num_accepted:
            picks.add(verdict.token)
        candidates = [{"token": t, "p": _r(p_i[t]), "q": _r(q_i[t]), "overlap": _r(min(p_i[t], q_i[t])),
                       "draft_excess": _r(max(0.0, q_i[t] - p_i[t])),
                       "residual": None if residual is None else _r(residual[t])}
                      for t in sorted(picks, key=lambda t: (-float(p_i[t]), -float(q_i[t]), t))]
        positions.append({"acceptance_mass": _r(torch.minimum(p_i, q_i).sum()) if i < n else None,
                          "candidates": candidates})
    return {"drafts": drafts, "num_accepted": verdict.num_accepted, "token": verdict.token, "bonus": verdict.bonus,
            "positions": positions}


class Tracer:
    """Collects verification records from the engine (as `engine.tracer`) and completes them per step.

    Args:
        top: candidates per position (see `verification_record`). Default 8.
        token_text: token id -> its text, added to every token in a record (None: ids only).
    """

    def __init__(self, top: int = 8, token_text: Callable[[int], str] | None = None) -> None:
        self.top = top
        self.token_text = token_text
        self._pending: dict[int, dict] = {}

    def __call__(self, seq, draft, p: torch.Tensor, verdict: Verdict, uniforms: torch.Tensor | None) -> None:
        self._pending[seq.index] = verification_record(p, draft.tokens, draft.q, verdict, uniforms, self.top)

    def step(self, event, seq, pieces: list[tuple[str, str]] | None = None) -> dict:
        """The full record of the step that produced `event` for `seq` (a StepEvent and its Sequence)."""
        record = self._pending.pop(event.sequence)
        s = seq.stats
        record.update(step=s.target_forward_passes, committed=list(event.committed), finish_reason=event.finish_reason,
                      counters={"target_calls": s.target_forward_passes, "new_tokens": s.new_tokens,
                                "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                                "acceptance_rate": _r(s.acceptance_rate),
                                "tokens_per_target_call": _r(s.tokens_per_target_pass)})
        if pieces is not None:
            record["pieces"] = [[text, kind] for text, kind in pieces]
        if self.token_text is not None:
            text = self.token_text
            record["token_text"] = text(record["token"])
            for d in record["drafts"]:
                d["text"] = text(d["token"])
            for pos in record["positions"]:
                for c in pos["candidates"]:
                    c["text"] = text(c["token"])
        return record


@contextmanager
def tracing(engine, tracer: Tracer) -> Iterator[Tracer]:
    """Set `tracer` on `engine` while the block runs (iterate the engine's stream inside it)."""
    engine.tracer = tracer
    try:
        yield tracer
    finally:
        engine.tracer = None


def trace_document(steps: list[dict], result: dict, prompt: str, sampling: dict, spec: dict) -> dict:
    """The JSON file of `verispec generate --trace`: settings, every step record, and the --json result."""
    return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "prompt": prompt, "target": result["target"],
            "draft": result["draft"], "sampling": sampling, "spec": spec, "steps": steps, "result": result}


def save_trace(path: str | Path, document: dict) -> None:
    try:
        Path(path).write_text(json.dumps(document))
    except OSError as err:
        raise VerispecError(f"cannot write trace {path}: {err.strerror}") from None


def load_trace(path: str | Path) -> dict:
    """Read a trace written by `verispec generate --trace`; a file that is not one is refused by name."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as err:
        raise VerispecError(f"cannot read trace {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise VerispecError(f"{path} is not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(document, dict) or document.get("format") != TRACE_FORMAT:
        raise VerispecError(f"{path} is not a verispec trace (written by `verispec generate --trace`)")
    if document.get("version") != TRACE_VERSION:
        raise VerispecError(f"{path} is trace version {document.get('version')}; this verispec reads version {TRACE_VERSION}")
    return document
