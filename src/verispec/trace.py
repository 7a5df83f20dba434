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

A step of tree speculation (a spec with a tree) has the same fields plus `tree` (see `tree_verification_record`):
every node (token, parent, depth), and per tried node p(x) and q(x) of the pair it was checked against
(the target at its parent, or the residual left by the siblings rejected before it), min(1, p/q), the
uniform u[node] that `verify` drew, and its verdict: "accepted", "rejected" or "not tried". There
`drafts` and `positions` read the accepted path as a chain: its nodes, then the position the last token
was drawn at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from verispec.atomic import atomic_write_json
from verispec.errors import VerispecError
from verispec.rejection import TreeTry, Verdict, acceptance_probability, residual_distribution, walk_tree
from verispec.tree import Draft

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
        q_i = q[i] if i < n else None  # (V,) nothing is drafted at the bonus position
        marked = [int(draft_tokens[i])] if i < n else []
        if i == verdict.num_accepted:
            marked.append(verdict.token)
        positions.append(_position(p_i, q_i, marked, top))
    return {"drafts": drafts, "num_accepted": verdict.num_accepted, "token": verdict.token, "bonus": verdict.bonus,
            "positions": positions}


def _position(p_i: torch.Tensor, q_i: torch.Tensor | None, marked: list[int], top: int) -> dict:
    """One position of a record: sum min(p, q) and the top candidates of p, q and the residual.

    p_i: (V,) the target (or the residual it is checked against); q_i: (V,) the draft, or None where
    nothing is drafted (a bonus position: q = 0, no residual). marked: tokens listed in any case.
    """
    residual = residual_distribution(p_i, q_i) if q_i is not None else None  # (V,)
    q_i = torch.zeros_like(p_i) if q_i is None else q_i  # (V,)
    picks = {int(t) for t in torch.topk(p_i, min(top, p_i.numel())).indices if p_i[t] > 0}
    picks |= {int(t) for t in torch.topk(q_i, min(top, q_i.numel())).indices if q_i[t] > 0}
    if residual is not None:
        picks |= {int(t) for t in torch.topk(residual, min(top, residual.numel())).indices if residual[t] > 0}
    picks |= set(marked)
    candidates = [{"token": t, "p": _r(p_i[t]), "q": _r(q_i[t]), "overlap": _r(min(p_i[t], q_i[t])),
                   "draft_excess": _r(max(0.0, q_i[t] - p_i[t])),
                   "residual": None if residual is None else _r(residual[t])}
                  for t in sorted(picks, key=lambda t: (-float(p_i[t]), -float(q_i[t]), t))]
    return {"acceptance_mass": _r(torch.minimum(p_i, q_i).sum()) if residual is not None else None,
            "candidates": candidates}


def tree_verification_record(p, draft: Draft, verdict: Verdict, uniforms: torch.Tensor | None,
                             top: int = 8) -> dict:
    """One tree step's verification as a JSON-able dict: the chain fields plus `tree`.

    The walk is re-run with `rejection.walk_tree` from the uniforms `verify` drew (no draws), which
    gives each tried node's pair (p, q); it must reach the verdict's path (checked).

    Args:
        p: p[i] -> (V,) target probabilities at the root (i = 0) and after node i - 1 (N + 1 rows;
            one-hot at the argmax at temperature 0).
        draft: the step's Draft (a tree).
        verdict: the step's Verdict.
        uniforms: (N,) the uniforms drawn by `verify`, or None at temperature 0 (greedy: a child
            is accepted iff it is the argmax; walked here with one-hot p and q).
        top: candidates listed per position from each of p, q and the residual. Default 8.
    Returns:
        {"drafts", "num_accepted", "token", "bonus", "positions"} (the accepted path read as a chain,
        see the module docstring) and "tree": {"siblings", "size", "depth", "path", "nodes", "final"}:
        nodes[i] = {"node", "token", "parent" (-1: the root), "depth", "verdict", "try" (order in the
        walk, None if not tried), "p", "q", "accept_probability", "uniform" (the exact float u[i]; None
        if not tried or greedy), "position" (as in `positions`, for the pair it was tried against;
        None if not tried)}; final = {"node" (the path's end, -1: the root), "drawn_from" ("residual"
        or "target"), "position"}.
    """
    tree, tokens = draft.tree, draft.tokens
    greedy = uniforms is None
    u = torch.zeros(tree.size) if greedy else uniforms  # (N,) greedy: accept iff p(x) > 0, p one-hot
    tries: list[TreeTry] = []
    if greedy:
        path, final, leaf = walk_tree(p, tree, tokens, None, "deterministic", u, tries)
    else:
        path, final, leaf = walk_tree(p, tree, tokens, draft.q, draft.siblings, u, tries)
    if path != verdict.path or leaf != verdict.bonus:
        raise VerispecError(f"tracing: the walk from the recorded uniforms gives path {path}, the verdict {verdict.path}")
    nodes = [{"node": i, "token": int(tokens[i]), "parent": int(tree.parents[i]), "depth": int(tree.depths[i]),
              "verdict": "not tried", "try": None, "p": None, "q": None, "accept_probability": None,
              "uniform": None, "position": None} for i in range(tree.size)]
    for k, t in enumerate(tries):
        x = int(tokens[t.node])
        last_rejection = k == len(tries) - 1 and not verdict.bonus
        nodes[t.node].update({
            "verdict": "accepted" if t.accepted else "rejected", "try": k, "p": _r(t.p[x]), "q": _r(t.q[x]),
            "accept_probability": _r(acceptance_probability(t.p[x : x + 1], t.q[x : x + 1])[0]),
            "uniform": None if greedy else float(u[t.node]),
            "position": _position(t.p, t.q, [x, verdict.token] if last_rejection else [x], top)})
    end = path[-1] if path else -1
    if verdict.bonus:
        final_position = _position(final, None, [verdict.token], top)
    else:  # drawn from the residual of the last rejected child's pair: that node's position
        final_position = nodes[tries[-1].node]["position"]
    drafts = [{"token": nodes[i]["token"], "p": nodes[i]["p"], "q": nodes[i]["q"],
               "accept_probability": nodes[i]["accept_probability"], "uniform": nodes[i]["uniform"],
               "verdict": "accepted", "node": i} for i in path]
    return {"drafts": drafts, "num_accepted": len(path), "token": verdict.token, "bonus": verdict.bonus,
            "positions": [nodes[i]["position"] for i in path] + [final_position],
            "tree": {"siblings": "deterministic" if greedy else draft.siblings, "size": tree.size,
                     "depth": tree.depth, "path": list(path), "nodes": nodes,
                     "final": {"node": end, "drawn_from": "target" if verdict.bonus else "residual",
                               "position": final_position}}}


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

    def __call__(self, seq, draft: Draft, p, verdict: Verdict, uniforms: torch.Tensor | None) -> None:
        if draft.is_chain and seq.spec.tree is None:  # tree speculation's records show the tree, a chain's too
            self._pending[seq.index] = verification_record(p, draft.tokens, draft.q, verdict, uniforms, self.top)
        else:
            self._pending[seq.index] = tree_verification_record(p, draft, verdict, uniforms, self.top)

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
            tree = record.get("tree")
            positions = record["positions"] + ([n["position"] for n in tree["nodes"] if n["position"]] if tree else [])
            for pos in positions:  # a tree's positions are shared with its nodes: texts are set twice, alike
                for c in pos["candidates"]:
                    c["text"] = text(c["token"])
            for n in tree["nodes"] if tree else []:
                n["text"] = text(n["token"])
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
        atomic_write_json(path, document)
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
