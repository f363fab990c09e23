"""Chain verification: grade each request's K draft tokens against the target in one pass.

Implements the lossless rule of docs/algorithms.md section 1 for sampled and deterministic drafts, and
the greedy identity rule, batched over requests with different draft lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tandem.sampling import NonFiniteLogitsError, row_argmax
from tandem.types import VerifyResult

# Per request the [>= k, V] draft distributions q_1..q_k, or None for a deterministic draft; or one
# [B, K, V] tensor when every request in the batch sampled its draft.
DraftProbs = torch.Tensor | Sequence[torch.Tensor | None]

# Tokens per block in the two-level inverse-CDF draw of the recovered/bonus token.
_CDF_BLOCK = 1024


def verify_chain(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor | Sequence[int],
    generators: Sequence[torch.Generator | None],
    greedy: torch.Tensor | Sequence[bool],
) -> VerifyResult:
    """Grade a batch of chain drafts, drawing each request's randomness from its own generator.

    target_probs: [B, K+1, V] processed target distributions p_1..p_{K+1}; rows past a request's
        own k + 1 are padding and never read for decisions.
    draft_tokens: [B, K] long; positions past a request's own k are padding (any value).
    draft_probs: see DraftProbs; q must be processed exactly like the distribution the drafter
        sampled from (docs/algorithms.md section 8).
    num_drafts: [B] each request's own k in [0, K]; k = 0 samples one token from p_1.
    generators: one per request. A sampled request draws k + 1 fp64 uniforms per round from its
        own generator (k acceptance tests, then the recovered/bonus draw), so its tokens do not
        depend on the rest of the batch. Greedy requests draw nothing (their entry may be None).
    greedy: [B] bools; greedy requests accept while d_i == argmax p_i (ties: the first index, as
        torch.argmax), then emit the argmax of the next target row.

    Returns VerifyResult(tokens [B, K+1] padded with -1, num_accepted [B]).
    """
    num_drafts, greedy = _check_inputs(target_probs, draft_tokens, draft_probs, num_drafts, greedy)
    accept_uniforms, draw_uniforms = _draw_uniforms(generators, num_drafts, greedy, draft_tokens.shape[1])
    return _grade(target_probs, draft_tokens, draft_probs, num_drafts, greedy, accept_uniforms, draw_uniforms)


def verify_chain_from_uniforms(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor | Sequence[int],
    accept_uniforms: torch.Tensor,
    draw_uniforms: torch.Tensor,
    greedy: torch.Tensor | Sequence[bool],
) -> VerifyResult:
    """verify_chain with the randomness passed in: for bulk simulations (tests, `tandem audit`).

    accept_uniforms: [B, K] in [0, 1), one per draft position. draw_uniforms: [B] in [0, 1) for
    the recovered/bonus draw. verify_chain is exactly this function fed by the generators.
    """
    num_drafts, greedy = _check_inputs(target_probs, draft_tokens, draft_probs, num_drafts, greedy)
    batch, k_max = draft_tokens.shape
    if tuple(accept_uniforms.shape) != (batch, k_max) or tuple(draw_uniforms.shape) != (batch,):
        raise ValueError(
            f"need accept_uniforms [B, K] = {list(draft_tokens.shape)} and draw_uniforms [B], got "
            f"{list(accept_uniforms.shape)} and {list(draw_uniforms.shape)}"
        )
    return _grade(target_probs, draft_tokens, draft_probs, num_drafts, greedy, accept_uniforms, draw_uniforms)


def _grade(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    accept_uniforms: torch.Tensor,
    draw_uniforms: torch.Tensor,
) -> VerifyResult:
    num_rows = target_probs.shape[1]
    device = target_probs.device
    drafted = torch.arange(num_rows - 1, device=device) < num_drafts[:, None]  # [B, K]
    tokens = draft_tokens.to(device=device, dtype=torch.long)
    tokens = torch.where(drafted, tokens, 0)  # [B, K]; padding -> a safe index
    target_argmax = _greedy_argmax(target_probs, greedy, num_drafts)  # [B, K+1] or None

    num_accepted = _count_accepted(
        target_probs, tokens, drafted, draft_probs, num_drafts, greedy, target_argmax,
        accept_uniforms.to(device),
    )
    final = _final_tokens(
        target_probs, tokens, draft_probs, num_drafts, greedy, target_argmax, num_accepted,
        draw_uniforms.to(device),
    )

    out = F.pad(tokens, (0, 1), value=-1)  # [B, K+1]
    out = out.masked_fill(torch.arange(num_rows, device=device) >= num_accepted[:, None], -1)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyResult(tokens=out, num_accepted=num_accepted)


def _greedy_argmax(
    target_probs: torch.Tensor, greedy: torch.Tensor, num_drafts: torch.Tensor
) -> torch.Tensor | None:
    """argmax of p_1..p_{k+1} for greedy requests (0 elsewhere): [B, K+1], or None without any.

    One request at a time over views of its own rows: no copy of the [B, K+1, V] probabilities.
    """
    if not bool(greedy.any()):
        return None
    argmax = torch.zeros(target_probs.shape[:2], dtype=torch.long, device=target_probs.device)
    for row, (k, is_greedy) in enumerate(zip(num_drafts.tolist(), greedy.tolist())):
        if is_greedy:
            argmax[row, : k + 1] = row_argmax(target_probs[row, : k + 1]).to(argmax.device)
    return argmax


def _count_accepted(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    drafted: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
) -> torch.Tensor:
    """Length of each request's run of accepted drafts: [B]."""
    k_max = tokens.shape[1]
    # docs/algorithms.md section 1: accept d_i when u * q_i(d_i) < p_i(d_i), i.e. with
    # probability min(1, p/q). A deterministic draft has one-hot q, so q_i(d_i) = 1 and the same
    # test accepts with probability p_i(d_i).
    p_at_draft = target_probs[:, :k_max].gather(-1, tokens[..., None]).squeeze(-1)  # [B, K]
    vocab = target_probs.shape[-1]
    q_at_draft = _draft_probs_at_tokens(draft_probs, tokens, num_drafts.tolist(), vocab)  # [B, K]
    accepted = accept_uniforms * q_at_draft < p_at_draft
    if target_argmax is not None:
        accepted = torch.where(greedy[:, None], tokens == target_argmax[:, :k_max], accepted)
    # The run stops at the first rejection, or at the request's own k.
    return (accepted & drafted).long().cumprod(dim=1).sum(dim=1)


