"""MTP head: module k's attention sees exactly the positions a drafter can have settled (keys
<= i - (k - 1) and its own), causality in its inputs, and overfitting a tiny batch."""

from __future__ import annotations

import pytest
import torch

from heads_fixtures import expected_tau, make_batch, parts, train
from tandem.drafters.heads.io import build_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_module_k_sees_keys_up_to_i_minus_k_plus_1_and_itself():
    from tandem.drafters.heads.block import visible

    pos = torch.arange(6)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    head = build_head("mtp", parts(), depth=3)
    assert [m.gap for m in head.mtp] == [0, 1, 2]
    assert torch.equal(visible(pos, pos, 0), causal) and torch.equal(visible(pos, pos, 1), causal)
    # Module 3 at i needs x_{i+3}: when drafting from m - 1, positions up to m - 3 are settled.
    expected = torch.tril(torch.ones(6, 6, dtype=torch.bool), diagonal=-2) | torch.eye(6, dtype=torch.bool)
    assert torch.equal(visible(pos, pos, 2), expected)


def test_modules_are_causal_in_their_inputs():
    """Editing the sequence from position 10 on changes no module output before 10."""
    p, batch = parts(), make_batch()
    head = build_head("mtp", p, depth=3).eval()
    L = p.config.num_layers
    edited = type(batch)(batch.token_ids.clone(), batch.lengths, batch.loss_mask, {k: v.clone() for k, v in batch.hidden.items()})
    edited.hidden[L - 1][:, 10:] += 1.0
    edited.token_ids[:, 10:] = 5
    for k, (a, b) in enumerate(zip(head.run_all(batch, p), head.run_all(edited, p)), start=1):
        cut = 10 - k  # module k at i reads x_{i+k}
        torch.testing.assert_close(b[:, :cut], a[:, :cut])
        assert not torch.allclose(b[:, cut:], a[:, cut:])


def test_overfits_a_tiny_batch():
    p, batch = parts(), make_batch()
    head = build_head("mtp", p, depth=3)
    before = head.draft_accuracy(batch, p, 3)
    losses = train(head, batch, p, steps=30, lr=3e-3)
    assert losses[-1] < losses[0] / 4
    assert expected_tau(head.draft_accuracy(batch, p, 3)) > expected_tau(before) + 0.5


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="depth"):
        build_head("mtp", parts(), depth=0)
