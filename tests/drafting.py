"""A greedy-equality test means something only if its speculative run drafted tokens and the target accepted
some of them: a run that drafted nothing (or had every draft rejected) is plain decoding compared with itself."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping


def _stats(run) -> tuple[int, int]:
    if isinstance(run, Mapping):  # the CLI's --json output, a bench run, or their "stats" object
        stats = run.get("stats", run)
        return stats["draft_tokens"], stats["accepted_tokens"]
    return run.stats.draft_tokens, run.stats.accepted_tokens


def drafts_accepted(runs: Iterable) -> tuple[int, int]:
    """Assert that `runs` (sequences, `GenerationResult`s or --json dicts, from one speculative run) drafted
    tokens and had some accepted; return (drafted, accepted), summed over the runs.

    With VERISPEC_DRAFT_COUNTS set to a file name, each call appends its test and counts there (how the counts
    in a report are gathered; stdout is left alone, since tests read it)."""
    counts = [_stats(run) for run in runs]
    drafted, accepted = sum(d for d, _ in counts), sum(a for _, a in counts)
    if log := os.environ.get("VERISPEC_DRAFT_COUNTS"):
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').rsplit(' ', 1)[0]}: drafted {drafted}, accepted {accepted}\n")
    assert drafted > 0, "no drafts were proposed: this run is plain decoding"
    assert accepted > 0, f"none of {drafted} drafts was accepted: every emitted token came from the target alone"
    return drafted, accepted
