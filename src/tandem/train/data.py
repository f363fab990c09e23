"""Training data for draft heads: prompt files -> the target's own answers.

`load_prompts` reads the prompt formats of the project's data files; `distill` lets the target
answer them through tandem's engine (self-distillation: the drafter learns the distribution it is
verified against), cached on disk in shards and resumable (a rerun skips finished shards; a crash
loses at most the shard in flight). `tandem.train.capture` turns the answers into hidden states.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.config import SamplingParams
from tandem.paths import read_user_text
from tandem.progress import progress

log = logging.getLogger("tandem.train")

# The evaluation sets: a drafter trained on them would report inflated acceptance.
EVAL_SET_MARKERS = ("spec_bench", "mt_bench")


# ---------------------------------------------------------------------------------------------
# Prompts


def _record_prompt(rec) -> str | None:
    """One record of any supported format -> the user prompt (None when it has no usable text).

    Formats: a bare JSON string (oasst prompt lottery); {"turns": [...]} (first user turn);
    {"question"} (gsm8k); {"instruction", "input"} (gpteacher); {"instruction", "instances":
    [{"input"}]} (self-instruct); {"prompt": {"text"}} (oasst message trees); {"prompt": str}.
    """
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("turns"), list) and rec["turns"]:
        return rec["turns"][0]
    if isinstance(rec.get("question"), str):
        return rec["question"]
    if isinstance(rec.get("instruction"), str):
        extra = rec.get("input")
        if extra is None and rec.get("instances"):
            extra = rec["instances"][0].get("input")
        return rec["instruction"] + (f"\n\n{extra}" if extra else "")
    prompt = rec.get("prompt")
    if isinstance(prompt, dict) and isinstance(prompt.get("text"), str):
        return prompt["text"]
    if isinstance(prompt, str):
        return prompt
    return None


def read_prompt_file(path: str | Path) -> list[str]:
    """All prompts of one .json (a list of records) or .jsonl (one record per line) file."""
    path = Path(path)
    if any(m in path.name.lower() for m in EVAL_SET_MARKERS):
        raise ValueError(
            f"{path.name} is an evaluation set (Spec-Bench / MT-Bench); training on it would inflate the "
            "benchmark. Use the training prompt sets (see src/tandem/data/SOURCES.md)."
        )
    text = read_user_text(path, "prompt file")
    whole = path.suffix == ".json"  # one list of records, else one record per line
    records = []
    for n, line in enumerate([text] if whole else text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path if whole else f'{path}:{n}'}: not JSON ({err}); a prompt file is .json (a list "
                             "of records) or .jsonl (one record per line)") from None
    if whole:
        if len(records) != 1 or not isinstance(records[0], list):
            raise ValueError(f"{path}: a .json prompt file must hold a list of records")
        records = records[0]
    prompts = [p.strip() for p in map(_record_prompt, records) if p and p.strip()]
    if not prompts:
        raise ValueError(
            f"{path}: no prompts found; records need one of: a JSON string, 'turns', 'question', "
            "'instruction' (+ 'input'/'instances'), 'prompt'"
        )
    return prompts


@dataclass(frozen=True)
class PromptSplit:
    train: list[str]
    held_out: list[str]


def load_prompts(paths: list[str | Path], num_prompts: int | None = None, held_out: int = 32, seed: int = 0) -> PromptSplit:
    """Read, deduplicate (whitespace/case-insensitive), shuffle deterministically by `seed`, split.

    Each file is shuffled on its own and the files are interleaved round-robin, so a small
    `num_prompts` still mixes every file's kind of prompt (gsm8k alone has 7.5k records). The
    held-out prompts come first, so growing `num_prompts` keeps the same held-out set and extends
    the training set.
    """
    if held_out < 0:
        raise ValueError(f"held_out must be >= 0, got {held_out}")
    rng = random.Random(seed)
    per_file = []
    for path in paths:
        prompts = read_prompt_file(path)
        rng.shuffle(prompts)
        per_file.append(prompts)
    seen, prompts = set(), []
    for i in range(max(map(len, per_file), default=0)):
        for file_prompts in per_file:
            if i < len(file_prompts):
                key = " ".join(file_prompts[i].lower().split())
                if key not in seen:
                    seen.add(key)
                    prompts.append(file_prompts[i])
    if len(prompts) <= held_out:
        raise ValueError(f"{len(prompts)} distinct prompts cannot leave {held_out} held out; add prompt files")
    rest = prompts[held_out:]
    if num_prompts is not None:
        rest = rest[:num_prompts]
    return PromptSplit(train=rest, held_out=prompts[:held_out])


# ---------------------------------------------------------------------------------------------
# Self-distillation


@dataclass(frozen=True)
class DistillConfig:
    """How the target answers the prompts (quantization: the target's weights, as resolved by the
    loader). Stored with the cache: a cache made under other settings is refused rather than
    silently mixed."""

    target: str
    quantization: str = "auto"
    max_new_tokens: int = 160
    temperature: float = 0.0
    seed: int = 0
    chat: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def prompt_key(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def check_cache_meta(directory: Path, meta: dict) -> None:
    file = directory / "meta.json"
    if file.exists():
        old = json.loads(file.read_text())
        if old != meta:
            raise ValueError(
                f"{directory} was made with {old}, not {meta}: it is cached data of another run; point --data-dir "
                "elsewhere (or delete that directory) to change these settings"
            )
    else:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(file, lambda p: p.write_text(json.dumps(meta, indent=1)))


def _prompt_seed(cfg: DistillConfig, prompt: str) -> int | None:
    """Sampling seed of one prompt, from the run seed and the prompt itself: a resumed run (or
    one sharded differently) samples exactly the answers an uninterrupted one would."""
    return None if cfg.temperature == 0 else (cfg.seed << 32) | int(prompt_key(prompt)[:8], 16)


def read_answers(directory: str | Path) -> list[dict]:
    """Every finished record of a distillation cache, shard by shard."""
    out = []
    for shard in sorted(Path(directory).glob("answers-*.jsonl")):
        out.extend(json.loads(line) for line in shard.read_text().splitlines() if line)
    return out


def distill(llm, prompts: list[str], directory: str | Path, cfg: DistillConfig, shard_size: int = 32,
            deadline: float | None = None) -> list[dict]:
    """Answer every prompt with the target (batched through the engine); return the records.

    Records {"key", "prompt_ids", "answer_ids", "finish_reason"} go to answers-NNNNN.jsonl shards,
    each written atomically once its prompts are done, so an interrupted run resumes at the first
    unfinished shard and never redoes a finished prompt. deadline (a time.monotonic() value): stop
    starting new shards after it and return the records finished so far.
    """
    def answer(prompts_ids: list[list[int]], prompts_text: list[str]) -> list[tuple[list[int], str]]:
        params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=_prompt_seed(cfg, p))
                  for p in prompts_text]
        return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts_ids, params)]

    chat = cfg.chat and getattr(llm.tokenizer, "chat_template", None) is not None
    return answer_prompts(prompts, directory, cfg, answer, lambda p: llm.encode(p, chat), llm.config.max_model_len,
                          shard_size, deadline=deadline)


def answer_prompts(prompts: list[str], directory: str | Path, cfg: DistillConfig, answer, encode, max_model_len: int,
                   shard_size: int, by_length: bool = False, deadline: float | None = None) -> list[dict]:
    """The resumable shard loop of self-distillation, whatever generates the answers.

    answer(prompt ids, prompt texts) -> [(answer ids, finish reason)]; encode(text) -> ids.
    by_length: answer the prompts in order of length (less padding for a padded batch).
    Returns the finished records in the order of `prompts` (all of them unless the deadline hit).
    """
    directory = Path(directory)
    check_cache_meta(directory, asdict(cfg))
    done = {r["key"]: r for r in read_answers(directory)}
    todo = [(p, encode(p)) for p in dict.fromkeys(prompts) if prompt_key(p) not in done]
    if by_length:
        todo.sort(key=lambda item: len(item[1]))
    next_shard = len(list(directory.glob("answers-*.jsonl")))
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="self-distillation", unit="prompt")
    for start in range(0, len(todo), shard_size):
        if deadline is not None and time.monotonic() > deadline:
            log.info("self-distillation time budget reached: %d of %d prompts answered (a rerun continues)",
                     len(prompts) - len(todo) + start, len(prompts))
            break
        chunk = todo[start : start + shard_size]
        # Prompts too long for a full-length answer in the context are recorded as skipped (done).
        fits = [i for i, (_, ids) in enumerate(chunk) if len(ids) + cfg.max_new_tokens <= max_model_len]
        answers = dict(zip(fits, answer([chunk[i][1] for i in fits], [chunk[i][0] for i in fits]))) if fits else {}
        records = [
            {"key": prompt_key(p), "prompt_ids": ids, "answer_ids": list(answers[i][0]), "finish_reason": answers[i][1]}
            if i in answers
            else {"key": prompt_key(p), "prompt_ids": ids, "answer_ids": [], "finish_reason": "skipped: prompt too long"}
            for i, (p, ids) in enumerate(chunk)
        ]
        shard = directory / f"answers-{next_shard:05d}.jsonl"
        atomic_write(shard, lambda path: path.write_text("".join(json.dumps(r) + "\n" for r in records)))
        next_shard += 1
        for r in records:
            done[r["key"]] = r
        bar.update(len(chunk))
    bar.close()
    return [done[k] for k in map(prompt_key, prompts) if k in done]