def _final_tokens(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor | None,
    num_accepted: torch.Tensor,
    draw_uniforms: torch.Tensor,
) -> torch.Tensor:
    """The recovered token after a rejection, or the bonus token after a full run: [B]."""
    batch, _, vocab = target_probs.shape
    final = torch.empty(batch, dtype=torch.long, device=target_probs.device)
    if target_argmax is not None:
        final[greedy] = target_argmax[torch.arange(batch, device=final.device), num_accepted][greedy]
    # Row num_accepted of p is p_{k+1} after a full run, else p_i at the first rejection.
    bonus = (~greedy & (num_accepted == num_drafts)).nonzero().squeeze(1)  # [S_b]
    if bonus.numel():
        final[bonus] = _sample_inverse_cdf(target_probs[bonus, num_accepted[bonus]], draw_uniforms[bonus])
    rejected = (~greedy & (num_accepted < num_drafts)).nonzero().squeeze(1)  # [R]
    if rejected.numel():
        position = num_accepted[rejected]
        dist = _recovery_distribution(target_probs, tokens, draft_probs, rejected, position)  # [R, V]
        # p <= q everywhere leaves no residual: for normalised vectors only when p == q up to
        # rounding (or for an inconsistent q). Then draw from p_i itself (docs/algorithms.md section 1).
        empty = dist.sum(-1) <= 0  # [R]
        if bool(empty.any()):
            dist[empty] = target_probs[rejected[empty], position[empty]].float()
        final[rejected] = _sample_inverse_cdf(dist, draw_uniforms[rejected])
    return final


