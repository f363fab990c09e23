"""Tree verification: grade one request's draft tree against the target in one pass.

Implements docs/algorithms.md section 2 for deterministic children (top-k trees from EAGLE heads,
lookup drafts merged into a tree): walk from the root, try each node's children in draft order,
accept child c with probability p'(c), else set p'(c) = 0 and renormalise; when no child passes,
draw from what is left of p'. Every token's law is p's, whatever the tree. Greedy requests take
the longest path whose tokens equal the argmax of their parent's target row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.sampling import NonFiniteLogitsError, row_argmax
from tandem.verify.chain import _sample_inverse_cdf


@dataclass
class TreeResult:
    """path: the accepted draft nodes, root first (indices into the draft); tokens: their
    tokens followed by the recovered or bonus token."""

    path: list[int]
    tokens: list[int]


def children_of(parents: list[int]) -> list[list[int]]:
    """children[i + 1] = the nodes whose parent is node i (children[0]: those of the root), in
    draft order: the order they are tried in, fixed before any target randomness is read."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"tree parents must precede children; node {node} has parent {parent}")
        children[parent + 1].append(node)
    return children


def verify_tree(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    parents: list[int],
    generator: torch.Generator | None,
    greedy: bool,
) -> TreeResult:
    """target_probs: [N + 1, V] processed target distributions, row 0 at the root (the last
    committed token), row i + 1 at draft node i. draft_tokens, parents: the N nodes (parent -1 =
    the root), parents before children. A sampled request draws its uniforms from `generator`:
    one per child tried, one for the final token."""
    n, vocab = len(draft_tokens), target_probs.shape[-1]
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [N + 1, V] = [{n + 1}, V], got {list(target_probs.shape)}")
    if len(parents) != n:
        raise ValueError(f"{n} draft tokens but {len(parents)} parents")
    if any(not 0 <= t < vocab for t in draft_tokens):
        raise ValueError(f"a draft token lies outside [0, {vocab})")
    if not greedy and generator is None:
        raise ValueError("a sampled request needs a generator")
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        total = float(p.sum())
        if not math.isfinite(total):
            raise NonFiniteLogitsError("target probabilities contain NaN or inf")
        if total <= 0:
            raise ValueError("target probabilities have no mass")
        if greedy:
            best = int(row_argmax(p))
            nxt = next((c for c in children[node + 1] if draft_tokens[c] == best), None)
            if nxt is None:
                return TreeResult(path, [draft_tokens[i] for i in path] + [best])
        else:
            nxt, residual = _try_children(p, children[node + 1], draft_tokens, generator)
            if nxt is None:
                u = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
                final = int(_sample_inverse_cdf(residual.unsqueeze(0), u.to(residual.device))[0])
                return TreeResult(path, [draft_tokens[i] for i in path] + [final])
        path.append(nxt)
        node = nxt


def _try_children(
    p: torch.Tensor, children: list[int], draft_tokens: list[int], generator: torch.Generator
) -> tuple[int | None, torch.Tensor]:
    """The first child accepted under the deterministic-children rule, or None and the residual
    p' (p with every rejected child's token zeroed) to draw the final token from."""
    residual = p.float().clone()
    mass = float(residual.sum())
    tried: set[int] = set()
    for child in children:
        token = draft_tokens[child]
        if token in tried:  # identical siblings: the second can never pass (p'(token) = 0)
            continue
        tried.add(token)
        u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
        p_token = float(residual[token])
        if u * mass < p_token:
            return child, residual
        residual[token] = 0.0
        mass = float(residual.sum())
    if mass <= 0:  # every token with mass was a rejected child (rounding)
        residual = p.float().clone()
    return None, residual
