"""Tree structure helpers shared by the model runner, the engine, the audit and the verifiers (no
model, no state)."""

from __future__ import annotations


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from its root to itself (node indices, root first)."""
    paths: list[list[int]] = []
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"tree parents must precede children; node {t} has parent {p}")
        paths.append((paths[p] if p >= 0 else []) + [t])
    return paths


def rooted_parents(parents: list[int] | None) -> list[int] | None:
    """A draft tree's parents as its verification forward sees them: row 0 is the last committed
    token (the root), draft node i is row i + 1. None (a chain) stays None."""
    return None if parents is None else [-1] + [p + 1 for p in parents]
