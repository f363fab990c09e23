"""scripts/suffix_replay.py: a replayed round accepts what the engine's greedy rule would, for
chains and trees, and the tree shape offers a trie's runner-up first token beside its draft."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch

from tandem.config import SamplingParams, SpecConfig
from tandem.drafters import DraftInput
from tandem.drafters.base import TargetInfo
from tandem.drafters.suffix import SuffixDrafter

ROOT = Path(__file__).resolve().parents[1]
TARGET = TargetInfo(vocab_size=64, eos_token_ids=(0,))


def _replay_module():
    spec = importlib.util.spec_from_file_location("suffix_replay", ROOT / "scripts" / "suffix_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drafter(k: int = 4) -> SuffixDrafter:
    return SuffixDrafter(SpecConfig(algorithm="suffix", num_draft_tokens=k, policy="fixed", corpus=False), TARGET)


def _input(context: list[int], k: int = 4) -> DraftInput:
    return DraftInput("r", context, 0, k, SamplingParams(temperature=0), torch.Generator())


def test_accepted_follows_the_matching_path_of_a_chain_or_a_tree():
    accepted = _replay_module().accepted
    assert accepted([5, 6, 7], None, [5, 6, 9, 1]) == 2
    assert accepted([5, 6, 7], None, [4, 6, 7]) == 0
    assert accepted([5, 6], None, [5, 6]) == 2
    # a tree: 5 -> 6 -> 7, and 8 -> 9 beside 5 at the root
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, 1, -1, 3]
    assert accepted(tokens, parents, [8, 9, 3]) == 2
    assert accepted(tokens, parents, [5, 6, 7, 7]) == 3
    assert accepted(tokens, parents, [5, 9]) == 1
    assert accepted(tokens, parents, [2]) == 0


def test_the_tree_offers_the_runner_up_first_token_and_keeps_the_chain_first():
    replay = _replay_module()
    # After "1 2" the text went on "3 4" twice and "5 6" once: the chain drafts 3 4, the tree
    # adds 5 6 beside it.
    context = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2]
    chain, none = replay.chain_draft(_drafter(), _input(context), 4)
    assert none is None and chain[:2] == [3, 4]
    tokens, parents = replay.tree_draft(_drafter(), _input(context), 8)
    assert tokens[: len(chain)] == chain and parents[: len(chain)] == [-1, *range(len(chain) - 1)]
    runner_up = tokens.index(5)
    assert parents[runner_up] == -1 and tokens[runner_up + 1] == 6 and parents[runner_up + 1] == runner_up
    # at most max_nodes nodes, and a path cut short rather than a node without its parent
    small, small_parents = replay.tree_draft(_drafter(), _input(context), 3)
    assert len(small) == 3 and all(p < i for i, p in enumerate(small_parents))


def test_a_replayed_answer_commits_every_token_once():
    replay = _replay_module()
    prompt = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9]
    answer = [1, 2, 3, 4, 9, 1, 2, 5, 6, 9]
    answers = {"cases": [{"category": "qa", "prompt": prompt, "answer": answer}]}
    for shape in ("chain", "tree:6"):
        stats = replay.replay(answers, shape, 4, TARGET)["qa"]
        assert stats["tokens"] == len(answer) - 1  # the first token comes from the prompt's forward
        rounds = sum(m for key, m in stats.items() if isinstance(key, tuple))
        assert rounds == stats["rounds"] and stats["tokens"] > stats["rounds"]  # some drafts passed
    # one round of 3 rows after 10 tokens committed 2: plain decoding pays two 1-row forwards
    cost = lambda rows, ctx: 1.0 + 0.1 * rows  # noqa: E731
    assert replay.modelled(Counter({"rounds": 1, "tokens": 2, (3, 10): 1}), cost) == pytest.approx(2 * 1.1 / 1.3)
