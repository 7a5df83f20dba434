"""What each token of a native pass attends to: its row, position and cache column, the columns before it and its
tree ancestors' (`Query`), a sliding window's cut of them (`windowed`), and all of a pass's queries as the C kernels
take them (`Attend`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Query:
    """One token of a pass: its row, id, position, cache column, and what it attends to."""

    row: int
    token: int
    position: int
    column: int
    prefix: int  # attends to columns 0 .. prefix - 1 (whose positions are their columns)
    extra: list[int]  # then to these columns (increasing)
    extra_positions: list[int] = field(default_factory=list)  # their positions (read by sliding windows)


@dataclass
class Attend:
    """What a pass's queries attend to, as the kernels take it."""

    prefix: np.ndarray  # (N,) int32: query i attends to columns 0 .. prefix[i] - 1
    extra_off: np.ndarray  # (N + 1,) int32: then to extra[extra_off[i] : extra_off[i + 1]]
    extra: np.ndarray  # (E,) int32 columns, increasing per query
    key_base: np.ndarray  # (N,) int64: address of layer 0 of the query's row's keys
    value_base: np.ndarray  # (N,) int64: likewise for values
    layer_bytes: np.ndarray  # (N,) int64: bytes between layers in that row's cache (Hkv head-major blocks)

    @staticmethod
    def of(spans: list[tuple[int, list[int]]], key_base: np.ndarray, value_base: np.ndarray,
           layer_bytes: np.ndarray) -> "Attend":
        """spans: each query's (prefix, extra columns)."""
        extra_off = np.zeros(len(spans) + 1, np.int32)  # (N + 1,)
        extra_off[1:] = np.cumsum([len(extra) for _, extra in spans])
        return Attend(np.array([prefix for prefix, _ in spans], np.int32), extra_off,
                       np.array([col for _, extra in spans for col in extra] or [0], np.int32), key_base, value_base,
                       layer_bytes)


def windowed(q: Query, window: int) -> tuple[int, list[int]]:
    """A query's (prefix, extra columns) in a sliding-window layer: positions after position - window only (a key
    `window` or more positions back is not attended, as llama.cpp masks it). Columns below the prefix hold their own
    positions; the extra columns' positions are the query's `extra_positions`. The list, and its order, depend on the
    query alone, whatever else is in the pass: the kernels' bits stay the query's own."""
    low = q.position - window + 1
    if low <= 0:
        return q.prefix, q.extra
    if len(q.extra_positions) != len(q.extra):  # a caller that did not say where its extra columns sit
        raise ValueError(f"a query at position {q.position} attends to {len(q.extra)} extra columns but gives "
                         f"{len(q.extra_positions)} positions for them: a sliding window cannot place them")
    return 0, list(range(low, q.prefix)) + [col for col, pos in zip(q.extra, q.extra_positions) if pos >= low]
