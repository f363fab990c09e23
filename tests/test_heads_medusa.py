"""Medusa heads: identity at init (each head starts as the target's own next-token head), loss
and draft accuracy on a tiny batch, and overfitting it."""

from __future__ import annotations

import pytest
import torch

from heads_fixtures import expected_tau, make_batch, parts, train
from tandem.drafters.heads.io import build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_heads_start_as_the_target_head():
    p, batch = parts(), make_batch()
    head = build_head("medusa", p, num_heads=3)
    h = batch.hidden[p.config.num_layers][0, :5]
    logits = head.logits(h, p)
    assert logits.shape == (5, 3, p.config.vocab_size)
    for i in range(3):
        torch.testing.assert_close(logits[:, i], p.lm_head(h))


def test_overfits_a_tiny_batch():
    p, batch = parts(), make_batch()
    head = build_head("medusa", p, num_heads=3)
    before = head.draft_accuracy(batch, p, 3)
    assert before.shape == (int(batch.loss_mask.sum()), 3)
    losses = train(head, batch, p, steps=60, lr=1e-2)
    assert losses[-1] < losses[0] / 4
    after = head.draft_accuracy(batch, p, 3)
    assert expected_tau(after) > expected_tau(before) + 0.5


def test_accuracy_past_the_heads_is_false():
    p, batch = parts(), make_batch()
    head = build_head("medusa", p, num_heads=2)
    acc = head.draft_accuracy(batch, p, 4)
    assert acc.shape[1] == 4 and not acc[:, 2:].any()


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="num_heads"):
        build_head("medusa", parts(), num_heads=0)
