"""Literal cases for the chain verifier: acceptance, recovery, bonus, greedy, padding, validation, seeds."""

from __future__ import annotations

import pytest
import torch

from tandem.config import SamplingParams
from tandem.sampling import NonFiniteLogitsError, make_generator, processed_probs
from tandem.types import Draft
from tandem.verify import grading
from tandem.verify.chain import verify_chain, verify_chain_from_uniforms
from tandem.verify.grading import grade_greedy_chain

V = 6


def one_hot(token: int, vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def random_probs(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [make_generator(seed + i) for i in range(n)]


def test_all_accepted_then_bonus_from_the_last_row():
    # q = p accepts every draft (min(1, p/q) = 1); p_{k+1} is one-hot so the bonus is known.
    q = random_probs(3, V)
    target = torch.cat([q, one_hot(4)[None]])[None]  # [1, 4, V]
    drafts = torch.tensor([[1, 0, 5]])
    result = verify_chain(target, drafts, [q], torch.tensor([3]), gens(1), [False])
    assert result.tokens.tolist() == [[1, 0, 5, 4]]
    assert result.num_accepted.tolist() == [3]
    assert result.committed(0) == [1, 0, 5, 4]


def test_early_rejection_recovers_from_the_residual_and_pads():
    p1 = random_probs(V)
    p2 = one_hot(2)  # p_2(d_2) = 0 rejects d_2 = 0; max(0, p_2 - q_2) is one-hot at 2
    q2 = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    target = torch.stack([p1, p2, random_probs(V, seed=1), random_probs(V, seed=2)])[None]
    q = torch.stack([p1, q2, random_probs(V, seed=3)])
    result = verify_chain(target, torch.tensor([[3, 0, 1]]), [q], [3], gens(1), [False])
    assert result.tokens.tolist() == [[3, 2, -1, -1]]
    assert result.num_accepted.tolist() == [1]


def test_mixed_draft_lengths_in_one_batch_including_zero():
    # Row 0: k = 2, all accepted (one-hot p at the drafts), bonus from p_3.
    # Row 1: k = 0, only a token from p_1 (one-hot at 5); its draft padding is garbage.
    # Row 2: k = 1, deterministic draft rejected (p_1(d) = 0), recovered from p_1 minus d.
    target = torch.full((3, 3, V), float("nan"))  # padding rows stay NaN: never read
    target[0] = torch.stack([one_hot(1), one_hot(2), one_hot(3)])
    target[1, 0] = one_hot(5)
    target[2, :2] = torch.stack([one_hot(0), one_hot(4)])
    drafts = torch.tensor([[1, 2], [-7, 99], [3, 12345]])
    result = verify_chain(target, drafts, [None, None, None], torch.tensor([2, 0, 1]), gens(3), [False] * 3)
    assert result.tokens.tolist() == [[1, 2, 3], [5, -1, -1], [0, -1, -1]]
    assert result.num_accepted.tolist() == [2, 0, 0]


def test_whole_batch_without_drafts():
    target = torch.stack([one_hot(2), one_hot(0)])[:, None]  # [2, 1, V]
    no_drafts = torch.empty(2, 0, dtype=torch.long)
    result = verify_chain(target, no_drafts, [None, None], [0, 0], gens(2), [False, True])
    assert result.tokens.tolist() == [[2], [0]]
    assert result.num_accepted.tolist() == [0, 0]


def test_greedy_matches_plain_greedy_including_ties():
    # Logits with a tie at ids 1 and 3 on the first row: plain greedy takes torch.argmax, id 1.
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    logits[0] = torch.tensor([0.0, 2.0, 1.0, 2.0, -1.0, 0.5])
    plain = [int(t) for t in logits.argmax(-1)]
    assert plain[0] == 1
    greedy_probs = processed_probs(logits, SamplingParams(temperature=0.0))
    soft_probs = torch.softmax(logits, -1)  # the rule is argmax p, whatever p's shape
    for probs in (greedy_probs, soft_probs):
        target = probs[None]  # [1, 4, V]
        for drafts, expected in [
            (plain[:3], plain),  # all match: bonus is argmax p_4
            ([3] + plain[1:3], [1, -1, -1, -1]),  # the tied id that is not first is a mismatch
            (plain[:2] + [(plain[2] + 1) % V], plain[:3] + [-1]),
        ]:
            gen = make_generator(0)
            state = gen.get_state()
            result = verify_chain(target, torch.tensor([drafts]), [None], [3], [gen], [True])
            assert result.tokens[0].tolist() == expected
            assert torch.equal(gen.get_state(), state)  # greedy draws nothing
    result = verify_chain(greedy_probs[None], torch.tensor([plain[:3]]), [None], [3], [None], [True])
    assert result.tokens[0].tolist() == plain


def test_deterministic_draft_with_full_target_mass_is_always_accepted():
    n = 200
    target = torch.zeros(n, 2, V)
    target[:, 0, 4] = 1.0
    target[:, 1] = random_probs(V)
    result = verify_chain(target, torch.full((n, 1), 4), [None] * n, [1] * n, gens(n), [False] * n)
    assert (result.num_accepted == 1).all()
    assert (result.tokens[:, 0] == 4).all()


def test_deterministic_draft_without_target_mass_is_always_rejected_and_never_recovered():
    n = 500
    p = random_probs(V)
    p[2] = 0.0
    p /= p.sum()
    target = p.expand(n, 2, V)
    drafts = torch.full((n, 1), 2)
    result = verify_chain(target, drafts, [None] * n, [1] * n, gens(n), [False] * n)
    assert (result.num_accepted == 0).all()
    assert (result.tokens[:, 0] != 2).all()
    assert (result.tokens[:, 1] == -1).all()
    # A draft the target *does* support is still never recovered after its rejection.
    p = random_probs(V, seed=9)
    result = verify_chain(p.expand(n, 2, V), drafts, [None] * n, [1] * n, gens(n), [False] * n)
    rejected = result.num_accepted == 0
    assert 0 < int(rejected.sum()) < n
    assert (result.tokens[rejected, 0] != 2).all()


def test_empty_residual_falls_back_to_the_target_row():
    # q(d) = 0 is inconsistent input, but p(d) = 0 still rejects d; max(0, p - q) is then 0
    # everywhere (q covers p), and the recovered token is drawn from p itself.
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    n = 200
    target = torch.stack([p, one_hot(3)]).expand(n, 2, V)
    result = verify_chain(target, torch.full((n, 1), 2), [q] * n, [1] * n, gens(n), [False] * n)
    assert (result.num_accepted == 0).all()
    assert set(result.tokens[:, 0].tolist()) == {0, 1}


def test_sampled_ids_stay_inside_the_vocabulary_and_support():
    vocab, k, n = 50, 4, 300
    logits = torch.randn(n, k + 1, vocab, generator=torch.Generator().manual_seed(1)) * 3
    target = processed_probs(logits.view(-1, vocab), SamplingParams(top_k=3, min_p=0.05))
    target = target.view(n, k + 1, vocab)
    q = processed_probs(torch.randn(n * k, vocab) * 3, SamplingParams(top_p=0.7)).view(n, k, vocab)
    drafts = torch.multinomial(q.view(-1, vocab), 1).view(n, k)
    num_drafts = torch.randint(0, k + 1, (n,))
    result = verify_chain(target, drafts, list(q), num_drafts, gens(n), [False] * n)
    tokens = result.tokens
    assert ((tokens >= -1) & (tokens < vocab)).all()
    final_rows = target[torch.arange(n), result.num_accepted]
    final = tokens[torch.arange(n), result.num_accepted]
    assert (final >= 0).all()
    assert (final_rows.gather(1, final[:, None]) > 0).all()  # never a token the target filtered out


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_target_row_raises_naming_the_row(bad):
    target = random_probs(3, 3, V)
    target[1, 2, 0] = bad
    with pytest.raises(NonFiniteLogitsError, match="batch row 1"):
        verify_chain(target, torch.zeros(3, 2, dtype=torch.long), [None] * 3, [2, 2, 2], gens(3), [False] * 3)


def test_non_finite_padding_is_ignored_and_non_finite_q_raises():
    target = random_probs(2, 3, V)
    target[1, 2] = float("nan")  # row 1 drafts one token: its p_3 is padding
    drafts = torch.zeros(2, 2, dtype=torch.long)
    verify_chain(target, drafts, [None, None], [2, 1], gens(2), [False, False])
    q = random_probs(2, V)
    q[0, 3] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="batch row 1"):
        verify_chain(target, drafts, [None, q], [2, 1], gens(2), [False, False])


def test_malformed_batches_are_rejected():
    target = random_probs(1, 3, V)
    with pytest.raises(ValueError, match="outside"):
        verify_chain(target, torch.tensor([[0, V]]), [None], [2], gens(1), [False])
    with pytest.raises(ValueError, match="num_drafts"):
        verify_chain(target, torch.tensor([[0, 1]]), [None], [3], gens(1), [False])
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_chain(target, torch.tensor([[0, 1, 2]]), [None], [2], gens(1), [False])
    with pytest.raises(ValueError, match="generator"):
        verify_chain(target, torch.tensor([[0, 1]]), [None], [2], [None], [False])


def _batch(n: int = 8, k: int = 4, seed: int = 3):
    target = random_probs(n, k + 1, V, seed=seed)
    q = random_probs(n, k, V, seed=seed + 1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=torch.Generator().manual_seed(seed)).view(n, k)
    draft_probs = [q[b] if b % 2 else None for b in range(n)]
    num_drafts = torch.arange(n) % (k + 1)
    greedy = [b % 3 == 0 for b in range(n)]
    return target, drafts, draft_probs, num_drafts, greedy


def test_same_seeds_reproduce_and_batching_does_not_change_a_request():
    target, drafts, draft_probs, num_drafts, greedy = _batch()
    first = verify_chain(target, drafts, draft_probs, num_drafts, gens(8, seed=10), greedy)
    again = verify_chain(target, drafts, draft_probs, num_drafts, gens(8, seed=10), greedy)
    assert torch.equal(first.tokens, again.tokens)
    for b in range(8):
        k = int(num_drafts[b])
        alone = verify_chain(
            target[b : b + 1, : k + 1], drafts[b : b + 1, :k], [draft_probs[b]], [k],
            [make_generator(10 + b)], [greedy[b]],
        )
        assert alone.committed(0) == first.committed(b)


def test_generator_contract_matches_the_uniform_entry_point():
    # A sampled request with k drafts draws k + 1 fp64 uniforms: k acceptance tests, then the final draw.
    target, drafts, draft_probs, num_drafts, greedy = _batch(seed=7)
    result = verify_chain(target, drafts, draft_probs, num_drafts, gens(8, seed=20), greedy)
    accept_u = torch.zeros(8, 4, dtype=torch.float64)
    draw_u = torch.zeros(8, dtype=torch.float64)
    for b in range(8):
        if not greedy[b]:
            k = int(num_drafts[b])
            u = torch.rand(k + 1, generator=make_generator(20 + b), dtype=torch.float64)
            accept_u[b, :k], draw_u[b] = u[:k], u[k]
    expected = verify_chain_from_uniforms(target, drafts, draft_probs, num_drafts, accept_u, draw_u, greedy)
    assert torch.equal(result.tokens, expected.tokens)


def test_dense_and_per_request_draft_probs_agree():
    n, k = 16, 3
    target = random_probs(n, k + 1, V, seed=4)
    q = random_probs(n, k, V, seed=5)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=torch.Generator().manual_seed(6)).view(n, k)
    u = torch.rand(n, k + 1, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    args = ([k] * n, u[:, :k], u[:, k], [False] * n)
    dense = verify_chain_from_uniforms(target, drafts, q, *args)
    listed = verify_chain_from_uniforms(target, drafts, list(q), *args)
    assert torch.equal(dense.tokens, listed.tokens)
    assert 0 < int(dense.num_accepted.sum()) < n * k


def test_extreme_uniforms_never_pick_a_filtered_token():
    # The draw searches blocks of 1024 tokens, then a token in the block: cover an empty first
    # block, block edges, a short last block and the extreme uniforms 0 and 1 - 2^-53.
    vocab = 2100
    p = torch.zeros(vocab)
    p[[1024, 1500, 2047, 2048, 2098]] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    uniforms = torch.tensor([0.0, 1 - 2**-53, 0.1 - 1e-12, 0.1 + 1e-12, 0.5, 0.9999999], dtype=torch.float64)
    n = len(uniforms)
    result = verify_chain_from_uniforms(
        p.expand(n, 1, vocab), torch.empty(n, 0, dtype=torch.long), [None] * n, [0] * n,
        torch.empty(n, 0, dtype=torch.float64), uniforms, [False] * n,
    )
    tokens = result.tokens[:, 0]
    assert (p[tokens] > 0).all()
    # Inverse CDF on (1 - u): u = 0 takes the last token, u -> 1 the first.
    assert tokens[0] == 2098 and tokens[1] == 1024


def test_degenerate_top_p_and_temperature_keep_a_valid_distribution():
    """top_p below fp32's smallest value and a denormal temperature (both accepted by the API)
    still give a distribution: the top token survives top-p; tiny temperatures act as greedy."""
    from tandem.config import SamplingParams
    from tandem.sampling import processed_probs

    logits = torch.tensor([[1.0, 3.0, 2.0]])
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]]))
    tiny = SamplingParams(temperature=5e-324)
    assert tiny.greedy
    assert torch.equal(processed_probs(logits, tiny), torch.tensor([[0.0, 1.0, 0.0]]))


