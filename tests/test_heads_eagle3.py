"""EAGLE-3 head: layer choice, the draft vocabulary (from ids or counts) and its map back to
target ids, the training-time test's attention (a chain sees true features only up to its
start), and overfitting a tiny batch."""

from __future__ import annotations

import pytest
import torch

from heads_fixtures import expected_tau, make_batch, parts, train
from tandem.drafters.heads.base import target_logits
from tandem.drafters.heads.eagle3 import default_layers, draft_vocab_from_counts
from tandem.drafters.heads.io import build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_layers():
    assert default_layers(30) == (1, 14, 26)  # SmolLM2-135M: EAGLE-3's hidden_states 2, 15, 27
    assert default_layers(4) == (0, 1, 3)


def test_draft_vocab_from_counts_keeps_the_most_frequent():
    counts = torch.zeros(50)
    counts[[7, 3, 40, 12]] = torch.tensor([5.0, 9.0, 1.0, 5.0])
    assert draft_vocab_from_counts(counts, 3, 50) == [3, 7, 12]  # tie 7/12 both kept; 40 dropped
    assert draft_vocab_from_counts({3: 9, 12: 5, 7: 5}, 2, 50) == [3, 7]  # ties: lower id first
    with pytest.raises(ValueError, match="cover the target vocab"):
        draft_vocab_from_counts(torch.ones(10), 3, 50)


def test_every_draft_id_maps_to_its_target_id():
    p = parts()
    ids = list(range(3, 97, 2))
    head = build_head("eagle3", p, draft_vocab=ids)
    assert head.draft_vocab_size == len(ids) and head.draft_ids.tolist() == ids
    assert head.to_target_ids(torch.arange(len(ids))).tolist() == ids
    # The LM head starts as the target's rows of those ids: draft index i scores target id ids[i].
    h = torch.randn(5, p.config.hidden_size)
    full = p.lm_head(p.final_norm(h))
    torch.testing.assert_close(head.head_logits(h, p), full[:, ids], rtol=1e-4, atol=1e-4)
    members = head.in_draft_vocab(torch.arange(97))
    assert members.sum() == len(ids) and members[ids].all()


def test_counts_build_the_vocab():
    p, batch = parts(), make_batch()
    counts = torch.bincount(batch.token_ids[batch.loss_mask], minlength=97)
    head = build_head("eagle3", p, token_counts=counts, draft_vocab_size=20)
    assert head.draft_ids.tolist() == draft_vocab_from_counts(counts, 20, 97)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_head("eagle3", p, token_counts=counts)
    with pytest.raises(ValueError, match="not both"):
        build_head("eagle3", p, token_counts=counts, draft_vocab=[1, 2], draft_vocab_size=2)
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        build_head("eagle3", p, draft_vocab=[5, 97])
    with pytest.raises(ValueError, match="3 target layers"):
        build_head("eagle3", p, layers=[0, 1])


def test_unrolled_chain_sees_true_features_only_up_to_its_start():
    p, batch = parts(), make_batch()
    head = build_head("eagle3", p, unroll_steps=3).eval()
    out = head.unroll(batch, p, 3)
    edited = type(batch)(batch.token_ids, batch.lengths, batch.loss_mask, {k: v.clone() for k, v in batch.hidden.items()})
    for layer in head.serving_layers:
        edited.hidden[layer][:, 12] += 1.0  # the true feature at position 12 only
    out2 = head.unroll(edited, p, 3)
    for s in range(3):
        # Chains starting before 12 never see position 12's feature, at any step.
        torch.testing.assert_close(out2[s][:, :12], out[s][:, :12])
        assert not torch.allclose(out2[s][:, 12], out[s][:, 12])


def test_overfits_a_tiny_batch_with_a_reduced_vocab():
    p, batch = parts(), make_batch(self_distilled=True)
    counts = torch.bincount(p.lm_head(batch.hidden[p.config.num_layers])[batch.loss_mask].argmax(-1), minlength=97)
    head = build_head("eagle3", p, token_counts=counts, draft_vocab_size=40, unroll_steps=3)
    before = head.draft_accuracy(batch, p, 3)
    losses = train(head, batch, p, steps=30, lr=3e-3)
    assert losses[-1] < losses[0] / 8
    assert expected_tau(head.draft_accuracy(batch, p, 3)) > expected_tau(before) + 1.0


def test_target_logits_over_a_column_subset_equal_the_full_logits_sliced():
    p, batch = parts(), make_batch()
    hidden = batch.hidden[p.config.num_layers][batch.loss_mask]
    columns = torch.tensor([5, 0, 96, 40])
    assert torch.allclose(target_logits(p, hidden, columns), target_logits(p, hidden)[:, columns], atol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_unrolling_only_the_graded_chains_computes_the_same_chains(method):
    """Training runs steps >= 1 only over each row's span of graded chain starts (prompt chains
    are skipped): those chains' outputs, and so the loss, equal the run over every start."""
    from tandem.drafters.heads.eagle import graded_starts

    p, batch = parts(), make_batch(prompt_len=10)
    head = build_head(method, p, unroll_steps=4).eval()
    starts = graded_starts(batch.loss_mask, 4)
    b0, j0 = starts.nonzero(as_tuple=True)
    assert int(j0.min()) > 0 and bool(starts[:, -2:].any()) is False  # the prompt's chains are really left out
    full = head.unroll(batch, p, 4)
    part = head.unroll(batch, p, 4, starts=starts)
    torch.testing.assert_close(part[0], full[0])
    for s in range(1, 4):
        torch.testing.assert_close(part[s][b0, j0], full[s][b0, j0])
        outside = ~starts
        outside[:, int(j0.min()) :] = False  # before every row's first graded start: not computed
        assert not part[s][outside].any()
    # Arbitrary wanted starts, including a row with none and one wanting only its last start.
    wanted = torch.zeros_like(batch.loss_mask)
    wanted[0, [3, 9, 15]] = True
    wanted[2, -1] = True
    part = head.unroll(batch, p, 3, starts=wanted)
    b, j = wanted.nonzero(as_tuple=True)
    for s in range(1, 3):
        torch.testing.assert_close(part[s][b, j], full[s][b, j])
        assert not part[s][1].any()


def test_start_span():
    from tandem.drafters.heads.eagle import _start_span

    starts = torch.tensor([[False, True, False, True, False], [False] * 5, [False, False, False, False, True]])
    index, valid = _start_span(starts)
    assert index.tolist() == [[1, 2, 3], [0, 1, 2], [4, 4, 4]]
    assert valid.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    assert _start_span(None) is None
