"""Serving under load, at the engine: prompts prefilled in chunks beside decoding (bit for bit the
numbers of an unchunked prefill, and the same hidden states for drafters), a KV cache whose
memory follows the tokens held, and admission under a token budget (requests wait, never crash)."""

from __future__ import annotations

import pytest
import torch

from conftest import quantized_tiny, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters.base import Drafter, DrafterNeeds
from tandem.engine.engine import Engine
from tandem.engine.request import Request
from tandem.model.kv_cache import KVCache
from tandem.types import Draft

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG_PROMPT = [(7 * i + 3) % 90 + 3 for i in range(37)]


@pytest.fixture
def fused(block_variant):
    loaded = quantized_tiny("llama")
    assert Engine(loaded, EngineConfig(max_model_len=128, max_num_seqs=1)).runner.batch_invariant
    return loaded


def run(engine: Engine, track: str | None = None) -> tuple[dict[str, list[int]], list[int]]:
    """Step to the end -> (output ids per request, prompt tokens prefilled per step of `track`)."""
    pieces = []
    requests = list(engine.waiting)
    while engine.has_work():
        tracked = next((r for r in engine.prefilling + list(engine.waiting) if r.request_id == track), None)
        before = tracked.prefilled if tracked else None
        engine.step()
        if tracked is not None and tracked.prefilled != before:
            pieces.append(tracked.prefilled - before)
    return {r.request_id: r.output_ids for r in requests}, pieces


def test_a_prompt_arriving_while_others_decode_is_prefilled_in_chunks_bit_for_bit(fused):
    chunked = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=3, chunked_prefill_size=5))
    chunked.add_request([5, 6, 7], GREEDY, "early")
    chunked.step()  # nothing decodes yet: the first prompt runs whole
    assert [r.request_id for r in chunked.running] == ["early"]
    chunked.add_request(LONG_PROMPT, GREEDY, "late")
    late = chunked.waiting[-1]
    chunked.step()
    seq = late.seq
    while late.prefilled < len(LONG_PROMPT):
        chunked.step()
    # The finished prompt's cache rows, written in pieces, against a prefill of the whole prompt.
    whole = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=1, chunked_prefill_size=0))
    whole.add_request(LONG_PROMPT, GREEDY, "late")
    whole.step()
    ref_seq = whole.running[0].seq
    n = len(LONG_PROMPT)
    assert torch.equal(chunked.cache.k[:, seq, :, :n], whole.cache.k[:, ref_seq, :, :n])
    assert torch.equal(chunked.cache.v[:, seq, :, :n], whole.cache.v[:, ref_seq, :, :n])
    assert late.output_ids[:1] == whole.running[0].output_ids[:1]


def test_chunked_prefill_keeps_greedy_output_and_bounds_each_piece(fused):
    def engine(size):
        e = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=4, chunked_prefill_size=size))
        e.add_request([9, 10, 11, 12], GREEDY, "a")
        e.step()
        for i, p in enumerate(([20 + i for i in range(23)], LONG_PROMPT, [30, 31] * 9)):
            e.add_request(p, GREEDY, f"p{i}")
        return e

    want, pieces = run(engine(0), track="p1")
    assert pieces == [len(LONG_PROMPT)]
    got, pieces = run(engine(8), track="p1")
    assert got == want
    assert len(pieces) > 2 and max(pieces) <= 8 and sum(pieces) == len(LONG_PROMPT)


def test_a_prompt_chunk_shares_the_decoding_forward(fused):
    engine = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2, chunked_prefill_size=5))
    engine.add_request([5, 6, 7], GREEDY, "early")
    engine.step()
    late = engine.add_request(LONG_PROMPT, GREEDY, "late")
    forwards = []
    forward = engine.runner.forward
    engine.runner.forward = lambda inputs, *a, **k: forwards.append(len(inputs)) or forward(inputs, *a, **k)
    engine.step()
    assert forwards == [2] and late.prefilled == 5  # early's round and late's first chunk, one forward


class HiddenRecorder(Drafter):
    """Drafts nothing; records the hidden rows the engine hands it, per request."""

    needs = DrafterNeeds(hidden_layers=(0, 2))

    def __init__(self, spec, target) -> None:
        super().__init__(spec, target)
        self.seen: dict[str, list[dict[int, torch.Tensor]]] = {}

    def propose(self, batch):
        for inp in batch:
            self.seen.setdefault(inp.request_id, []).append(inp.hidden)
        return [Draft.empty() for _ in batch]


