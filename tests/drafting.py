"""A greedy-equality test means something only if its speculative run drafted tokens and the target accepted
some of them: a run that drafted nothing (or had every draft rejected) is plain decoding compared with itself."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def _stats(run):
    if isinstance(run, Mapping):  # the CLI's --json output, or its "stats" object
        stats = run.get("stats", run)
        return stats["draft_tokens"], stats["accepted_tokens"]
    return run.stats.draft_tokens, run.stats.accepted_tokens


def drafts_accepted(runs: Iterable) -> tuple[int, int]:
    """Assert that `runs` (sequences, `GenerationResult`s or --json dicts, from one speculative run) drafted
    tokens and had some accepted; return (drafted, accepted), summed. Printed, so a failure shows them."""
    counts = [_stats(run) for run in runs]
    drafted, accepted = sum(d for d, _ in counts), sum(a for _, a in counts)
    print(f"drafted {drafted}, accepted {accepted}")
    assert drafted > 0, "no drafts were proposed: this run is plain decoding"
    assert accepted > 0, f"none of {drafted} drafts was accepted: every emitted token came from the target alone"
    return drafted, accepted
