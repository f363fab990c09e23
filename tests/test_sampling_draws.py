"""sampling.sample: draws by the inverse of the cumulative distribution."""

from unittest import mock

import torch
from scipy.stats import chisquare

from tandem.sampling import make_generator, sample


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2, 0.0], [0.0, 0.1, 0.0, 0.6, 0.0, 0.3]])
    gen = make_generator(0)
    draws = torch.stack([sample(probs, gen) for _ in range(20000)])  # [n, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6)
        assert counts[probs[row] == 0].sum() == 0
        support = probs[row] > 0
        expected = probs[row][support] * len(draws)
        assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-4


def test_unnormalised_rows_and_a_fixed_seed():
    probs = torch.tensor([[2.0, 0.0, 6.0]])
    a = [int(sample(probs, make_generator(7))) for _ in range(5)]
    b = [int(sample(probs, make_generator(7))) for _ in range(5)]
    assert a == b and set(a) <= {0, 2}


def test_a_uniform_that_rounds_up_to_the_total_takes_the_last_possible_token():
    """u * total can round to total itself; the draw then must not land past the support."""
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    with mock.patch("tandem.sampling.torch.rand", return_value=torch.ones(1, 1, dtype=torch.float64)):
        assert int(sample(probs, make_generator(0))) == 1