def test_drafters_get_the_same_hidden_rows_from_a_chunked_prompt(fused):
    def recorded(size):
        e = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2, chunked_prefill_size=size,
                                       spec=SpecConfig("ngram", 2)))
        e.drafting.drafter = HiddenRecorder(e.config.spec, e.drafter.target)
        e.add_request([9, 10, 11], GREEDY, "a")
        e.step()
        e.add_request(LONG_PROMPT, GREEDY, "b")
        run(e)
        return e.drafter.seen["b"][0]

    whole, pieces = recorded(0), recorded(6)
    assert set(whole) == {0, 2} and whole[0].shape[0] == len(LONG_PROMPT)
    for layer in whole:
        assert torch.equal(whole[layer], pieces[layer])


def test_prompts_run_whole_off_the_batch_invariant_path():
    _, loaded = tiny_loaded("llama")
    e = Engine(loaded, EngineConfig(max_model_len=128, max_num_seqs=2, chunked_prefill_size=4))
    assert not e.runner.batch_invariant
    e.add_request([5, 6], GREEDY, "a")
    e.step()
    e.add_request(LONG_PROMPT, GREEDY, "b")
    _, pieces = run(e, track="b")
    assert pieces == [len(LONG_PROMPT)]


def test_the_kv_cache_commits_memory_only_for_written_slots_and_returns_it():
    _, loaded = tiny_loaded("llama")
    cfg = loaded.config
    cache = KVCache(cfg, 128, 4096, torch.float32)
    virtual = 2 * cache.k.numel() * cache.k.element_size()
    assert virtual >= 2**28
    before = _rss()
    seq = cache.allocate()
    start = cache.reserve(seq, 100)
    cache.k[:, seq, :, start : start + 100] = 1.0
    cache.v[:, seq, :, start : start + 100] = 2.0
    assert _rss() - before < virtual // 8  # only the written rows' pages
    cache.release(seq)
    # Released pages went back to the OS: they read as zeros again, unlike a reused row's stale values.
    assert not cache.k[:, seq].any() and not cache.v[:, seq].any()
    assert cache.tokens_held == 0
    assert cache.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def test_a_token_budget_makes_requests_wait_and_refuses_what_can_never_fit():
    _, loaded = tiny_loaded("llama")
    e = Engine(loaded, EngineConfig(max_model_len=64, max_num_seqs=4, max_total_tokens=40))
    assert e.admission.max_total_tokens == 40
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i in range(3):
        e.add_request([5 + i] * 8, params, f"r{i}")  # 18 slots each: two fit beside each other
    e.step()
    assert len(e.running) + len(e.prefilling) == 2 and len(e.waiting) == 1
    assert e.admission.kv_reserved == 36
    outputs, _ = run(e)
    assert all(len(ids) == 10 for ids in outputs.values())
    assert e.admission.kv_reserved == 0
    with pytest.raises(ValueError, match="max_total_tokens"):
        e.add_request([5] * 8, SamplingParams(max_tokens=40), "too-big")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_server_sizes_max_tokens_to_the_kv_budget_and_reports_its_use():
    import httpx

    from tandem.launch_server import serve_in_background
    from tandem.server.app import build_app
    from tandem.server.async_engine import AsyncEngine
    from tandem.server.metrics import ServerMetrics

    _, loaded = tiny_loaded("llama")
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=3)  # each request also reserves a round's 3 draft slots
    engine = Engine(loaded, EngineConfig(max_model_len=128, max_num_seqs=4, max_total_tokens=40, spec=spec))
    server = serve_in_background(build_app(AsyncEngine(engine, 8, ServerMetrics("tiny")), "tiny"))
    try:
        r = httpx.post(f"{server.url}/completions", json={"prompt": "5 6 7", "max_tokens": 35})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "--max-total-tokens" in error["message"] and "3 slots" in error["message"]
        assert error["message"].endswith("ask for at most 34")  # 40 - 3 prompt tokens - 3 draft slots
        r = httpx.post(f"{server.url}/completions", json={"prompt": "5 6 7", "max_tokens": 34, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 34  # the hint is taken
        # A prompt that leaves no room (37 + a token + 3 draft slots > 40): the prompt must change, not max_tokens.
        r = httpx.post(f"{server.url}/completions", json={"prompt": " ".join(["5"] * 37), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "need 41 KV-cache slots" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/completions", json={"prompt": "5 6 7", "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 34
        metrics = httpx.get(f"{server.url.removesuffix('/v1')}/metrics").text
        for name in ("tandem:kv_cache_usage_perc", "tandem:kv_cache_reserved_perc", "tandem:kv_cache_bytes"):
            assert name in metrics
    finally:
        server.stop()


# ---- prefix caching ----------------------------------------------------------------------------


def served(engine: Engine, prompt: list[int], params=GREEDY, rid: str = "r") -> Request:
    req = engine.add_request(prompt, params, rid)
    while not req.finished:
        engine.step()
    return req


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=12)])
def test_a_prefix_hit_gives_bit_for_bit_what_a_fresh_engine_computes(fused, params):
    first = [(5 * i + 2) % 90 + 3 for i in range(21)]
    cached = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2))
    a = served(cached, first, params, "a")
    second = first + a.output_ids + [44, 45, 46, 47, 48]  # the next turn re-sends the transcript
    b = cached.add_request(second, params, "b")
    cached.step()
    assert b.prefilled == len(second) or b.finished
    assert cached.admission.prefix_cache.hit_tokens == len(first) + len(a.output_ids) - 1
    while not b.finished:
        cached.step()
    # A fresh engine computes every token of the same request itself (nothing to hit) and keeps
    # its row too: the two rows, one reused and extended, one computed whole, must be the same bits.
    fresh = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2))
    ref = served(fresh, second, params, "b")
    assert fresh.admission.prefix_cache.hit_tokens == 0
    assert b.output_ids == ref.output_ids
    n = len(second) + len(b.output_ids) - 1
    (mine,) = [r for r in cached.admission.prefix_cache._rows.values() if r.tokens == b.context[:n]]
    (theirs,) = fresh.admission.prefix_cache._rows.values()
    assert theirs.tokens == mine.tokens
    assert torch.equal(cached.cache.k[:, mine.seq, :, :n], fresh.cache.k[:, theirs.seq, :, :n])
    assert torch.equal(cached.cache.v[:, mine.seq, :, :n], fresh.cache.v[:, theirs.seq, :, :n])


