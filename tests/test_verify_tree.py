"""The tree verifier (docs/algorithms.md section 2): greedy paths, the deterministic-children rule's
distribution (every committed token follows the target's law, whatever the tree), sibling
deduplication, validation; and the Draft tree helpers the engine and drafters use."""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from tandem.sampling import NonFiniteLogitsError, make_generator
from tandem.types import Draft
from tandem.verify.stats import chi_square_test, total_variation, tv_bound
from tandem.verify.tree import children_of, verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")

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


# ---- The law after every node, every leaf's bonus row, and broken verifiers that must fail ----
#
# A bigger tree over a vocabulary of 10, with five leaves at depths 1 to 3:
#
#        root
#      /   |   \
#     A    B    C          nodes 0, 1, 2: tokens 1, 4, 7 (C a leaf)
#    / \   | \
#   D   E  F  H            nodes 3, 4 (A's), 5, 6 (B's): tokens 2, 5, 8, 0 (E, F, H leaves)
#   |
#   G                      node 7: token 3 (a leaf)
#
# Losslessness says more than "the first token follows p_root": whenever the accepted path
# reaches a node, the next committed token (an accepted child's token, the residual draw after
# every child was rejected, or at a leaf the bonus) follows that node's own row. The rows put
# most of each parent's mass on its children, so every node is reached often: P(reach a child)
# = P(reach its parent) * p_parent(child's token), at least 0.1 for every leaf.

TREE_V = 10
TREE_TOKENS = [1, 4, 7, 2, 5, 8, 0, 3]
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 1, 3]
TREE_LEAVES = [2, 4, 5, 6, 7]
# Mass each internal node's row puts on its children's tokens (the rest: a random row).
CHILD_MASS = {-1: [0.3, 0.3, 0.25], 0: [0.5, 0.35], 1: [0.45, 0.4], 3: [0.75]}
TREE_TRIALS = 12_000  # every leaf is reached >= 0.1 * 12000 = 1200 times (asserted)
TREE_ALPHA = 1e-4 / (len(TREE_TOKENS) + 1)  # Bonferroni over the nine nodes (root included)