def test_greedy_chain_fast_path_commits_what_the_dense_rule_commits():
    """grading.grade_greedy_chain (greedy, no penalty: no probability rows) against verify_chain
    over processed_probs' one-hot rows, on logits full of ties and drafts right and wrong."""
    gen = torch.Generator().manual_seed(3)
    outcomes = set()
    for _ in range(300):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        logits = torch.randint(0, 3, (n + 1, 6), generator=gen).float()  # ties in most rows
        best = logits.argmax(-1)
        drafted = [int(best[i]) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, 6, (1,), generator=gen))
                   for i in range(n)]
        probs = processed_probs(logits, SamplingParams(temperature=0.0))
        dense = verify_chain(probs[None], torch.tensor([drafted]), [None], torch.tensor([n]), [None], [True])
        accepted = int(dense.num_accepted[0])
        assert grade_greedy_chain(logits, drafted) == (dense.committed(0), list(range(accepted)))
        outcomes.add((n, accepted))
    assert len(outcomes) > 12  # every acceptance length was seen, not only all-or-nothing
    bad = torch.zeros(3, 6)
    bad[2, 1] = float("nan")
    with pytest.raises(NonFiniteLogitsError):
        grade_greedy_chain(bad, [0, 0])


def test_presence_and_frequency_penalties_subtract_from_generated_tokens_only():
    """logit[t] -= presence * (c_t > 0) + frequency * c_t, with c_t counted over the tokens after
    the prompt; the repetition penalty still sees prompt and output."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0]])
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    context, prompt = [5, 0, 1, 1, 1, 3], 2  # generated: 1 x3, 3 x1; the prompt's 5 and 0 do not count
    counts = grading.output_counts(context, params, prompt)
    assert counts[0].tolist() == [1, 3] and counts[1].tolist() == [3.0, 1.0]
    expected = logits.clone()
    expected[0, 1] -= 0.5 + 0.25 * 3
    expected[0, 3] -= 0.5 + 0.25 * 1
    assert torch.allclose(processed_probs(logits, params, None, counts), torch.softmax(expected, -1))
    assert grading.output_counts(context, params, None)[0].numel() == 0  # all prompt: nothing generated
    assert grading.output_counts(context, SamplingParams(), prompt) is None
    # Negative penalties reward repeats; combined with the repetition penalty (applied first).
    both = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=-1.0)
    expected = logits.clone()
    for t in set(context):
        expected[0, t] = expected[0, t] / 2.0 if expected[0, t] > 0 else expected[0, t] * 2.0
    expected[0, 1] += 3.0
    expected[0, 3] += 1.0
    got = processed_probs(logits, both, grading.seen_ids(context, both), grading.output_counts(context, both, prompt))
    assert torch.allclose(got, torch.softmax(expected, -1))


def test_penalised_rows_count_the_drafts_on_their_path():
    """Row i of a penalised round counts d_1..d_i as generated, as plain decoding would after
    committing them; greedy grading then compares argmaxes of the penalised rows."""
    logits = torch.zeros(3, V)
    logits[:, 2] = 1.0  # every raw row's argmax is 2
    logits[:, 4] = 0.9
    params = SamplingParams(temperature=0.0, presence_penalty=0.2)
    draft = Draft([2, 2])
    rows = grading.target_probs(logits, draft, params, [1, 1], num_prompt_tokens=2)
    # row 0: nothing generated yet -> 2; rows 1 and 2 have 2 generated: 1.0 - 0.2 < 0.9 -> 4
    assert rows.argmax(-1).tolist() == [2, 4, 4]
    committed, path = grading.grade_round(logits, draft, params, [1, 1], None, num_prompt_tokens=2)
    assert committed == [2, 4] and path == [0]
    # Unpenalised, the same round accepts both drafts.
    assert grading.grade_round(logits, draft, SamplingParams(temperature=0.0), [1, 1], None, 2)[0] == [2, 2, 2]


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, float("nan")])
def test_output_penalties_outside_openais_range_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
