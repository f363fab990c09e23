"""Build src/tandem/data/train/passage_tasks.jsonl: prompts that transform a passage given in the prompt.

The shipped training sets ask questions; none hands the model a text to summarise, translate,
rewrite or answer from, the tasks where an answer reuses the prompt's own words (Spec-Bench's
summarization, translation and RAG subtasks are of that kind). This script builds such prompts from
the training sets' own texts: the human-written OpenAssistant replies, the GPTeacher role-play
responses and code, and the GSM8K questions. No evaluation set is read.

Each line: {"prompt": str, "task": str, "source": str}. Deterministic (seeded); rerun to rebuild:

    python scripts/make_passage_prompts.py [--out src/tandem/data/train/passage_tasks.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TRAIN_DIR = Path(__file__).resolve().parents[1] / "src" / "tandem" / "data" / "train"
OUT = TRAIN_DIR / "passage_tasks.jsonl"
MAX_PASSAGE_CHARS = 3000  # ~700 tokens: room for a 192-token answer within 1024

SUMMARIZE = [
    "Summarize: {p}",
    "Summarize the following text.\n\n{p}",
    "{p}\n\nSummarize the text above in a few sentences.",
    "Write a one-paragraph summary of this:\n\n{p}",
    "Give a short summary of the passage below.\n\nPassage: {p}",
    "{p}\n\nTL;DR:",
]
TRANSLATE = [
    "Translate English to {lang}: {p}",
    "Translate the following sentence into {lang}.\n\n{p}",
    "How do you say this in {lang}? \"{p}\"",
    "{p}\n\nTranslate the text above into {lang}.",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese", "Russian"]
REWRITE = [
    "Rewrite the following text in simpler words:\n\n{p}",
    "Correct any spelling or grammar mistakes in this text and return it:\n\n{p}",
    "Rewrite this text in a more formal tone:\n\n{p}",
    "Extract the key points of this text as a bulleted list:\n\n{p}",
    "{p}\n\nList the main facts stated in the text above.",
    "Paraphrase the following paragraph:\n\n{p}",
]
CODE = [
    "Explain what this code does:\n\n{p}",
    "Add comments to the following code:\n\n{p}",
    "Rewrite this code with clearer variable names:\n\n{p}",
    "Find possible bugs in this code:\n\n{p}",
    "{p}\n\nDescribe the code above step by step.",
]
DOCUMENT_QUESTIONS = [
    "What is the main point of the documents?",
    "According to the documents, what should the reader do?",
    "Which facts do the documents agree on?",
    "Summarize what the documents say.",
    "What reasons do the documents give?",
]


def _walk(message: dict, out: list[dict]) -> None:
    out.append(message)
    for reply in message.get("replies", []):
        _walk(reply, out)


def oasst_trees() -> list[tuple[str, list[str]]]:
    """(root question, every assistant reply in its tree) per OpenAssistant conversation tree."""
    trees = []
    for line in (TRAIN_DIR / "oasst_en_100_tree.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        messages: list[dict] = []
        root = json.loads(line)["prompt"]
        _walk(root, messages)
        replies = [m["text"].strip() for m in messages if m["role"] == "assistant" and m["text"].strip()]
        trees.append((root["text"].strip(), replies))
    return trees


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def build(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    trees = oasst_trees()
    oasst_replies = [r for _, replies in trees for r in replies]
    roleplay = [r["response"].strip() for r in json.loads((TRAIN_DIR / "gpteacher_roleplay_instruct.json").read_text())]
    code = [r["response"].strip() for r in json.loads((TRAIN_DIR / "gpteacher_codegen_instruct.json").read_text())]
    gsm8k = [json.loads(line)["question"] for line in (TRAIN_DIR / "gsm8k_train.jsonl").read_text().splitlines() if line]

    prose = [("oasst", t) for t in oasst_replies] + [("gpteacher_roleplay", t) for t in roleplay]
    long_prose = [(s, t) for s, t in prose if 400 <= len(t) <= MAX_PASSAGE_CHARS]
    rng.shuffle(long_prose)
    records: list[dict] = []

    def add(task: str, source: str, template: str, **fields) -> None:
        records.append({"prompt": template.format(**fields), "task": task, "source": source})

    # Summaries of single passages, and of several replies of one conversation joined (long inputs).
    for source, text in long_prose[:1300]:
        add("summarize", source, rng.choice(SUMMARIZE), p=text)
    for question, replies in trees:
        for _ in range(3):
            picked = rng.sample(replies, k=min(len(replies), rng.randint(2, 4)))
            text = "\n\n".join(picked)
            if 600 <= len(text) <= MAX_PASSAGE_CHARS:
                add("summarize", "oasst", rng.choice(SUMMARIZE), p=text)
    # Rewriting / extraction (answers that reuse the passage's words).
    for source, text in long_prose[1300:2100]:
        add("rewrite", source, rng.choice(REWRITE), p=text)
    # Translation of one or two sentences.
    pool = [("gsm8k", s) for q in gsm8k for s in sentences(q)] + [("oasst", s) for r in oasst_replies for s in sentences(r)]
    pool = [(src, s) for src, s in pool if 40 <= len(s) <= 300]
    rng.shuffle(pool)
    for i in range(1600):
        source, text = pool[i]
        if i % 3 == 0 and i + 1 < len(pool) and pool[i + 1][0] == source:
            text = f"{text} {pool[i + 1][1]}"
        add("translate", source, rng.choice(TRANSLATE), lang=rng.choice(LANGUAGES), p=text)
    # Answering from documents: a conversation's own replies among replies of other conversations.
    for q_index, (question, replies) in enumerate(trees):
        for _ in range(4):
            docs = rng.sample(replies, k=min(len(replies), rng.randint(1, 2)))
            while True:
                other = rng.randrange(len(trees))
                if other != q_index and trees[other][1]:
                    break
            docs.append(rng.choice(trees[other][1]))
            rng.shuffle(docs)
            _add_documents(add, rng, "oasst", docs, question)
    for _ in range(800):
        docs = [t for _, t in rng.sample(long_prose, k=rng.randint(1, 3))]
        _add_documents(add, rng, "gpteacher_roleplay+oasst", docs, rng.choice(DOCUMENT_QUESTIONS))
    # Code to explain, comment or rewrite.
    snippets = [c for c in code if 200 <= len(c) <= 2000]
    rng.shuffle(snippets)
    for text in snippets[:800]:
        add("code", "gpteacher_codegen", rng.choice(CODE), p=text)
    return records


def _add_documents(add, rng: random.Random, source: str, docs: list[str], question: str) -> None:
    if sum(map(len, docs)) > MAX_PASSAGE_CHARS:
        docs = docs[:1]
        if len(docs[0]) > MAX_PASSAGE_CHARS:
            return
    if rng.random() < 0.5:
        body = "\n\n".join(f"Document [{i + 1}]: {d}" for i, d in enumerate(docs))
        add("documents", source, "Answer the question using the documents below.\n\n{p}\n\nQuestion: {q}", p=body, q=question)
    else:
        add("documents", source, "{p}\n\n{q}", p="\n\n".join(docs), q=question)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = build(args.seed)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tasks: dict[str, int] = {}
    for r in records:
        tasks[r["task"]] = tasks.get(r["task"], 0) + 1
    print(f"{len(records)} prompts -> {args.out}: {tasks}")


if __name__ == "__main__":
    main()