def _recovery_distribution(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: DraftProbs,
    rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Unnormalised law of the recovered token after rejecting `positions` of batch `rows`: [R, V].

    Sampled drafts leave max(0, p_i - q_i) (docs/algorithms.md section 1). A deterministic draft has one-hot
    q, where the same formula is p_i with d_i zeroed (p(d) - 1 <= 0): done without building q.
    Everything is edited in place in one copy of the target rows (fresh [R, V] buffers cost more
    than the arithmetic at V = 262144).
    """
    dist = target_probs[rows, positions].float()  # [R, V], a copy
    if isinstance(draft_probs, torch.Tensor):
        return _residual_(dist, draft_probs[rows, positions])
    deterministic = []
    for j, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist())):
        if draft_probs[row] is None:
            deterministic.append(j)
        else:
            _residual_(dist[j], draft_probs[row][pos])
    if deterministic:
        local = torch.tensor(deterministic, device=dist.device)
        dist[local, tokens[rows[local], positions[local]]] = 0.0
    return dist


def _residual_(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) written into p: the recovered token's unnormalised law (docs/algorithms.md section 1)."""
    return p.sub_(q).clamp_(min=0.0)


def _sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[R, V] unnormalised probabilities with positive mass, [R] uniforms in [0, 1) -> [R] ids.

    Inverse CDF in two levels, so no running sum over all V is needed (at V = 262144 that pass and
    its fp64 copy were most of the verifier's time): pick a block of _CDF_BLOCK tokens from the
    cumulative block masses, then a token in it from the block's own fp64 running sum. Block
    masses are fp32 sums of <= 1024 values, exact to ~1e-7 relative: the precision of p itself.
    The target (1 - u) * total lies in (0, total], and a zero-mass block or token repeats its
    predecessor's cumulative value, so the first one reaching the target has positive mass: no
    filtered-out token and no id >= V can come out.
    """
    rows, vocab = probs.shape
    probs = probs.contiguous()
    width = min(_CDF_BLOCK, vocab)
    num_full = vocab // width
    masses = [probs[:, : num_full * width].view(rows, num_full, width).sum(-1)]
    if vocab % width:
        masses.append(probs[:, num_full * width :].sum(-1, keepdim=True))
    block_cdf = torch.cat(masses, 1).double().cumsum(-1)  # [R, ceil(V / width)]
    target = (1.0 - uniforms.double()) * block_cdf[:, -1]  # [R]
    block = torch.searchsorted(block_cdf, target[:, None])  # [R, 1]
    below = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill(block == 0, 0.0)  # [R, 1]

    ids = block * width + torch.arange(width, device=probs.device)  # [R, width]
    inside = probs.gather(1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, 0.0)
    inner_cdf = inside.double().cumsum(-1)  # [R, width]
    # Keep the target inside (0, block mass] against rounding between the two levels.
    inner_target = (target[:, None] - below).clamp(min=torch.finfo(torch.float64).tiny)
    inner_target = torch.minimum(inner_target, inner_cdf[:, -1:])
    return ids.gather(1, torch.searchsorted(inner_cdf, inner_target)).squeeze(1)


def _draft_probs_at_tokens(
    draft_probs: DraftProbs, tokens: torch.Tensor, num_drafts: list[int], vocab: int
) -> torch.Tensor:
    """q_i(d_i) for every draft position: [B, K]; 1 for deterministic drafts (one-hot q)."""
    if isinstance(draft_probs, torch.Tensor):
        return draft_probs.gather(-1, tokens[..., None]).squeeze(-1).float()
    device = tokens.device
    k_max = tokens.shape[1]
    q_at = torch.ones(tokens.shape, device=device)
    # Flat index of (i, d_i) in a row-major [>= k, V] q: i * V + d_i (torch.take reads q that way).
    flat = torch.arange(k_max, device=device) * vocab + tokens  # [B, K]
    picked = [
        q.take(flat[row, :k].to(q.device)).to(device)
        for row, (q, k) in enumerate(zip(draft_probs, num_drafts))
        if q is not None
    ]
    if picked:
        # The mask's row-major order is request order, then positions 0..k-1: that of `picked`.
        drafted = torch.arange(k_max, device=device) < torch.tensor(num_drafts, device=device)[:, None]
        has_q = torch.tensor([q is not None for q in draft_probs], device=device)
        q_at[drafted & has_q[:, None]] = torch.cat(picked).float()
    return q_at


def _draw_uniforms(
    generators: Sequence[torch.Generator | None], num_drafts: torch.Tensor, greedy: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled request's k + 1 uniforms -> accept [B, K] and draw [B] (fp64, zero elsewhere)."""
    if len(generators) != len(num_drafts):
        raise ValueError(f"need one generator per request, got {len(generators)} for {len(num_drafts)}")
    device = num_drafts.device
    draws = []
    for row, (gen, k, is_greedy) in enumerate(zip(generators, num_drafts.tolist(), greedy.tolist())):
        if is_greedy:
            continue
        if gen is None:
            raise ValueError(f"batch row {row} samples but has no generator")
        draws.append(torch.rand(k + 1, generator=gen, dtype=torch.float64, device=gen.device).to(device))
    uniforms = torch.zeros(len(num_drafts), k_max + 1, dtype=torch.float64, device=device)  # [B, K+1]
    if draws:
        # Request b's draws fill columns 0..k_b-1 (acceptance tests) and then column K (the final
        # draw); boolean-mask assignment walks rows in order, so one concatenation fills all.
        # E.g. K = 3, k = (2, 0): mask rows [1, 1, 0, 1] and [0, 0, 0, 1] take u_0[0], u_0[1],
        # u_0[2], u_1[0] in that order.
        columns = torch.arange(k_max + 1, device=device)
        mask = (columns < num_drafts[:, None]) | (columns == k_max)
        uniforms[mask & ~greedy[:, None]] = torch.cat(draws)
    return uniforms[:, :k_max], uniforms[:, k_max]


def _check_inputs(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: DraftProbs,
    num_drafts: torch.Tensor | Sequence[int],
    greedy: torch.Tensor | Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reject malformed batches before they become token ids; returns num_drafts, greedy as tensors."""
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {list(target_probs.shape)}")
    batch, num_rows, vocab = target_probs.shape
    k_max = num_rows - 1
    device = target_probs.device
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise ValueError(
            f"draft_tokens must be [B, K] = [{batch}, {k_max}] to match target_probs "
            f"{list(target_probs.shape)}, got {list(draft_tokens.shape)}"
        )
    num_drafts = torch.as_tensor(num_drafts, dtype=torch.long, device=device)
    greedy = torch.as_tensor(greedy, dtype=torch.bool, device=device)
    if tuple(num_drafts.shape) != (batch,) or tuple(greedy.shape) != (batch,):
        raise ValueError(f"num_drafts and greedy need one entry per request ({batch})")
    if bool(((num_drafts < 0) | (num_drafts > k_max)).any()):
        raise ValueError(f"num_drafts must lie in [0, {k_max}], got {num_drafts.tolist()}")

    drafted = torch.arange(k_max, device=device) < num_drafts[:, None]  # [B, K]
    _check_target_rows(target_probs, draft_tokens, drafted, num_drafts)
    _check_draft_probs(draft_probs, drafted, num_drafts, target_probs.shape)
    return num_drafts, greedy


def _check_target_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, drafted: torch.Tensor,
                       num_drafts: torch.Tensor) -> None:
    """Draft tokens inside the vocabulary; every target row in use finite and with mass."""
    num_rows, vocab, device = target_probs.shape[1], target_probs.shape[2], target_probs.device
    tokens = draft_tokens.to(device)
    if at := _first(drafted & ((tokens < 0) | (tokens >= vocab))):
        raise ValueError(
            f"draft token {int(tokens[at])} (batch row {at[0]}, position {at[1]}) is outside [0, {vocab})"
        )

    # NaN/inf anywhere in a row makes its sum non-finite: one reduction checks every row in use.
    in_use = torch.arange(num_rows, device=device) <= num_drafts[:, None]  # [B, K+1]
    sums = target_probs.sum(-1)  # [B, K+1]
    if at := _first(in_use & ~torch.isfinite(sums)):
        raise NonFiniteLogitsError(
            f"target probabilities of batch row {at[0]} (position {at[1]}) contain NaN or inf"
        )
    if at := _first(in_use & (sums <= 0)):
        raise ValueError(f"target probabilities of batch row {at[0]} (position {at[1]}) have no mass")


def _check_draft_probs(draft_probs: DraftProbs, drafted: torch.Tensor, num_drafts: torch.Tensor,
                       shape: torch.Size) -> None:
    """Dense [B, K, V] q, or one [>= k, V] q per request (None: deterministic), finite where drafted."""
    batch, k_max, vocab = shape[0], shape[1] - 1, shape[2]
    device = drafted.device
    if isinstance(draft_probs, torch.Tensor):
        if tuple(draft_probs.shape) != (batch, k_max, vocab):
            raise ValueError(
                f"dense draft_probs must be [B, K, V] = {[batch, k_max, vocab]}, got {list(draft_probs.shape)}"
            )
        if at := _first(drafted & ~torch.isfinite(draft_probs.sum(-1))):
            raise NonFiniteLogitsError(
                f"draft probabilities of batch row {at[0]} (position {at[1]}) contain NaN or inf"
            )
        return
    if len(draft_probs) != batch:
        raise ValueError(f"draft_probs needs one entry per request ({batch}), got {len(draft_probs)}")
    owners, q_sums = [], []  # the batch row of each q_i checked, and sum(q_i)
    for row, (q, k) in enumerate(zip(draft_probs, num_drafts.tolist())):
        if q is None:
            continue
        if q.dim() != 2 or q.shape[0] < k or q.shape[1] != vocab:
            raise ValueError(
                f"draft probabilities of batch row {row} must be [>= {k}, {vocab}], got {list(q.shape)}"
            )
        owners += [row] * k
        q_sums.append(q[:k].sum(-1).to(device))
    # One host sync for the whole batch rather than one per request.
    if q_sums and (bad := (~torch.cat(q_sums).isfinite()).nonzero()).numel():
        row = owners[int(bad[0])]
        raise NonFiniteLogitsError(f"draft probabilities of batch row {row} contain NaN or inf")


def _first(mask: torch.Tensor) -> tuple[int, int] | None:
    """(row, position) of the first True in a [B, K] mask, or None."""
    if not bool(mask.any()):
        return None
    row, pos = mask.nonzero()[0].tolist()
    return row, pos