def tree_rows(seed: int = 5) -> torch.Tensor:
    """[9, TREE_V] target rows: row 0 the root's, row i + 1 node i's."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.softmax(1.5 * torch.randn(len(TREE_TOKENS) + 1, TREE_V, generator=gen, dtype=torch.float64), -1)
    children = children_of(TREE_PARENTS)
    for node, masses in CHILD_MASS.items():
        row = rows[node + 1] * (1 - sum(masses))
        for child, mass in zip(children[node + 1], masses):
            row[TREE_TOKENS[child]] += mass
        rows[node + 1] = row
    return rows.float()


TREE_ROWS = tree_rows()


def reference_verify_tree(probs, tokens, parents, generator, bug=None):
    """A plain copy of the deterministic-children rule (docs/algorithms.md section 2), one uniform
    per child tried and one for the final token, with optional bugs:
    "no_renormalisation": after a rejected child its token is zeroed but the next child is
        still accepted with probability p'(c) / (the mass before any rejection);
    "bonus_from_parent_row": at a leaf the bonus is drawn from the leaf's parent's row."""
    children = children_of(parents)
    path, node = [], -1
    while True:
        residual = probs[node + 1].double().clone()
        mass = float(residual.sum())
        accepted = None
        tried = set()
        for child in children[node + 1]:
            if tokens[child] in tried:
                continue
            tried.add(tokens[child])
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if u * mass < float(residual[tokens[child]]):
                accepted = child
                break
            residual[tokens[child]] = 0.0
            if bug != "no_renormalisation":
                mass = float(residual.sum())
        if accepted is None:
            if bug == "bonus_from_parent_row" and node >= 0 and not children[node + 1]:
                residual = probs[parents[node] + 1].double()
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            cdf = residual.cumsum(0)
            final = int(torch.searchsorted(cdf, torch.tensor([(1 - u) * float(cdf[-1])], dtype=torch.float64)))
            return [tokens[i] for i in path] + [final], path
        path.append(accepted)
        node = accepted


def simulate_tree(verifier, trials: int = TREE_TRIALS, seed: int = 7) -> dict[int, list[int]]:
    """{node: the tokens committed right after the accepted path reached it} (node -1: root)."""
    after: dict[int, list[int]] = collections.defaultdict(list)
    for i in range(trials):
        tokens, path = verifier(TREE_ROWS, TREE_TOKENS, TREE_PARENTS, make_generator(seed * 1_000_003 + i))
        for depth, node in enumerate([-1] + path):
            after[node].append(tokens[depth])
    return after


def real_verifier(probs, tokens, parents, generator):
    result = verify_tree(probs, tokens, parents, generator, greedy=False)
    return result.tokens, result.path


@functools.lru_cache(maxsize=None)
def real_tree_rounds() -> dict[int, list[int]]:
    return simulate_tree(real_verifier)


def node_checks(after: dict[int, list[int]]) -> dict[int, tuple[bool, str]]:
    """Per node reached: does the next token follow the node's row? (chi-square p >= alpha and
    TV <= tv_bound, both at the Bonferroni-corrected alpha) -> {node: (passed, description)}."""
    out = {}
    for node, observed in sorted(after.items()):
        expected = TREE_ROWS[node + 1].double()
        counts = torch.bincount(torch.tensor(observed), minlength=TREE_V).double()
        test = chi_square_test(counts, expected)
        tv = total_variation(counts, expected)
        bound = tv_bound(len(observed), int((expected > 0).sum()), 1 - TREE_ALPHA)
        passed = test.p_value >= TREE_ALPHA and tv <= bound
        out[node] = (passed, f"node {node}: n={len(observed)} p={test.p_value:.3g} tv={tv:.4f} bound={bound:.4f}")
    return out


def test_tree_design_reaches_every_leaf_and_separates_rows():
    """Every leaf gets >= 1000 bonus samples, and each leaf's row is far from its parent's (and
    from the root's): TV > 3x the detection bound, so a bonus drawn from a wrong row shows."""
    after = real_tree_rounds()
    bound = tv_bound(1000, TREE_V, 1 - TREE_ALPHA)
    for leaf in TREE_LEAVES:
        assert len(after[leaf]) >= 1000, (leaf, len(after[leaf]))
        row = TREE_ROWS[leaf + 1]
        for other in {TREE_PARENTS[leaf], -1}:
            assert 0.5 * float((row - TREE_ROWS[other + 1]).abs().sum()) > 3 * bound, (leaf, other)


def test_every_leaf_bonus_follows_that_leafs_row():
    """Rounds whose accepted path ends at a leaf draw the bonus from the leaf's own row (the
    target's distribution after the leaf's path), whichever leaf it is. Power: >= 1200 samples
    per leaf over 10 tokens: the TV bound is ~0.08 and chi-square flags far less; a wrong row
    is >= 0.25 away (asserted above)."""
    checks = node_checks(real_tree_rounds())
    assert all(checks[leaf][0] for leaf in TREE_LEAVES), "\n".join(checks[leaf][1] for leaf in TREE_LEAVES)


def test_token_after_every_internal_node_follows_its_row():
    """The root and every internal node: the next token (an accepted child's, or the residual
    draw) follows the node's row. Power: >= 12000 * 0.15 = 1800 samples per node."""
    checks = node_checks(real_tree_rounds())
    internal = [-1] + sorted(set(TREE_PARENTS) - {-1})
    assert all(checks[n][0] for n in internal), "\n".join(checks[n][1] for n in internal)


@pytest.mark.parametrize(
    "bug, failing",
    [
        # Under-accepts children tried after a rejection (B: 0.3 * 0.7 instead of 0.3), so the
        # token after the root and after A and B is off; the leaves are unaffected.
        ("no_renormalisation", [-1, 0, 1]),
        # Every leaf's bonus comes from its parent's row.
        ("bonus_from_parent_row", TREE_LEAVES),
    ],
)
def test_broken_tree_verifiers_fail_the_checks_the_real_one_passes(bug, failing):
    real = node_checks(real_tree_rounds())
    assert all(passed for passed, _ in real.values()), "\n".join(d for _, d in real.values())
    broken = node_checks(simulate_tree(functools.partial(reference_verify_tree, bug=bug)))
    assert all(not broken[n][0] for n in failing), "\n".join(d for _, d in broken.values())


def test_the_reference_copy_passes_without_its_bug():
    """The copy the negative controls break is itself correct: what fails above is the bug."""
    checks = node_checks(simulate_tree(reference_verify_tree, trials=TREE_TRIALS // 2, seed=8))
    assert all(passed for passed, _ in checks.values()), "\n".join(d for _, d in checks.values())


def test_greedy_tree_fast_path_commits_what_the_dense_rule_commits():
    """grading.grade_greedy_tree (greedy, no penalty: no probability rows) against verify_tree
    over processed_probs' one-hot rows, on logits full of ties, random trees with duplicate
    siblings, a shift that refuses tokens; a NaN row raises."""
    from tandem.config import SamplingParams
    from tandem.sampling import processed_probs
    from tandem.verify.grading import grade_greedy_tree

    gen = torch.Generator().manual_seed(4)
    depths = set()
    for trial in range(300):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        logits = torch.randint(0, 3, (n + 1, V), generator=gen).float()  # ties in most rows
        best = logits.argmax(-1)
        tokens = [int(best[p + 1]) if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(0, V, (1,), generator=gen))
                  for p in parents]
        shift = None
        if trial % 3 == 0:
            shift = torch.zeros(n + 1, V)
            shift[:, int(torch.randint(0, V, (1,), generator=gen))] = float("-inf")
        draft = Draft(tokens, parents=parents)
        probs = processed_probs(logits, SamplingParams(temperature=0.0), shift=shift)
        dense = verify_tree(probs, tokens, parents, None, greedy=True)
        assert grade_greedy_tree(logits, draft, shift) == (dense.tokens, dense.path)
        depths.add(len(dense.path))
    assert len(depths) >= 4  # paths of several depths, not only the root's bonus
    bad = torch.zeros(3, V)
    bad[2, 1] = float("nan")
    with pytest.raises(NonFiniteLogitsError):
        grade_greedy_tree(bad, Draft([0, 0], parents=[-1, 0]))
