"""Suffix decoding's corpus of the target's own answers: the files, what the drafter drafts from it,
the shipped one, the held-out replay, and greedy identity with it."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from conftest import tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import DraftInput, TargetInfo
from tandem.drafters.corpus import CONFIG_FILE, corpus_trie, read_corpus, save_corpus, shipped_corpus_dir
from tandem.drafters.lookup import LookupFirst
from tandem.drafters.suffix import SuffixDrafter
from tandem.llm import LLM
from tandem.train.suffix_corpus import corpus_answers, replay

TARGET = TargetInfo(vocab_size=1000, eos_token_ids=(2,))


def drafter(corpus=None, k: int = 4, on: bool = True, target: TargetInfo = TARGET) -> SuffixDrafter:
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=k, draft_model_path=corpus and str(corpus), corpus=on)
    return SuffixDrafter(spec, target)


def ask(d: SuffixDrafter, ids: list[int], rid: str = "r") -> list[int]:
    (draft,) = d.propose([DraftInput(rid, list(ids), 1, 16, SamplingParams(), torch.Generator())])
    return draft.token_ids


def test_a_corpus_round_trips_and_is_refused_for_another_vocabulary(tmp_path):
    answers = [[10, 11, 12], [], [999, 5]]
    save_corpus(tmp_path, answers, "toy", 1000, {"note": "x"})
    config, back = read_corpus(tmp_path, 1000)
    assert back == answers and config["tokens"] == 5 and config["answers"] == 3 and config["record"] == {"note": "x"}
    mask = os.umask(0)
    os.umask(mask)  # readable as any file the umask allows: safetensors alone writes 0600
    assert [stat.S_IMODE(f.stat().st_mode) for f in sorted(tmp_path.iterdir())] == [0o666 & ~mask] * 2
    with pytest.raises(ValueError, match="vocabulary of 1000"):
        read_corpus(tmp_path, 500)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        save_corpus(tmp_path / "bad", answers, "toy", 100)
    with pytest.raises(FileNotFoundError, match="tandem train --method suffix"):
        read_corpus(tmp_path / "nothing", 1000)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / CONFIG_FILE).write_text(json.dumps({"format": "tandem-draft-head"}))
    with pytest.raises(ValueError, match="not a tandem-suffix-corpus"):
        read_corpus(tmp_path / "other", 1000)


def test_the_drafter_drafts_what_only_the_corpus_has_seen_when_it_is_on(tmp_path):
    save_corpus(tmp_path, [[10, 11, 12, 13, 14, 15, 16, 17]], "toy", 1000)
    context = [5, 6, 10, 11, 12]
    # a 3-token match drafts at most 3 tokens (the suffix drafter's length rule)
    assert ask(drafter(tmp_path), context) == [13, 14, 15]
    assert ask(drafter(), context) == []  # nothing shipped for this target, no corpus given
    assert drafter(tmp_path).corpus_trie is not None and drafter().corpus_trie is None
    # the corpus is only read: a request's output goes to the global trie, not to the corpus
    d = drafter(tmp_path)
    before = d.corpus_trie.num_tokens
    ask(d, [7, 8, 9], rid="a")
    d.release("a")
    assert d.corpus_trie.num_tokens == before and d.global_trie.num_tokens == 2


def test_the_corpus_trie_is_built_once_per_corpus_and_depth(tmp_path):
    save_corpus(tmp_path, [[1, 2, 3]], "toy", 1000)
    assert drafter(tmp_path, k=4).corpus_trie is drafter(tmp_path, k=4).corpus_trie
    assert drafter(tmp_path, k=5).corpus_trie is not drafter(tmp_path, k=4).corpus_trie
    assert corpus_trie(tmp_path, 24, 1000) is drafter(tmp_path, k=4).corpus_trie


def test_a_corpus_path_with_the_corpus_turned_off_is_refused(tmp_path):
    save_corpus(tmp_path, [[1, 2, 3]], "toy", 1000)
    with pytest.raises(ValueError, match="no-speculative-corpus"):
        drafter(tmp_path, on=False)


def test_the_lookup_of_a_head_does_not_read_the_heads_path_as_a_corpus(tmp_path):
    spec = SpecConfig(algorithm="eagle3", draft_model_path=str(tmp_path / "a-head"))
    assert LookupFirst(spec, TARGET, (1,)).suffix.corpus_trie is None


def test_the_built_in_chat_model_gets_the_shipped_corpus():
    name = "smollm2-135m-instruct"
    path = shipped_corpus_dir(name)
    assert path is not None and shipped_corpus_dir("tiny-llama") is None
    config, answers = read_corpus(path, 49152)
    assert config["target"]["model_name"] == name and config["tokens"] == sum(map(len, answers)) > 0
    target = TargetInfo(vocab_size=49152, eos_token_ids=(2,), model_name=name)
    assert drafter(target=target).corpus_trie is corpus_trie(path, 24, 49152)
    assert drafter(target=target, on=False).corpus_trie is None


def test_corpus_answers_stop_at_the_token_budget():
    records = [{"answer_ids": [1] * 5}, {"answer_ids": [2] * 5}, {"answer_ids": [3] * 5}]
    assert corpus_answers(records, 5) == [[1] * 5]
    assert corpus_answers(records, 6) == [[1] * 5, [2] * 5]


def test_replay_grades_drafts_as_greedy_verification_would(tmp_path):
    answer = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    records = [{"prompt_ids": [1, 2, 3], "answer_ids": answer}]
    alone = replay(records, 1000, 4, None)
    # nothing repeats: every round drafts nothing and commits one token
    assert (alone.tokens, alone.rounds, alone.tau, alone.acceptance) == (10, 10, 1.0, [0.0] * 4)
    save_corpus(tmp_path, [[9, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]], "toy", 1000)
    helped = replay(records, 1000, 4, tmp_path)
    # round 1 has no match (commits 20); then the corpus's copy is matched ever longer:
    # [21] passes (+1 bonus), [23, 24] ... the drafts grow with the match, and all pass
    assert helped.tokens == 10 and helped.rounds < alone.rounds and helped.tau == pytest.approx(10 / helped.rounds)
    assert helped.acceptance[0] == 1.0


def test_greedy_output_with_a_corpus_equals_plain_decoding(tmp_path):
    _, loaded = tiny_loaded()
    prompts = [[5, 9, 14, 3, 7], [11, 4, 4, 8]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(prompts, params)]
    # the corpus holds the answers themselves, shifted by one token at the start of the second
    save_corpus(tmp_path, [plain[0], [1] + plain[1][1:]], "tiny", loaded.config.vocab_size)
    accepted = {}
    for on in (True, False):
        spec = SpecConfig(algorithm="suffix", num_draft_tokens=4, draft_model_path=str(tmp_path) if on else None,
                          corpus=on)
        outs = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=spec)).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain
        accepted[on] = sum(o.spec.num_accepted_tokens for o in outs)
    assert accepted[True] > accepted[False]  # the corpus's drafts were proposed, and passed


def test_a_frozen_trie_drafts_as_before_and_refuses_changes():
    import random

    from tandem.drafters.suffix_trie import SuffixTrie

    rng = random.Random(0)
    streams = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    live, frozen = SuffixTrie(8), SuffixTrie(8)
    for s in streams:
        live.add(s)
        frozen.add(s)
    frozen.freeze()
    for _ in range(200):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        cursor, m = live.longest_match(context, 6)
        cursor2, m2 = frozen.longest_match(context, 6)
        assert m == m2
        if cursor is not None:
            for _ in range(2):  # the second time from what the frozen trie remembered
                assert frozen.draft(cursor2, 6, 0.05) == live.draft(cursor, 6, 0.05)
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.add([1, 2, 3])
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.extend(frozen.open(), [1])