def test_kept_rows_are_evicted_least_recently_used_first(fused):
    engine = Engine(fused, EngineConfig(max_model_len=64, max_num_seqs=2))
    p1, p2, p3 = [3, 4, 5, 6] * 3, [7, 8, 9, 10] * 3, [11, 12, 13] * 4
    served(engine, p1, rid="1")
    served(engine, p2, rid="2")
    assert len(engine.admission.prefix_cache) == 2
    served(engine, p1 + [20], rid="1b")  # reuses row 1 (now most recently used) and keeps its own
    kept = [r.tokens[: len(p1)] for r in engine.admission.prefix_cache._rows.values()]
    assert p2 not in kept  # the new request's row came from evicting the least recent (p2)
    served(engine, p3, rid="3")
    assert all(r.tokens[:12] != p2 for r in engine.admission.prefix_cache._rows.values())
    assert engine.admission.prefix_cache.hit_tokens == len(p1)


def test_a_hit_makes_its_row_the_most_recently_used(fused):
    """With rows to spare, a hit on the oldest kept row moves it to the back: the next eviction
    takes the row nobody asked for since (p2), not the one just reused (p1)."""
    engine = Engine(fused, EngineConfig(max_model_len=64, max_num_seqs=3))
    p1, p2, p3 = [3, 4, 5, 6] * 3, [7, 8, 9, 10] * 3, [11, 12, 13] * 4
    rows = engine.admission.prefix_cache._rows
    served(engine, p1, rid="1")
    (p1_row,) = rows.values()
    served(engine, p2, rid="2")
    served(engine, p1 + [20], rid="1b")  # a free row: copies p1's prefix, p1's row stays kept
    assert len(rows) == 3 and engine.admission.prefix_cache.hit_tokens == len(p1)
    served(engine, p3, rid="3")
    assert rows.get(p1_row.seq) is p1_row
    assert all(r.tokens[:12] != p2 for r in rows.values())


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=12)])
def test_the_same_prompt_again_hits_all_but_its_last_token(fused, params):
    """A retried request (the same prompt, once more): its whole prompt is kept, but the last
    token must still run to give the first output token's logits, so the hit stops one short."""
    prompt = [(7 * i + 3) % 90 + 3 for i in range(17)]
    engine = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2))
    first = served(engine, prompt, params, "a")
    again = served(engine, prompt, params, "b")
    assert again.finish_reason == first.finish_reason != "error"
    assert again.output_ids == first.output_ids
    assert engine.admission.prefix_cache.hit_tokens == len(prompt) - 1


def test_a_full_engine_takes_the_matching_row_over(fused):
    engine = Engine(fused, EngineConfig(max_model_len=64, max_num_seqs=1))
    a = served(engine, LONG_PROMPT[:20], rid="a")
    b = served(engine, a.context[:-1] + [50, 51], rid="b")
    ref = served(Engine(fused, EngineConfig(max_model_len=64, max_num_seqs=1, enable_prefix_caching=False)),
                 a.context[:-1] + [50, 51], rid="b")
    assert b.output_ids == ref.output_ids
    assert engine.admission.prefix_cache.hit_tokens == len(a.context) - 1


