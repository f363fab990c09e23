"""`tandem train --method suffix`: a corpus of the target's own answers for suffix decoding
(drafters/corpus.py), and what it does to suffix decoding on held-out answers.

Nothing is optimised: the corpus is the first training answers up to a token budget. The held-out
figure replays each held-out greedy answer through the suffix drafter round by round (a draft's
accepted length is its common prefix with the recorded answer, as greedy verification would
find), with the corpus and without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.config import SamplingParams, SpecConfig
from tandem.drafters.base import DraftInput, DraftOutcome, TargetInfo
from tandem.drafters.corpus import save_corpus
from tandem.drafters.suffix import SuffixDrafter


@dataclass
class ReplayResult:
    """tau: answer tokens per round (each round commits the accepted drafts + one token);
    acceptance: P(draft token i passes | the ones before it passed), over the rounds that drafted i."""

    answers: int
    tokens: int
    rounds: int
    tau: float
    acceptance: list[float]


def corpus_answers(records: list[dict], max_tokens: int) -> list[list[int]]:
    """The records' answers in order until `max_tokens` answer tokens are taken."""
    answers, total = [], 0
    for record in records:
        if total >= max_tokens:
            break
        answers.append(list(record["answer_ids"]))
        total += len(record["answer_ids"])
    return answers


def replay(records: list[dict], vocab_size: int, num_draft_tokens: int, corpus: str | Path | None) -> ReplayResult:
    """Suffix decoding replayed over recorded greedy answers (the held-out ones), in order, one
    drafter for all of them (so its global trie learns from the earlier answers, as in serving)."""
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=num_draft_tokens, draft_model_path=corpus and str(corpus),
                      corpus=corpus is not None)
    drafter = SuffixDrafter(spec, TargetInfo(vocab_size, ()))
    params, generator = SamplingParams(max_tokens=1 << 30), torch.Generator()
    tokens = rounds = 0
    drafted = [0] * num_draft_tokens
    passed = [0] * num_draft_tokens
    for i, record in enumerate(records):
        prompt, answer = list(record["prompt_ids"]), list(record["answer_ids"])
        request, context, pos = f"held-{i}", list(prompt), 0
        while pos < len(answer):
            inp = DraftInput(request, context, len(prompt), min(num_draft_tokens, len(answer) - pos), params, generator)
            draft = drafter.propose([inp])[0].token_ids
            accepted = 0
            while accepted < len(draft) and draft[accepted] == answer[pos + accepted]:
                accepted += 1
            for j in range(min(len(draft), accepted + 1)):
                drafted[j] += 1
                passed[j] += j < accepted
            committed = answer[pos : pos + accepted + 1]
            drafter.observe([DraftOutcome(request, len(draft), accepted, committed)])
            context += committed
            pos += len(committed)
            rounds += 1
        drafter.release(request)
        tokens += len(answer)
    acceptance = [round(p / d, 4) if d else 0.0 for p, d in zip(passed, drafted)]
    return ReplayResult(len(records), tokens, rounds, round(tokens / max(rounds, 1), 4), acceptance)


def export_corpus(out: str | Path, target_name: str, vocab_size: int, train_records: list[dict],
                  held_records: list[dict], max_tokens: int, num_draft_tokens: int, record: dict) -> dict:
    """Write the corpus to `out` with its record (data, and the held-out replay with and without
    it); returns that record."""
    answers = corpus_answers(train_records, max_tokens)
    record = {**record, "corpus": {"answers": len(answers), "tokens": sum(map(len, answers)), "max_tokens": max_tokens}}
    save_corpus(out, answers, target_name, vocab_size, record)
    without = replay(held_records, vocab_size, num_draft_tokens, None)
    with_corpus = replay(held_records, vocab_size, num_draft_tokens, out)
    record["held_out"] = {"num_draft_tokens": num_draft_tokens, "with_corpus": asdict(with_corpus),
                          "without_corpus": asdict(without)}
    save_corpus(out, answers, target_name, vocab_size, record)
    return record
