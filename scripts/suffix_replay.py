"""Suffix decoding replayed over recorded greedy answers: what a draft shape would accept and cost.

Under greedy decoding a round's outcome depends only on the draft and the answer plain decoding
gives, so a drafter can be judged without running the target again: record each prompt's plain
answer once, then walk it round by round (the context is prompt + the answer so far, the draft
passes as far as it matches the answer's next tokens, the round commits that plus one token),
feeding the drafter the same observations the engine would. Each round is priced at a forward
cost measured here for its rows and context (`--contexts` x 1..10 rows, medians), so the
modelled speed over plain decoding (one 1-row forward per token at the same contexts) counts
what the extra rows cost and leaves out drafting and bookkeeping.

Shapes: `chain` is the shipped drafter (the best-scoring trie's most frequent continuation);
`tree:N` adds, up to N nodes, each trie's own draft and the second most frequent first token of
each trie with its own continuation, best expected acceptance first, sharing common prefixes.

    .venv/bin/python scripts/suffix_replay.py --limit 5 chain tree:5 tree:8

The answers are kept in --answers (made on first use: Spec-Bench `--limit` prompts per subtask,
as `tandem bench spec` takes them, 128 tokens, and its warm-up prompt first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.bench.prompts import spec_bench_prompts
from tandem.bench.spec import WARMUP_TEXT, WARMUP_TOKENS, target_info
from tandem.config import SamplingParams, SpecConfig
from tandem.drafters import DraftInput, DraftOutcome
from tandem.drafters.suffix import SuffixDrafter
from tandem.llm import LLM
from tandem.model.kernels import cpu_name, kernel_description
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

GREEDY = SamplingParams(temperature=0)


def record_answers(llm: LLM, limit: int, max_tokens: int) -> dict:
    chat = llm.loaded.tokenizer.chat_template is not None
    warm = llm.encode(WARMUP_TEXT, chat=chat)
    cases = [{"category": "warm-up", "prompt": warm,
              "answer": llm.generate(warm, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS))[0].token_ids}]
    for p in tqdm(spec_bench_prompts(per_category=limit), desc="plain answers", unit="prompt"):
        ids = llm.encode(p.text, chat=chat)
        answer = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids
        cases.append({"category": p.category, "prompt": ids, "answer": answer})
    return {"limit": limit, "max_tokens": max_tokens, "cases": cases}


def measure_costs(llm: LLM, contexts: list[int], repeats: int) -> dict[tuple[int, int], float]:
    """Median seconds of a forward over 1..10 new tokens after each context (all logits, as a
    chain's verification)."""
    loaded = llm.loaded
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, max(contexts) + 16, torch.float32,
                                               storage=torch.float16))
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for ctx in tqdm(contexts, desc="forward costs", unit="context"):
        seq = runner.cache.allocate()
        runner.forward([SeqInput(seq, list(range(100, 100 + ctx)))])
        for _ in range(repeats):
            for rows in range(1, 11):
                start = time.perf_counter()
                runner.forward([SeqInput(seq, list(range(200, 200 + rows)), logits="all")])
                times[ctx, rows].append(time.perf_counter() - start)
                runner.cache.truncate(seq, ctx)
        runner.cache.release(seq)
    return {key: statistics.median(ts) for key, ts in times.items()}


def chain_draft(drafter: SuffixDrafter, inp: DraftInput, max_nodes: int) -> tuple[list[int], list[int] | None]:
    return drafter.propose([inp])[0].token_ids, None


def tree_draft(drafter: SuffixDrafter, inp: DraftInput, max_nodes: int) -> tuple[list[int], list[int] | None]:
    """Every trie's draft and its runner-up first token, merged into a tree of at most max_nodes."""
    k = drafter.spec.num_draft_tokens
    own = drafter._synced(inp).trie  # the request's trie, brought up to its context
    paths: list[tuple[float, list[int]]] = []
    for trie in (own, drafter.global_trie, drafter.corpus_trie):
        if trie is None:
            continue
        cursor, matched = trie.longest_match(inp.token_ids, drafter.max_match_len)
        budget = min(k, matched)
        if cursor is None or budget < 1:
            continue
        tokens, score = trie.draft(cursor, budget, drafter.min_token_prob)
        if tokens:
            paths.append((score, tokens))
        node, offset = cursor
        if node.stream is None and node.children and offset == 0 and len(node.children) > 1:
            total = sum(child.count for child in node.children.values())
            token, child = sorted(node.children.items(), key=lambda kv: -kv[1].count)[1]
            p = child.count / total
            if p >= drafter.min_token_prob:
                rest, rest_score = trie.draft((child, 0), budget - 1, drafter.min_token_prob / p)
                paths.append((p * (1 + rest_score), [token, *rest]))
    tokens, parents, nodes = [], [], {}
    for _, path in sorted(paths, key=lambda sp: -sp[0]):
        parent = -1
        for token in path:
            if (parent, token) not in nodes:
                if len(tokens) == max_nodes:
                    break
                tokens.append(token)
                parents.append(parent)
                nodes[parent, token] = len(tokens) - 1
            parent = nodes[parent, token]
    return tokens, parents