def test_kept_rows_count_against_the_budget_and_give_way(fused):
    engine = Engine(fused, EngineConfig(max_model_len=64, max_num_seqs=4, max_total_tokens=40))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    served(engine, [3, 4, 5] * 4, params, "a")
    served(engine, [6, 7, 8] * 4, params, "b")
    assert engine.admission.prefix_cache.tokens_held == 2 * 19
    served(engine, [9, 10] * 6, params, "c")  # needs 20 slots beside 38 kept: the older row (a) goes
    assert [r.tokens[:3] for r in engine.admission.prefix_cache._rows.values()] == [[6, 7, 8], [9, 10, 9]]
    assert engine.admission.prefix_cache.tokens_held == 38 and engine.admission.kv_reserved == 0


def test_a_hit_hands_drafters_the_hidden_rows_of_the_reused_prefix(fused):
    def recorded(caching):
        e = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2, enable_prefix_caching=caching,
                                       spec=SpecConfig("ngram", 2)))
        e.drafting.drafter = HiddenRecorder(e.config.spec, e.drafter.target)
        a = served(e, LONG_PROMPT[:15], rid="a")
        served(e, a.context[:-1] + [60, 61, 62], rid="b")
        return e, e.drafter.seen["b"][0]

    engine, with_hit = recorded(True)
    assert engine.admission.prefix_cache.hit_tokens > 10
    _, without = recorded(False)
    for layer in without:
        assert torch.equal(with_hit[layer], without[layer])


SYSTEM = [(3 * i + 1) % 90 + 3 for i in range(14)]  # a shared "system prompt"


def test_a_prompt_copies_the_prefix_a_running_request_holds_bit_for_bit(fused):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    shared = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=3, chunked_prefill_size=4))
    shared.add_request(SYSTEM + [40, 41, 42], params, "running")
    shared.step()  # prefilled whole, now decoding: its row holds the system prompt
    late = shared.add_request(SYSTEM + [50, 51, 52, 53], GREEDY, "late")
    shared.step()
    assert late.prefilled >= len(SYSTEM)  # copied, then one chunk of its own
    assert shared.admission.prefix_cache.hit_tokens == len(SYSTEM)
    run(shared)
    alone = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=1))  # nothing to copy: computes it all
    ref = served(alone, SYSTEM + [50, 51, 52, 53], GREEDY, "late")
    assert alone.admission.prefix_cache.hit_tokens == 0
    assert late.output_ids == ref.output_ids
    n = len(ref.context) - 1
    (mine,) = [r for r in shared.admission.prefix_cache._rows.values() if r.tokens == ref.context[:n]]
    (theirs,) = alone.admission.prefix_cache._rows.values()
    assert torch.equal(shared.cache.k[:, mine.seq, :, :n], alone.cache.k[:, theirs.seq, :, :n])
    assert torch.equal(shared.cache.v[:, mine.seq, :, :n], alone.cache.v[:, theirs.seq, :, :n])


def test_prompts_admitted_together_prefill_their_shared_prefix_once(fused):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=5, chunked_prefill_size=16))
    engine.add_request([9, 10, 11], params, "running")
    engine.step()
    prompts = {f"p{i}": SYSTEM + [60 + i, 61 + i] for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, rid)
    outputs, _ = run(engine)
    # p0's first chunk writes the shared prefix; the others copy it and compute only their own tokens
    assert engine.admission.prefix_cache.hit_tokens == 3 * len(SYSTEM)
    alone = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=1, enable_prefix_caching=False))
    for rid, prompt in prompts.items():
        assert outputs[rid] == served(alone, prompt, params, rid).output_ids


def test_a_copied_live_prefix_hands_drafters_its_hidden_rows(fused):
    def recorded(caching):
        e = Engine(fused, EngineConfig(max_model_len=128, max_num_seqs=2, chunked_prefill_size=4,
                                       enable_prefix_caching=caching, spec=SpecConfig("ngram", 2)))
        e.drafting.drafter = HiddenRecorder(e.config.spec, e.drafter.target)
        e.add_request(SYSTEM + [40, 41], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), "a")
        e.step()
        e.add_request(SYSTEM + [70, 71, 72], GREEDY, "b")
        run(e)
        return e, e.drafter.seen["b"][0]

    engine, copied = recorded(True)
    assert engine.admission.prefix_cache.hit_tokens == len(SYSTEM)
    _, computed = recorded(False)
    for layer in computed:
        assert torch.equal(copied[layer], computed[layer])


def test_no_prefix_cache_off_the_batch_invariant_path():
    _, loaded = tiny_loaded("llama")
    assert Engine(loaded, EngineConfig(max_model_len=64)).admission.prefix_cache is None
