"""Logits -> processed probability vectors, and seeded draws from them.

The processed vector is exactly what plain sampling draws from; the verifier compares drafts
against the same vectors (docs/algorithms.md section 1). Order: repetition penalty, presence and
frequency penalties, temperature, top-k, top-p, min-p, then renormalise, all in fp32.

On a CPU with tandem's kernels, a sampled request without a penalty (temperature, top-k,
top-p, min-p) is processed, drawn from and graded by the kernels' sampling section
(block_matmul.cpp; `native_sampling` says when), in one pass per row instead of a dozen tensor
operations. Plain sampling, the drafters, the verifier and `tandem audit` all take that path for
such a request, so each of its rows has one p wherever it is read.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.config import SamplingParams
from tandem.model.kernels import BlockKernels, RowProcessing, SampleStatus, block_kernels
from tandem.types import TokenLogprob


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN/inf logits for a request (or a row whose every token is refused):
    it is ended, never turned into token ids."""


def native_sampling(params: SamplingParams, logits: torch.Tensor) -> BlockKernels | None:
    """The kernels that process, draw from and grade these rows of logits [N, V] for this
    request, or None where torch does: a sampled request without a penalty (its processing is
    temperature, top-k, top-p and min-p), on a CPU where tandem's kernels run."""
    if params.greedy or params.penalized or logits.device.type != "cpu":
        return None
    return block_kernels()


def row_processing(params: SamplingParams) -> RowProcessing:
    """A request's processing as the sampling kernels read it."""
    return RowProcessing(1.0 / params.temperature, params.top_k, params.top_p, params.min_p)


def status_error(status: int) -> Exception | None:
    """The error a SampleStatus stands for (None for SAMPLED)."""
    if status == SampleStatus.NON_FINITE:
        return NonFiniteLogitsError("the model produced NaN or inf logits")
    if status == SampleStatus.NO_MASS:
        return NonFiniteLogitsError("the request's logit shift (structured output, logit bias) refuses every token")
    if status == SampleStatus.BAD_TOKEN:
        return ValueError("a draft token is outside the vocabulary")
    if status == SampleStatus.BAD_DRAFT_PROBS:
        return NonFiniteLogitsError("the draft probabilities contain NaN or inf")
    return None


def raise_for_status(status: int) -> None:
    """Raise the error a SampleStatus other than SAMPLED stands for."""
    if (err := status_error(status)) is not None:
        raise err