def accepted(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """How many of the answer's next tokens the draft holds, along its matching path."""
    node, n = -1, 0
    while n < len(truth):
        if parents is None:
            nxt = n if n < len(tokens) and tokens[n] == truth[n] else None
        else:
            nxt = next((i for i, p in enumerate(parents) if p == node and tokens[i] == truth[n]), None)
        if nxt is None:
            return n
        node, n = nxt, n + 1
    return n


def replay(answers: dict, shape: str, k: int, target) -> dict[str, Counter]:
    """Per subtask: rounds and committed tokens, and the rounds by (rows, context)."""
    draft, max_nodes = (chain_draft, k) if shape == "chain" else (tree_draft, int(shape.split(":")[1]))
    drafter = SuffixDrafter(SpecConfig(algorithm="suffix", num_draft_tokens=k, policy="fixed"), target)
    stats: dict[str, Counter] = defaultdict(Counter)
    generator = torch.Generator()  # greedy: never drawn from
    for i, case in enumerate(answers["cases"]):
        request, prompt, answer = f"r{i}", case["prompt"], case["answer"]
        done = 1  # the first token comes from the prompt's forward
        while done < len(answer):
            tokens, parents = draft(drafter, DraftInput(request, prompt + answer[:done], len(prompt), k, GREEDY,
                                                        generator), max_nodes)
            n = accepted(tokens, parents, answer[done:])
            committed = answer[done: done + n + 1]
            drafter.observe([DraftOutcome(request, len(tokens), n, committed)])
            st = stats[case["category"]]
            st["rounds"] += 1
            st["tokens"] += len(committed)
            st[1 + len(tokens), len(prompt) + done] += 1
            done += len(committed)
        drafter.release(request)
    stats.pop("warm-up", None)
    return stats


def modelled(st: Counter, cost) -> float:
    """Plain decoding's modelled time over this shape's, for the same tokens."""
    rounds = [(key, m) for key, m in st.items() if isinstance(key, tuple)]
    spec = sum(cost(rows, ctx) * m for (rows, ctx), m in rounds)
    plain = sum(cost(1, ctx) * m for (rows, ctx), m in rounds) * st["tokens"] / st["rounds"]
    return plain / spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="chain, or tree:N (at most N nodes)")
    parser.add_argument("--limit", type=int, default=5, help="Spec-Bench prompts per subtask")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="k: the deepest draft")
    parser.add_argument("--answers", type=Path, default=Path("/tmp/tandem_suffix_replay_answers.json"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 600, 900])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    for shape in args.shapes:
        if shape != "chain" and not (shape.startswith("tree:") and shape[5:].isdigit() and int(shape[5:]) > 0):
            raise SystemExit(f"unknown shape {shape!r}: use chain or tree:N")
    llm = LLM()
    answers = json.loads(args.answers.read_text()) if args.answers.exists() else None
    if answers is None or answers["limit"] != args.limit or answers["max_tokens"] != args.max_tokens:
        answers = record_answers(llm, args.limit, args.max_tokens)
        args.answers.write_text(json.dumps(answers))
    costs = measure_costs(llm, args.contexts, args.repeats)

    def cost(rows: int, ctx: int) -> float:
        nearest = min(args.contexts, key=lambda c: abs(c - ctx))
        return costs[nearest, min(rows, 10)]

    print(f"{cpu_name()}, {kernel_description()}, {torch.get_num_threads()} threads; "
          f"{len(answers['cases']) - 1} answers, k = {args.num_draft_tokens}")
    print("forward ms by rows 1..10 at context " + "; ".join(
        f"{c}: " + " ".join(f"{1000 * costs[c, r]:.2f}" for r in range(1, 11)) for c in args.contexts))
    categories = [c for c in dict.fromkeys(case["category"] for case in answers["cases"]) if c != "warm-up"]
    print(f"{'shape':10} {'tau':>5} {'rows':>5} {'modelled':>9}  " + "  ".join(f"{c[:13]:>13}" for c in categories))
    for shape in args.shapes:
        stats = replay(answers, shape, args.num_draft_tokens, target_info(llm.loaded))
        total = sum(stats.values(), Counter())
        rows = sum(r * m for key, m in total.items() if isinstance(key, tuple) for r in [key[0]])
        per = "  ".join(f"{st['tokens'] / st['rounds']:5.2f} {modelled(st, cost):5.2f}x"
                        for st in (stats[c] for c in categories))
        print(f"{shape:10} {total['tokens'] / total['rounds']:5.2f} {rows / total['rounds']:5.2f} "
              f"{modelled(total, cost):8.3f}x  {per}")


if __name__ == "__main__":
    main()
