"""Pass costs by width with the widths taken in turns, for the pass-cost benchmarks (`pass_costs.py`,
`shape_costs.py`, `--interleave`).

`verispec.tuning.measure_costs` (what `--auto-k` runs) times each width's repeats one after the other, so on a VM whose
memory bandwidth drifts by 10-30% from minute to minute a slow minute lands on a few widths and makes a step between
two widths out of nothing (on a 2-core Zen 4, two runs of the same build measured the step from 7 to 8 tokens at
1.13x and 1.23x; the matmuls of those passes, taken in turns, 1.10x). Here every width runs once a round, the order
turned each round, and each width costs the median of its ratios to the same round's one-token pass times the median
one-token pass: a slow minute then shifts every width alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from verispec.tree import chain_parents


def pass_timer(runner, context: int) -> Callable[[int], float]:
    """A row with `context` cached tokens, and a function timing one pass over `width` new tokens on it (a chain of
    draft nodes, dropped again after the pass, as `measure_costs` times them)."""
    vocab = runner.vocab_size
    state = runner.new_state(1)
    runner.forward(state, [[(i * 7919) % vocab for i in range(context)]], [1])

    def one_pass(width: int) -> float:
        start = time.perf_counter()
        runner.forward(state, [[(11 + i) % vocab for i in range(width)]], [width], [list(chain_parents(width))])
        runner.commit(state, [[]])
        return time.perf_counter() - start

    return one_pass


def interleaved_costs(runner, max_tokens: int, context: int, repeats: int) -> dict[int, float]:
    """Seconds per pass over 1..max_tokens new tokens after `context` cached tokens (`pass_timer`), the widths taken
    in turns over `repeats` rounds."""
    one_pass = pass_timer(runner, context)
    widths = list(range(1, max_tokens + 1))
    for width in widths:
        one_pass(width)  # warm-up: the first pass of a new shape pays for kernel set-up
    rounds = []
    for r in range(repeats):
        order = widths[r % len(widths):] + widths[: r % len(widths)]
        rounds.append({width: one_pass(width) for width in order})
    one = statistics.median(t[1] for t in rounds)
    return {width: one * statistics.median(t[width] / t[1] for t in rounds) for width in widths}


def settings_in_turns(runner, settings: dict[str, Callable[[], object]], context: int, repeats: int
                      ) -> dict[str, list[float]]:
    """Seconds of one-token passes after `context` cached tokens (`pass_timer`) under each setting, the settings
    taking turns: every round applies each once (its callable) and times a pass, the order turned each round."""
    one_pass = pass_timer(runner, context)
    names = list(settings)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats + 1):  # the first round warms up, untimed
        for name in names[r % len(names):] + names[: r % len(names)]:
            settings[name]()
            took = one_pass(1)
            if r:
                seconds[name].append(took)
    return seconds
