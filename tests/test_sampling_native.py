"""The kernels' sampling section (block_matmul.cpp): the default processing (temperature and
min-p), its draws and the chain rule, against torch's processing, the distribution and a
reference written out here."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tandem import sampling
from tandem.config import SamplingParams
from tandem.model.kernels import RowProcessing, SampleStatus, block_kernels, load_variant, supported_variants
from tandem.sampling import NonFiniteLogitsError, native_sampling, processed_probs, sample_processed
from tandem.verify import grading

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(block_kernels() is None, reason="tandem's CPU kernels do not run here"),
]

INF = float("inf")


def kernels():
    return block_kernels()


def logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def torch_probs(x: torch.Tensor, params: SamplingParams, shift: torch.Tensor | None = None) -> torch.Tensor:
    """processed_probs on torch's path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "native_sampling", lambda *_: None)
        return processed_probs(x, params, shift=shift)


def test_which_requests_take_the_kernels_path():
    x = logits(1, 64, 0)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, min_p=0.1, top_k=5, top_p=0.9)):
        assert native_sampling(params, x) is not None, params
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, repetition_penalty=1.2),
                   SamplingParams(temperature=1.0, presence_penalty=0.5)):
        assert native_sampling(params, x) is None, params


@pytest.mark.parametrize("vocab", [5, 64, 1000, 49152])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 40, 1.0, 0.0), (0.8, 0, 0.9, 0.0),
    (1.0, 0, 0.5, 0.0), (0.7, 50, 0.95, 0.02), (1.0, 3, 0.3, 0.0), (1.0, 0, 0.999, 0.0)])
def test_the_processed_rows_match_torch(vocab, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    x = logits(3, vocab, vocab)
    shift = torch.zeros(3, vocab)
    shift[0, ::3] = -INF  # refused tokens (structured output)
    shift[1, :2] = 4.0  # a logit bias
    p = processed_probs(x, params, shift=shift)
    ref = torch_probs(x, params, shift)
    assert torch.allclose(p, ref, atol=2e-6, rtol=1e-5)
    assert (p[ref == 0] == 0).all() and (p[ref > 0] > 0).all()  # the same support
    assert torch.allclose(p.sum(-1), torch.ones(3), atol=1e-5)


def test_the_rows_are_the_same_on_every_variant_and_thread_count():
    x = logits(4, 3000, 1)
    uniforms = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    args = (x, RowProcessing(1 / 0.8, top_k=900, top_p=0.95, min_p=0.01), uniforms)
    p0, t0, _ = load_variant(supported_variants()[0]).sample_rows(*args)
    for variant in supported_variants():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p, t, status = load_variant(variant).sample_rows(*args)
            assert torch.equal(p, p0) and torch.equal(t, t0) and (status == SampleStatus.SAMPLED).all()
    torch.set_num_threads(1)


def test_draws_follow_the_processed_distribution():
    params = SamplingParams(temperature=0.7, min_p=0.02)
    x = logits(1, 40, 3)
    shift = torch.zeros(1, 40)
    shift[0, 5:9] = -INF
    p = processed_probs(x, params, shift=shift)[0]
    n = 100_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _, tokens, status = kernels().sample_rows(x.expand(n, 40), RowProcessing(1 / 0.7, min_p=0.02), uniforms, shift,
                                              probs=False)
    assert (status == 0).all()
    counts = torch.bincount(tokens, minlength=40)
    assert counts[p == 0].sum() == 0  # refused and min-p-filtered tokens are never drawn
    support = p > 0
    expected = p[support].double() / p[support].double().sum() * n
    assert chisquare(counts[support].double().numpy(), expected.numpy()).pvalue > 1e-4


def test_a_seeded_draw_repeats_and_plain_sampling_draws_through_the_kernels():
    params = SamplingParams(temperature=1.0, seed=7)
    x = logits(3, 500, 5)
    draws = [[grading.sample_plain(x, params, [1, 2], torch.Generator().manual_seed(7)) for _ in range(3)]
             for _ in range(2)]
    assert draws[0] == draws[1]
    q, token = sample_processed(x[-1:], params, torch.Generator().manual_seed(7))
    assert token == draws[0][0] and q[0, token] > 0  # one uniform per row, as sample takes


def test_broken_rows_raise():
    params = SamplingParams(temperature=1.0)
    for bad in (float("nan"), INF, -INF):
        x = logits(2, 70, 6)
        x[1, 33] = bad
        with pytest.raises(NonFiniteLogitsError):
            processed_probs(x, params)
    assert processed_probs(torch.zeros(0, 70), params).shape == (0, 70)  # no rows: nothing to do
    refused = torch.full((1, 70), -INF)
    with pytest.raises(NonFiniteLogitsError, match="refuses every token"):
        processed_probs(logits(1, 70, 7), params, shift=refused)


def reference_grade(p: torch.Tensor, draft: list[int], q: torch.Tensor | None, u: torch.Tensor) -> tuple[int, int]:
    """The chain rule written out (docs/algorithms.md section 1) over processed rows p [k + 1, V]."""

    def draw(weights: torch.Tensor, uniform: float) -> int:
        run, target = 0.0, uniform * float(weights.double().sum())
        last = -1
        for t, w in enumerate(weights.tolist()):
            if w > 0:
                last, run = t, run + w
                if run > target:
                    return t
        return last

    for i, d in enumerate(draft):
        q_at = 1.0 if q is None else float(q[i, d])
        if float(u[i]) * q_at < float(p[i, d]):
            continue
        if q is None:
            rest = p[i].clone()
            rest[d] = 0
        else:
            rest = (p[i] - q[i]).clamp(min=0)
        return i, draw(rest if rest.sum() > 0 else p[i], float(u[-1]))
    return len(draft), draw(p[len(draft)], float(u[-1]))


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (8, 0.9)])
def test_the_chain_rule_matches_the_reference(sampled, top_k, top_p):
    gen = torch.Generator().manual_seed(8)
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=0.01)
    for trial in range(300):
        vocab, k = 30 + trial % 17, 1 + trial % 4
        x = logits(k + 1, vocab, 100 + trial, scale=1.5)
        p = processed_probs(x, params)
        q = processed_probs(x[:k] + logits(k, vocab, 500 + trial, scale=0.7), params) if sampled else None
        draft = [int(torch.multinomial(q[i] if sampled else p[i], 1, generator=gen)) for i in range(k)]
        u = torch.rand(k + 1, dtype=torch.float64, generator=gen)
        got = kernels().grade_chain(x, torch.tensor(draft), q, u, RowProcessing(1 / 0.9, top_k, top_p, 0.01))
        assert got[:2] == reference_grade(p, draft, q, u) and got[2] == SampleStatus.SAMPLED, trial


