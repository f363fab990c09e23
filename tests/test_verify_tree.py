"""The tree verifier (ALGORITHMS.md section 2): greedy paths, the deterministic-children rule's
distribution (every committed token follows the target's law, whatever the tree), sibling
deduplication, validation; and the Draft tree helpers the engine and drafters use."""

from __future__ import annotations

import collections

import pytest
import torch

from tandem.sampling import NonFiniteLogitsError, make_generator
from tandem.types import Draft
from tandem.verify.stats import chi_square_test, total_variation, tv_bound
from tandem.verify.tree import children_of, verify_tree

V = 6
#   root
#   /  |  \
#  0   1   2        tokens 1, 3, 0
#  |\      |
#  3 4     5        tokens 2, 5, 1
TOKENS = [1, 3, 0, 2, 5, 1]
PARENTS = [-1, -1, -1, 0, 0, 2]


def one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), V).float()


def random_rows(n: int, seed: int) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(n, V, generator=torch.Generator().manual_seed(seed)), -1)


def test_children_in_draft_order():
    assert children_of(PARENTS) == [[0, 1, 2], [3, 4], [], [5], [], [], []]
    with pytest.raises(ValueError, match="parents must precede"):
        children_of([-1, 2, 0])


def test_greedy_follows_the_argmax_path_and_emits_the_next_argmax():
    # root argmax 0 -> node 2; node 2's argmax 1 -> node 5; node 5's argmax 4: the bonus.
    probs = torch.stack([one_hot(0), one_hot(0), one_hot(0), one_hot(0), one_hot(0), one_hot(0), one_hot(4)])
    probs[3] = one_hot(1)  # row of node 2
    result = verify_tree(probs, TOKENS, PARENTS, None, greedy=True)
    assert result.path == [2, 5] and result.tokens == [0, 1, 4]


def test_greedy_with_no_matching_child_emits_the_root_argmax():
    probs = torch.stack([one_hot(4)] * 7)
    result = verify_tree(probs, TOKENS, PARENTS, None, greedy=True)
    assert result.path == [] and result.tokens == [4]


def test_certain_child_is_always_accepted_and_impossible_children_never():
    # Root: all mass on token 3 (node 1, tried second): node 0 (token 1) is rejected, node 1 passes.
    probs = random_rows(7, 0)
    probs[0] = one_hot(3)
    for seed in range(50):
        result = verify_tree(probs, TOKENS, PARENTS, make_generator(seed), greedy=False)
        assert result.path[:1] == [1]
        assert len(result.tokens) == 2  # node 1 is a leaf: its row gives the bonus


def sample_first_two(probs: torch.Tensor, trials: int, seed: int) -> list[tuple[int, int]]:
    out = []
    for i in range(trials):
        result = verify_tree(probs, TOKENS, PARENTS, make_generator(seed * 100_003 + i), greedy=False)
        tokens = result.tokens
        if len(tokens) < 2:  # nothing accepted: the round ends with one token
            out.append((tokens[0], -1))
        else:
            out.append((tokens[0], tokens[1]))
    return out


def assert_follows(observed: list[int], expected: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(observed), minlength=V).double()
    test = chi_square_test(counts, expected.double())
    assert test.p_value > 1e-4, (counts, expected)
    assert total_variation(counts, expected) <= tv_bound(len(observed), int((expected > 0).sum()))


def test_sampled_tokens_follow_the_target_distribution():
    """First token ~ p_root; given the first token is a drafted child's, the second ~ that
    child's row (if it was accepted the verifier continues there; the law must not depend on
    whether the token came from the tree or from the residual draw)."""
    probs = random_rows(7, 1)
    # Much of the root's mass on the children tried first (tokens 1, 3, 0): a rule that forgets
    # to renormalise after a rejection under-accepts the later ones, visibly.
    probs[0] = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.1, 0.1])
    rounds = sample_first_two(probs, 6000, seed=1)
    assert_follows([a for a, _ in rounds], probs[0])
    # Token 1 is node 0's: whenever the first token is 1, node 0 was accepted (a residual draw
    # never yields a rejected child's token), and the next token follows node 0's row.
    after = [b for a, b in rounds if a == TOKENS[0]]
    assert all(b >= 0 for b in after)
    assert_follows(after, probs[1])


def test_duplicate_siblings_are_tried_once_and_the_law_holds():
    tokens, parents = [2, 2, 4], [-1, -1, -1]
    probs = random_rows(4, 2)
    firsts, used = [], collections.Counter()
    for i in range(6000):
        result = verify_tree(probs, tokens, parents, make_generator(i), greedy=False)
        firsts.append(result.tokens[0])
        used[tuple(result.path)] += 1
    assert used[(1,)] == 0  # the second 2 is never accepted: the first one was tried
    assert_follows(firsts, probs[0])


def test_same_seed_same_outcome():
    probs = random_rows(7, 3)
    a = verify_tree(probs, TOKENS, PARENTS, make_generator(9), greedy=False)
    b = verify_tree(probs, TOKENS, PARENTS, make_generator(9), greedy=False)
    assert a == b


def test_validation():
    probs = random_rows(7, 4)
    with pytest.raises(ValueError, match=r"\[N \+ 1, V\]"):
        verify_tree(probs[:5], TOKENS, PARENTS, None, greedy=True)
    with pytest.raises(ValueError, match="outside"):
        verify_tree(probs, [1, 3, 0, 2, 5, V], PARENTS, None, greedy=True)
    with pytest.raises(ValueError, match="generator"):
        verify_tree(probs, TOKENS, PARENTS, None, greedy=False)
    bad = probs.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError):
        verify_tree(bad, TOKENS, PARENTS, make_generator(0), greedy=False)


def test_draft_depth_pruning_and_grafting():
    tree = Draft(list(TOKENS), None, list(PARENTS))
    assert tree.is_tree and tree.depth == 2 and Draft([7, 8, 9]).depth == 3
    shallow = tree.pruned(max_depth=1, max_nodes=10)
    assert shallow.token_ids == [1, 3, 0] and shallow.parents == [-1, -1, -1]
    small = tree.pruned(max_depth=5, max_nodes=4)
    assert small.token_ids == [1, 3, 0, 2] and small.parents == [-1, -1, -1, 0]
    assert Draft([4, 5, 6]).pruned(2, 10).token_ids == [4, 5]
    # A grafted chain reuses matching nodes (1 -> 2) and adds the rest under them.
    grafted = tree.with_branch([1, 2, 4])
    assert grafted.token_ids == TOKENS + [4] and grafted.parents == PARENTS + [3]
    assert tree.with_branch([]).token_ids == TOKENS
    chain = Draft([5, 6]).with_branch([5, 7])
    assert chain.token_ids == [5, 6, 7] and chain.parents == [-1, 0, 0]
    with pytest.raises(ValueError, match="deterministic"):
        Draft([1], torch.ones(1, V) / V).with_branch([2])
