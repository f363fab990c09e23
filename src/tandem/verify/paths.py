"""Tree structure helpers shared by the model runner and the verifiers (no model, no state)."""

from __future__ import annotations


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from its root to itself (node indices, root first)."""
    paths: list[list[int]] = []
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"tree parents must precede children; node {t} has parent {p}")
        paths.append((paths[p] if p >= 0 else []) + [t])
    return paths