def test_the_chain_rule_commits_the_target_distribution():
    """Rows fixed in advance: the token committed at position j, among rounds that reach j, is
    distributed as p_j whatever the drafts were (sampled from a q that differs from p)."""
    vocab, k, rounds = 12, 2, 30_000
    params = SamplingParams(temperature=1.0)
    x = logits(k + 1, vocab, 9)
    p = processed_probs(x, params)
    q = processed_probs(x[:k] + logits(k, vocab, 10, scale=1.0), params)
    gen = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[i], rounds, replacement=True, generator=gen) for i in range(k)], 1)
    uniforms = torch.rand(rounds, k + 1, dtype=torch.float64, generator=gen)
    at = [[] for _ in range(k + 1)]
    for r in range(rounds):
        accepted, token, _ = kernels().grade_chain(x, drafts[r], q, uniforms[r], RowProcessing(1.0))
        committed = drafts[r, :accepted].tolist() + [token]
        for j, t in enumerate(committed):
            at[j].append(t)
    for j in range(k + 1):
        counts = torch.bincount(torch.tensor(at[j]), minlength=vocab).double()
        assert len(at[j]) > 2000
        expected = p[j].double() / p[j].double().sum() * len(at[j])
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4, j


def test_bad_drafts_are_refused():
    x = logits(3, 40, 12)
    u = torch.rand(3, dtype=torch.float64)
    assert kernels().grade_chain(x, torch.tensor([3, 40]), None, u, RowProcessing(1.0))[2] == SampleStatus.BAD_TOKEN
    q = torch.full((2, 40), 1 / 40)
    q[1, 7] = float("nan")
    assert kernels().grade_chain(x, torch.tensor([3, 4]), q, u, RowProcessing(1.0))[2] == SampleStatus.BAD_DRAFT_PROBS
    x[2, 0] = INF
    assert kernels().grade_chain(x, torch.tensor([3, 4]), None, torch.zeros(3, dtype=torch.float64),
                                 RowProcessing(1.0))[2] == SampleStatus.NON_FINITE


def test_a_draft_vocabulary_reports_q_over_the_targets():
    """into=(ids, width): q of row index t lands at ids[t] of a `width`-wide row, zeros elsewhere,
    on the kernels' path and torch's alike; the token stays a row index."""
    x = logits(1, 300, 13)
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(14))[:300]
    params = SamplingParams(temperature=0.8)
    q, token = sample_processed(x, params, torch.Generator().manual_seed(15), into=(ids, 1000))
    assert q.shape == (1, 1000) and torch.equal(q[0, ids], processed_probs(x, params)[0])
    assert q.sum() == q[0, ids].sum() and q[0, ids[token]] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "native_sampling", lambda *_: None)
        q_torch, _ = sample_processed(x, params, torch.Generator().manual_seed(15), into=(ids, 1000))
    assert torch.allclose(q, q_torch, atol=2e-6) and torch.equal(q == 0, q_torch == 0)


def test_a_batch_draws_what_each_request_draws_alone(monkeypatch):
    """The engine draws the tokens of a round's sampled requests without a draft in one kernel
    call (grading.sample_plain_rows): seeded requests decoded together get the tokens they get
    one at a time, where each round's draw is sample_plain's."""
    from conftest import tiny_loaded
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine

    _, loaded = tiny_loaded("llama")
    prompts = [[5 + i, 17, 33, 8 + i] for i in range(10)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40 * (i % 2), max_tokens=6, seed=i) for i in range(10)]
    batched = []
    real = grading.sample_plain_rows
    monkeypatch.setattr(grading, "sample_plain_rows", lambda *a: batched.append(len(a[2])) or real(*a))

    def run(indices):
        engine = Engine(loaded, EngineConfig(max_model_len=64, max_num_seqs=10))
        reqs = [engine.add_request(prompts[i], params[i]) for i in indices]
        while engine.has_work():
            engine.step()
        return [r.output().token_ids for r in reqs]

    together = run(range(10))
    assert batched and max(batched) == 10
    assert together == [run([i])[0] for i in range(10)]
