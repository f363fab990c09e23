"""One request's round, graded: target logits -> committed tokens and the accepted draft path.

The engine and `tandem audit` both grade through `grade_round`, so the audit checks exactly
what the engine commits: the same processing of p (temperature, top-k, top-p, min-p and the
repetition penalty, row by row), the same chain or tree rule and the same draws from the
request's generator. Both look the function up as `grading.grade_round` (and it looks up
`target_probs`, `verify_chain` and `verify_tree` as this module's attributes), so a test that
swaps in a broken piece breaks the engine and the audit alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.config import SamplingParams
from tandem.sampling import NonFiniteLogitsError, all_finite, processed_probs, row_argmax, sample
from tandem.types import Draft
from tandem.verify.chain import verify_chain
from tandem.verify.paths import tree_paths
from tandem.verify.tree import verify_tree


def grade_round(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    context: Sequence[int],
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Grade one request's round.

    logits: [n + 1, V] target logits for [next_token, d_1..d_n] (row 0 predicts position 1;
        tree rows follow the draft's node order). context: the committed token ids, next_token
        included (prompt + output): what the repetition penalty sees before this round.
    draft: the round's Draft; an empty one is plain decoding (one draw, or the argmax, from the
        last row, exactly as without speculation).
    generator: the request's generator (greedy requests without a penalty draw nothing).

    Returns (committed tokens: the accepted drafts then the recovered/bonus token, accepted
    draft nodes root first: a chain's are 0..accepted-1). Raises NonFiniteLogitsError when a row
    in use holds NaN or inf.
    """
    if not draft.token_ids:
        return [sample_plain(logits, params, context, generator)], []
    if params.greedy and params.repetition_penalty == 1.0 and not draft.is_tree:
        return grade_greedy_chain(logits, draft.token_ids)
    probs = target_probs(logits, draft, params, context)
    if draft.is_tree:
        if draft.probs is not None:
            raise ValueError("tree drafts must be deterministic (top-k children); sampled trees are not supported")
        result = verify_tree(probs, draft.token_ids, draft.parents, generator, params.greedy)
        return result.tokens, result.path
    result = verify_chain(
        probs.unsqueeze(0),
        torch.tensor([draft.token_ids]),
        [draft.probs],
        torch.tensor([len(draft)]),
        [generator],
        [params.greedy],
    )
    accepted = int(result.num_accepted[0])
    return result.committed(0), list(range(accepted))


def grade_greedy_chain(logits: torch.Tensor, drafted: Sequence[int]) -> tuple[list[int], list[int]]:
    """The greedy chain rule without building p: accept d_i while it is the argmax of row i - 1
    (ties: the first index, as the one-hot p of processed_probs), then commit the argmax of the
    next row. The same tokens verify_chain commits for greedy rows, at a fraction of the cost
    (no [n + 1, V] probability rows). Raises NonFiniteLogitsError on NaN or inf in any row."""
    rows = logits[: len(drafted) + 1]
    if not all_finite(rows):
        raise NonFiniteLogitsError("the model produced NaN or inf logits")
    best = row_argmax(rows).tolist()
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == best[accepted]:
        accepted += 1
    return [*drafted[:accepted], best[accepted]], list(range(accepted))


def sample_plain(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], generator: torch.Generator | None
) -> int:
    """Plain decoding's token from the last row of logits [N, V]: the argmax under greedy without
    a penalty (no draw), else one draw from the processed distribution."""
    if params.greedy and params.repetition_penalty == 1.0:
        if not all_finite(logits[-1]):
            raise NonFiniteLogitsError("the model produced NaN or inf logits")
        return int(row_argmax(logits[-1]))
    probs = processed_probs(logits[-1:], params, seen_ids(context, params))
    return int(sample(probs, generator)[0])


def target_probs(logits: torch.Tensor, draft: Draft, params: SamplingParams, context: Sequence[int]) -> torch.Tensor:
    """[n + 1, V] logits -> processed p, each row exactly as plain sampling would process it at
    that point: with a repetition penalty, row i also penalises the draft tokens on its path
    (row 0: the context alone)."""
    if params.repetition_penalty == 1.0:
        return processed_probs(logits, params)
    known = set(context)
    paths = [[]] + tree_paths(draft.parents if draft.is_tree else list(range(-1, len(draft) - 1)))
    rows = []
    for row, path in enumerate(paths):
        seen = torch.tensor(sorted(known | {draft.token_ids[i] for i in path}), dtype=torch.long)
        rows.append(processed_probs(logits[row : row + 1], params, seen))
    return torch.cat(rows)


def seen_ids(context: Sequence[int], params: SamplingParams) -> torch.Tensor | None:
    """The ids the repetition penalty applies to after `context`, or None without a penalty."""
    if params.repetition_penalty == 1.0:
        return None
    return torch.tensor(sorted(set(context)), dtype=torch.long)
