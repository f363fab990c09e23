"""EAGLE-1 head: the unrolled chain's first step is the plain sequence forward, loss terms, and
overfitting a tiny batch (feature regression + token loss)."""

from __future__ import annotations

import pytest
import torch

from heads_fixtures import expected_tau, make_batch, parts, train
from tandem.drafters.heads.io import build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_first_step_reads_the_true_features_causally():
    """Changing the sequence after position j must not change step outputs at or before j."""
    p, batch = parts(), make_batch()
    head = build_head("eagle", p).eval()
    out = head.unroll(batch, p, 2)
    L = p.config.num_layers
    edited = type(batch)(batch.token_ids.clone(), batch.lengths, batch.loss_mask, {L: batch.hidden[L].clone()})
    edited.hidden[L][:, 10:] += 1.0
    edited.token_ids[:, 11:] = 5
    out2 = head.unroll(edited, p, 2)
    torch.testing.assert_close(out2[0][:, :10], out[0][:, :10])
    torch.testing.assert_close(out2[1][:, :9], out[1][:, :9])  # step 1 of chain j reads x_{j+2}
    assert not torch.allclose(out2[0][:, 10:], out[0][:, 10:])


def test_loss_reports_both_terms():
    p, batch = parts(), make_batch()
    head = build_head("eagle", p, unroll_steps=2)
    loss, metrics = head.training_loss(batch, p)
    assert loss.requires_grad and torch.isfinite(loss)
    assert {"feature_loss_step0", "token_loss_step0", "feature_loss_step1", "loss"} <= set(metrics)


def test_overfits_a_tiny_batch():
    p, batch = parts(), make_batch()
    head = build_head("eagle", p)
    before = head.draft_accuracy(batch, p, 3)
    losses = train(head, batch, p, steps=30, lr=3e-3)
    assert losses[-1] < losses[0] / 8
    assert expected_tau(head.draft_accuracy(batch, p, 3)) > expected_tau(before) + 1.0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unroll_steps"):
        build_head("eagle", parts(), unroll_steps=0)
