"""One request's round, graded: target logits -> committed tokens and the accepted draft path.

The engine and `tandem audit` both grade through `grade_round`, so the audit checks exactly
what the engine commits: the same processing of p (temperature, top-k, top-p, min-p and the
repetition, presence and frequency penalties, row by row), the same chain or tree rule and the same draws from the
request's generator. Both look the function up as `grading.grade_round` (and it looks up
`target_probs`, `verify_chain` and `verify_tree` as this module's attributes), so a test that
swaps in a broken piece breaks the engine and the audit alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from tandem.config import SamplingParams
from tandem.model.kernels import BlockKernels
from tandem.sampling import (
    NonFiniteLogitsError,
    all_finite,
    native_rows,
    native_sampling,
    processed_probs,
    raise_for_status,
    row_argmax,
    row_processing,
    sample,
    shifted,
    status_error,
)
from tandem.types import Draft, GreedyRows, tree_paths
from tandem.verify.chain import verify_chain
from tandem.verify.tree import children_of, verify_tree


def grade_round(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    context: Sequence[int],
    generator: torch.Generator | None,
    num_prompt_tokens: int | None = None,
    shift: torch.Tensor | None = None,
    greedy: GreedyRows | None = None,
) -> tuple[list[int], list[int]]:
    """Grade one request's round.

    logits: [n + 1, V] target logits for [next_token, d_1..d_n] (row 0 predicts position 1;
        tree rows follow the draft's node order). context: the committed token ids, next_token
        included (prompt + output): what the penalties see before this round; its first
        num_prompt_tokens are the prompt (None: all of it, as in an audit from a prompt), the
        rest are what the presence and frequency penalties count.
    draft: the round's Draft; an empty one is plain decoding (one draw, or the argmax, from the
        last row, exactly as without speculation).
    generator: the request's generator (greedy requests without a penalty draw nothing).
    shift: [n + 1, V] added to each row's logits first (sampling.shifted: a structured output's
        refused tokens at -inf, the logit bias; None: nothing).
    greedy: the rows' argmax and finiteness where the forward found them (the fused path's LM
        head), for greedy grading without a shift; None: read from the rows.

    Returns (committed tokens: the accepted drafts then the recovered/bonus token, accepted
    draft nodes root first: a chain's are 0..accepted-1). Raises NonFiniteLogitsError when a row
    in use holds NaN or inf.
    """
    if not draft.token_ids:
        return [sample_plain(logits, params, context, generator, num_prompt_tokens, shift, greedy)], []
    if draft.is_tree and draft.probs is not None:
        raise ValueError("tree drafts must be deterministic (top-k children); sampled trees are not supported")
    if params.greedy and not params.penalized:
        if draft.is_tree:
            return grade_greedy_tree(logits, draft, shift, greedy)
        return grade_greedy_chain(logits, draft.token_ids, shift, greedy)
    kernels = native_sampling(params, logits)
    if kernels is not None and not draft.is_tree and (draft.probs is None or draft.probs.device.type == "cpu"):
        return grade_chain_natively(kernels, logits, draft, params, generator, shift)
    probs = target_probs(logits, draft, params, context, num_prompt_tokens, shift)
    if draft.is_tree:
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


def grade_chain_natively(kernels: BlockKernels, logits: torch.Tensor, draft: Draft, params: SamplingParams,
                         generator: torch.Generator, shift: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """The chain rule for a request native_sampling serves, in one kernel call
    (BlockKernels.grade_chain): the same k + 1 uniforms from the request's generator as
    verify_chain draws, the same tests and draws, over the kernels' processed rows, computed
    only up to the first rejected draft."""
    k, vocab = len(draft), logits.shape[-1]
    q = draft.probs
    if q is not None and (q.dim() != 2 or q.shape[0] < k or q.shape[1] != vocab):
        raise ValueError(f"draft probabilities must be [>= {k}, {vocab}], got {list(q.shape)}")
    uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    accepted, token, status = kernels.grade_chain(
        logits[: k + 1], torch.tensor(draft.token_ids, dtype=torch.int64), q, uniforms, row_processing(params),
        None if shift is None else shift[: k + 1])
    raise_for_status(status)
    return [*draft.token_ids[:accepted], token], list(range(accepted))


def grade_greedy_chain(logits: torch.Tensor, drafted: Sequence[int],
                       shift: torch.Tensor | None = None,
                       greedy: GreedyRows | None = None) -> tuple[list[int], list[int]]:
    """The greedy chain rule without building p: accept d_i while it is the argmax of row i - 1
    (ties: the first index, as the one-hot p of processed_probs), then commit the argmax of the
    next row (of its shifted logits, with a structured output or a logit bias). The same tokens verify_chain
    commits for greedy rows, at a fraction of the cost (no [n + 1, V] probability rows). Raises
    NonFiniteLogitsError on NaN or inf in any row."""
    best = _greedy_tokens(logits, len(drafted) + 1, shift, greedy)
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == best[accepted]:
        accepted += 1
    return [*drafted[:accepted], best[accepted]], list(range(accepted))


def grade_greedy_tree(logits: torch.Tensor, draft: Draft, shift: torch.Tensor | None = None,
                      greedy: GreedyRows | None = None) -> tuple[list[int], list[int]]:
    """The greedy tree rule without building p: from the root, follow the first child (in draft
    order) whose token is the argmax of its parent's row, then commit the argmax of the last
    row reached. The tokens and path verify_tree gives greedy rows, without [N + 1, V]
    probability rows. Raises NonFiniteLogitsError on NaN or inf in any row."""
    best = _greedy_tokens(logits, len(draft) + 1, shift, greedy)
    children = children_of(draft.parents)
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        node = next((c for c in children[node + 1] if draft.token_ids[c] == want), None)
        if node is None:
            return [draft.token_ids[i] for i in path] + [want], path
        path.append(node)


def _greedy_tokens(logits: torch.Tensor, n: int, shift: torch.Tensor | None,
                   greedy: GreedyRows | None) -> list[int]:
    """The argmax of each of the first n rows (of their shifted logits where a shift is given;
    ties: the first index, as the one-hot p of processed_probs). Raises NonFiniteLogitsError
    on NaN or inf in any of them."""
    if greedy is not None and shift is None:  # found by the LM head: the rows need not be read again
        if not all(greedy.finite[:n]):
            raise NonFiniteLogitsError("the model produced NaN or inf logits")
        return greedy.argmax[:n]
    rows = logits[:n]
    if not all_finite(rows):
        raise NonFiniteLogitsError("the model produced NaN or inf logits")
    return row_argmax(shifted(rows, None if shift is None else shift[:n])).tolist()


def sample_plain(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], generator: torch.Generator | None,
    num_prompt_tokens: int | None = None, shift: torch.Tensor | None = None, greedy: GreedyRows | None = None,
) -> int:
    """Plain decoding's token from the last row of logits [N, V]: the argmax under greedy without
    a penalty (no draw), else one draw from the processed distribution (context and
    num_prompt_tokens as grade_round's; shift: [1, V] or [N, V], whose last row is added to the
    last logits row first)."""
    mask = None if shift is None else shift[-1:]
    if params.greedy and not params.penalized and greedy is not None and mask is None:
        if not greedy.finite[-1]:
            raise NonFiniteLogitsError("the model produced NaN or inf logits")
        return greedy.argmax[-1]
    if params.greedy and not params.penalized:
        if not all_finite(logits[-1]):
            raise NonFiniteLogitsError("the model produced NaN or inf logits")
        return int(row_argmax(shifted(logits[-1:], mask))[0])
    kernels = native_sampling(params, logits)
    if kernels is not None:
        return int(native_rows(kernels, logits[-1:], params, generator, mask, probs=False)[1][0])
    probs = processed_probs(logits[-1:], params, seen_ids(context, params),
                            output_counts(context, params, num_prompt_tokens), mask)
    return int(sample(probs, generator)[0])


def sample_plain_rows(kernels: BlockKernels, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                      generators: list[torch.Generator]) -> list[int | NonFiniteLogitsError]:
    """Plain decoding's token for several requests at once, request i's from row rows[i] of
    logits [N, V], in one kernel call: for requests native_sampling serves, without a shift,
    what sample_plain gives each (the same uniform from its generator, the same processed
    distribution). A row with NaN or inf logits gives its error instead of a token."""
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    _, tokens, status = kernels.sample_rows(logits, [row_processing(p) for p in params], uniforms, probs=False,
                                            row_of=torch.tensor(rows, dtype=torch.int64))
    return [status_error(code) or token for token, code in zip(tokens.tolist(), status.tolist())]


def target_probs(logits: torch.Tensor, draft: Draft, params: SamplingParams, context: Sequence[int],
                 num_prompt_tokens: int | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """[n + 1, V] logits -> processed p, each row exactly as plain sampling would process it at
    that point: with a penalty, row i also counts the draft tokens on its path as generated
    (row 0: the context alone); with a shift, row i's added to row i first."""
    if not params.penalized:
        return processed_probs(logits, params, shift=shift)
    known = set(context) if params.repetition_penalty != 1.0 else None
    generated = Counter(_generated(context, num_prompt_tokens)) if params.penalizes_output else None
    paths = [[]] + tree_paths(draft.parents if draft.is_tree else list(range(-1, len(draft) - 1)))
    rows = []
    for row, path in enumerate(paths):
        on_path = [draft.token_ids[i] for i in path]
        seen = None if known is None else torch.tensor(sorted(known.union(on_path)), dtype=torch.long)
        counts = None if generated is None else _id_counts(generated + Counter(on_path))
        rows.append(processed_probs(logits[row : row + 1], params, seen, counts,
                                    None if shift is None else shift[row : row + 1]))
    return torch.cat(rows)


def seen_ids(context: Sequence[int], params: SamplingParams) -> torch.Tensor | None:
    """The ids the repetition penalty applies to after `context`, or None without a penalty."""
    if params.repetition_penalty == 1.0:
        return None
    return torch.tensor(sorted(set(context)), dtype=torch.long)


def output_counts(context: Sequence[int], params: SamplingParams,
                  num_prompt_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, counts) of the generated tokens in `context` (those after its first
    num_prompt_tokens; None: it is all prompt), which the presence and frequency penalties
    apply to; None without those penalties."""
    if not params.penalizes_output:
        return None
    return _id_counts(Counter(_generated(context, num_prompt_tokens)))


def _generated(context: Sequence[int], num_prompt_tokens: int | None) -> Sequence[int]:
    return () if num_prompt_tokens is None else context[num_prompt_tokens:]


def _id_counts(counts: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    ids = sorted(counts)
    return torch.tensor(ids, dtype=torch.long), torch.tensor([counts[i] for i in ids], dtype=torch.float32)
