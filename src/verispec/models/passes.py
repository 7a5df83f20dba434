"""What every runner's `forward` does with draft nodes before and after its own pass (see `core.protocols`).

A row's new tokens are committed tokens then, when `parents` is given, draft nodes (its last len(parents[b])
tokens). A runner's tree pass gives each row the logits after each node, and after its last committed token
where the row wants that too (`root_wanted`); `last_logits` keeps the last num_logits[b] of them, as `forward`
promises.
"""

from __future__ import annotations

import torch


def forward_nodes(tokens: list[list[int]], num_logits: list[int], parents: list[list[int]] | None,
                  tree_pass) -> torch.Tensor:
    """What every runner's `forward` does where rows hold draft nodes: split each row's committed tokens from its
    nodes, run the runner's own `tree_pass(chains, nodes, parents, root)` and keep the logits asked for."""
    parents = parents if parents is not None else [[] for _ in tokens]
    chains, nodes = split_nodes(tokens, parents)
    root = root_wanted(chains, nodes, num_logits)
    return last_logits(tree_pass(chains, nodes, parents, root), tree_pass_counts(nodes, root), num_logits)


def split_nodes(tokens: list[list[int]], parents: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's committed tokens and its draft nodes: the last len(parents[b]) of tokens[b]."""
    if len(parents) != len(tokens):
        raise ValueError(f"{len(tokens)} rows of tokens but {len(parents)} rows of parents")
    chains, nodes = [], []
    for b, (row, row_parents) in enumerate(zip(tokens, parents)):
        n = len(row_parents)
        if n > len(row):
            raise ValueError(f"row {b}: {n} parents for {len(row)} new tokens")
        chains.append(row[: len(row) - n])
        nodes.append(row[len(row) - n :])
    return chains, nodes


def last_logits(logits: torch.Tensor, have: list[int], num_logits: list[int]) -> torch.Tensor:
    """(B, M, V) logits where row b holds `have[b]` in order -> the last num_logits[b] of them per row,
    (B, max(1, max num_logits), V). The pass's own tensor when every row wants all it has or none."""
    for b, (h, n) in enumerate(zip(have, num_logits)):
        if n > h:
            raise ValueError(f"row {b}: {n} logits asked for, but the pass gives {h} (after its last committed "
                             "token and each node)")
    if all(n in (0, h) for h, n in zip(have, num_logits)):
        return logits
    out = logits.new_zeros(logits.shape[0], max(1, max(num_logits, default=0)), logits.shape[-1])  # (B, M, V)
    for b, (h, n) in enumerate(zip(have, num_logits)):
        out[b, :n] = logits[b, h - n : h]
    return out


def root_wanted(chains: list[list[int]], nodes: list[list[int]], num_logits: list[int]) -> list[bool]:
    """Whether row b wants the logits after its last committed token (then it read one) as well as each node's."""
    return [bool(chain) and n > len(row) for chain, row, n in zip(chains, nodes, num_logits)]


def tree_pass_counts(nodes: list[list[int]], root: list[bool]) -> list[int]:
    """Logits a tree pass gives row b: after its last committed token where `root[b]`, and after each node."""
    return [int(r) + len(row) for row, r in zip(nodes, root)]