def native_rows(kernels: BlockKernels, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None, shift: torch.Tensor | None = None,
                probs: bool = True, into: tuple[torch.Tensor, int] | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernels' processed distribution of each row of logits [N, V] (probs=True; into: as
    BlockKernels.sample_rows') and, given a generator, one draw from each (one fp64 uniform per
    row, as `sample` takes): (p [N, V] or None, tokens [N] or None). Raises
    NonFiniteLogitsError on NaN or inf logits."""
    rows = logits.shape[0]
    uniforms = None if generator is None else torch.rand(rows, generator=generator, dtype=torch.float64)
    out, tokens, status = kernels.sample_rows(logits, row_processing(params), uniforms, shift, probs, into)
    for code in status.tolist():
        raise_for_status(code)
    return out, tokens


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, the first index on ties (as torch.argmax). CPU float rows go
    through NumPy: over 49k-wide logit rows its argmax measured 15x faster than torch 2.13's
    (17 us against 260 us for 3 rows), which is most of a round's bookkeeping. Other rows (bf16,
    GPU) take max(-1).indices, the same first index in half torch.argmax's time on a CPU."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1), dtype=np.int64))
    return x.detach().max(-1).indices


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or inf in x. The sum is finite exactly when every element is, unless finite
    elements overflow it, which the elementwise check then settles (a sum costs about a
    twentieth of torch.isfinite over logits)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """all_finite for each row of x [R, V] at once: [R] bool (the elementwise check only where a
    row's sum is not finite)."""
    finite = torch.isfinite(x.sum(-1))
    if not bool(finite.all()):
        finite |= torch.isfinite(x).all(-1)
    return finite


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already present: positive logits divided, negative multiplied."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[..., seen_ids]
    logits[..., seen_ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_output_penalties(logits: torch.Tensor, output_counts: tuple[torch.Tensor, torch.Tensor],
                           presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit[t] -= presence + frequency * c_t for each
    generated token t, c_t the times it was generated (output_counts: (ids, counts))."""
    ids, counts = output_counts
    if ids.numel() == 0 or (presence == 0.0 and frequency == 0.0):
        return logits
    logits = logits.clone()
    logits[..., ids] -= presence + frequency * counts.to(logits.dtype)
    return logits


def processed_probs(
    logits: torch.Tensor,
    params: SamplingParams,
    seen_ids: torch.Tensor | None = None,
    output_counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities that plain sampling draws from.

    seen_ids: the distinct ids of prompt and output (the repetition penalty's); output_counts:
    (ids, counts) of the generated tokens (the presence and frequency penalties'); shift: [N, V]
    added to the logits before anything else (`shifted`). Greedy (temperature 0) gives the
    one-hot vector of the argmax of the penalised logits.
    """
    kernels = native_sampling(params, logits)
    if kernels is not None:
        return native_rows(kernels, logits, params, shift=shift)[0]
    logits = logits.float()
    if not all_finite(logits):
        raise NonFiniteLogitsError("the model produced NaN or inf logits")
    logits = shifted(logits, shift)
    if seen_ids is not None:
        logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    if output_counts is not None:
        logits = apply_output_penalties(logits, output_counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, row_argmax(logits).unsqueeze(-1).to(logits.device), 1.0)
        return probs
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p (so the most likely token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        # A top_p below fp32's smallest value compares as 0: the top token must still stay.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_processed(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                     seen_ids: torch.Tensor | None = None, into: tuple[torch.Tensor, int] | None = None
                     ) -> tuple[torch.Tensor, int]:
    """A drafter's token from one row of logits [1, V]: (its processed distribution q [1, V],
    the token drawn from q, or q's argmax for a greedy request). into=(ids [V], width): q is
    reported over `width` tokens, q_t at ids[t] and zero elsewhere (a draft vocabulary's q over
    the target's); the token stays an index of the row. Raises NonFiniteLogitsError on NaN or
    inf logits."""
    kernels = native_sampling(params, logits)
    if kernels is not None:
        q, tokens = native_rows(kernels, logits, params, generator, into=into)
        return q, int(tokens[0])
    q = processed_probs(logits, params, seen_ids)
    token = int(row_argmax(q[0])) if params.greedy else int(sample(q, generator)[0])
    if into is not None:
        ids, width = into
        q = torch.zeros(1, width, dtype=q.dtype, device=q.device).index_copy_(1, ids.to(q.device), q)
    return q, token


def shifted(logits: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """logits + shift: what a request does to the target's logits before anything else, -inf
    for the tokens its structured output refuses (tandem.grammar) and its logit_bias; 0 leaves a
    logit exactly as it was. Unchanged without a shift."""
    return logits if shift is None else logits + shift.to(logits.device)


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the raw distribution of its row of logits [len(tokens),
    V] (log_softmax, fp32), with that row's `top` most likely tokens."""
    logp = torch.log_softmax(rows.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


# A seeded request's generator on another device than the target's (a drafter sampling there)
# is seeded seed + this, so it is reproducible without sharing the target generator's stream.
OTHER_DEVICE_SEED_OFFSET = 0x5EED


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A per-request generator: a fixed seed reproduces the request, None draws a fresh seed.

    CPU and CUDA generators are different random streams: the same seed gives different tokens
    on each device (each is reproducible on its own)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of [N, V] probabilities (unnormalised is fine) -> [N] token ids.

    By the inverse of the cumulative distribution: one uniform u per row, and the first token whose
    cumulative probability exceeds u times the row's total. The sums are float64, so rounding
    moves no token's share by more than about 1e-11 even over 262k tokens; a token of probability
    0 is never drawn. One uniform per row instead of torch.multinomial's work over the whole
    vocabulary: about 0.08 ms against 1.0 ms for SmolLM2's 49,152 tokens on a CPU."""
    if generator.device.type != probs.device.type:
        raise ValueError(f"a generator on {generator.device} cannot draw from probabilities on {probs.device}: "
                         "keep each generator on the device its draws happen on")
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    # u * total may round up to total itself (about once in 2^53 draws): the point then stays just
    # below it, where the last token of positive probability is the first whose sum exceeds it
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
