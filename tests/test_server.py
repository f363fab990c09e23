"""The OpenAI-compatible server on tiny random models, through the official `openai` client and
raw HTTP: completions and chat, streaming == non-streaming, usage, n/seed/stop, concurrency,
cancelled streams, every error status, metrics, and speculative output == plain output."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from conftest import ToyTokenizer, build_tiny, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engine.engine import Engine
from tandem.launch_server import serve_in_background
from tandem.llm import LLM
from tandem.model.loader import LoadedModel
from tandem.scheduler.cost_model import CostCurve
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "tiny"
MAX_LEN = 128
ROLE_IDS = {"system": 3, "developer": 3, "user": 4, "assistant": 5, "tool": 6}
GEN_PROMPT = 7


class ChatToyTokenizer(ToyTokenizer):
    """ToyTokenizer with a chat template: each message is its role id then its numbers."""

    chat_template = "toy"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [ROLE_IDS[m["role"]]] + self.encode(m["content"])
        return ids + [GEN_PROMPT] if add_generation_prompt else ids


def chat_loaded(arch="llama"):
    _, loaded = tiny_loaded(arch)
    return dataclasses.replace(loaded, tokenizer=ChatToyTokenizer())


def start(loaded, spec=SpecConfig(), max_num_seqs=4, max_queued=64, curve=None, max_len=MAX_LEN):
    engine = Engine(loaded, EngineConfig(max_model_len=max_len, max_num_seqs=max_num_seqs, spec=spec), cost_curve=curve)
    server = serve_in_background(build_app(AsyncEngine(engine, max_queued, ServerMetrics(NAME)), NAME))
    return server, engine


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(server) -> openai.OpenAI:
    """One official client per server (thread-safe; creating one costs ~0.1 s)."""
    if server.url not in _CLIENTS:
        _CLIENTS[server.url] = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    return _CLIENTS[server.url]


def plain_greedy(loaded, prompt_ids, max_tokens):
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=MAX_LEN, max_num_seqs=1))
    out = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.text, out.finish_reason, len(out.token_ids)


def text_of(ids):
    return " ".join(map(str, ids))


PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62, 60, 61, 62], [7] * 11 + [12, 13], [40, 41, 42, 43, 44], [9, 8, 7, 6, 9, 8]]


@pytest.fixture(scope="module")
def spec_server(one_thread):
    """Speculation on (suffix drafter, fixed 4 draft tokens): every answer must equal plain greedy."""
    server, engine = start(chat_loaded(), SpecConfig(algorithm="suffix", num_draft_tokens=4))
    yield server, engine
    server.stop()


def test_models_health_and_unknown_route(spec_server):
    server, _ = spec_server
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client(server).models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("other")
    base = server.url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completion_equals_plain_greedy_and_usage_adds_up(spec_server):
    server, _ = spec_server
    loaded = chat_loaded()
    for prompt in PROMPTS[:3]:
        want_text, want_reason, want_n = plain_greedy(loaded, prompt, 24)
        r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want_text
        assert r.choices[0].finish_reason == want_reason
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == want_n
        assert r.usage.total_tokens == len(prompt) + want_n
        spec = r.model_extra["spec"]
        assert spec["num_target_forwards"] <= want_n
        assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["mean_acceptance_length"] >= 1.0
    # a text prompt goes through the tokenizer
    r = client(server).completions.create(model=NAME, prompt=text_of(PROMPTS[0]), max_tokens=24, temperature=0)
    assert r.choices[0].text == plain_greedy(loaded, PROMPTS[0], 24)[0]


def test_chat_completion_uses_the_template(spec_server):
    server, _ = spec_server
    messages = [{"role": "system", "content": "11 12"}, {"role": "user", "content": "20 21 22 20 21"}]
    ids = ChatToyTokenizer().apply_chat_template(messages)
    want_text, want_reason, want_n = plain_greedy(chat_loaded(), ids, 20)
    r = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want_text
    assert r.choices[0].finish_reason == want_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == want_n
    assert "spec" in r.model_extra


def test_presence_and_frequency_penalties_equal_plain_decoding_with_them(spec_server):
    """The openai client's presence/frequency penalties reach the engine: the speculative server
    answers what plain decoding with the same penalties does, and that differs from no penalty."""
    server, _ = spec_server
    loaded = chat_loaded()
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=MAX_LEN, max_num_seqs=1))
    penalties = {"presence_penalty": 1.2, "frequency_penalty": 0.6}
    moved = False
    for prompt in PROMPTS[:3]:
        want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, **penalties))[0].text
        r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, **penalties)
        assert r.choices[0].text == want
        moved |= want != plain_greedy(loaded, prompt, 24)[0]
    assert moved


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_equal_plain_decodings(spec_server, chat, stream):
    """Logprobs through the openai client, streamed or not: one per output token, each the
    target's log-probability of that token as plain decoding computes it (the speculative server
    grades drafts in forwards of other sizes, so within fp32 rounding), with the asked-for number
    of alternatives, most likely first."""
    server, _ = spec_server
    loaded = chat_loaded()
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=MAX_LEN, max_num_seqs=1))
    prompt = PROMPTS[1]
    ids = [ROLE_IDS["user"], *prompt, GEN_PROMPT] if chat else prompt
    want = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=20, logprobs=3))[0]
    c = client(server)
    if chat:
        kw = dict(model=NAME, messages=[{"role": "user", "content": text_of(prompt)}], max_tokens=20, temperature=0,
                  logprobs=True, top_logprobs=3)
        if stream:
            entries = [e for ch in c.chat.completions.create(**kw, stream=True)
                       if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        else:
            entries = c.chat.completions.create(**kw).choices[0].logprobs.content
        assert [e.token for e in entries] == [f"<{t}>" for t in want.token_ids]
        assert [e.bytes for e in entries] == [list(f"<{t}>".encode()) for t in want.token_ids]
        got, tops = [e.logprob for e in entries], [[t.token for t in e.top_logprobs] for e in entries]
    else:
        kw = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=0, logprobs=3)
        if stream:
            parts = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True)
                     if ch.choices and ch.choices[0].logprobs]
            tokens = [t for p in parts for t in p.tokens]
            got = [lp for p in parts for lp in p.token_logprobs]
            top_dicts = [d for p in parts for d in p.top_logprobs]
            offsets = [o for p in parts for o in p.text_offset]
        else:
            lp = c.completions.create(**kw).choices[0].logprobs
            tokens, got, top_dicts, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
        assert tokens == [f"<{t}>" for t in want.token_ids]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        tops = [sorted(d, key=d.get, reverse=True) for d in top_dicts]
    assert got == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert tops == [[f"<{t}>" for t, _ in e.top] for e in want.logprobs]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 6])
def test_echo_scores_the_prompt(spec_server, stream, max_tokens):
    """Completions' echo: the prompt's text first, then what was generated (nothing with
    max_tokens 0, as evaluation harnesses score a text), and with logprobs the prompt tokens'
    first (the first one's null), each the target's teacher-forced log-probability."""
    server, _ = spec_server
    prompt = PROMPTS[0]
    llm = LLM.from_loaded(chat_loaded(), EngineConfig(max_model_len=MAX_LEN, max_num_seqs=1))
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max(max_tokens, 1), logprobs=2,
                                               prompt_logprobs=2))[0]
    prompt_text = "".join(f"<{t}>" for t in prompt)
    kw = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2)
    c = client(server)
    if stream:
        chunks = [ch for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True})]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
        merged = {f: [x for p in parts for x in getattr(p, f)] for f in ("tokens", "token_logprobs", "text_offset")}
        reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
        usage = chunks[-1].usage
    else:
        r = c.completions.create(**kw)
        text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        merged = {f: getattr(r.choices[0].logprobs, f) for f in ("tokens", "token_logprobs", "text_offset")}
    generated = [] if max_tokens == 0 else want.token_ids
    assert text == prompt_text + ("" if max_tokens == 0 else want.text)
    assert merged["tokens"] == [f"<{t}>" for t in prompt + generated]
    assert merged["token_logprobs"][0] is None
    scored = [e.logprob for e in want.prompt_logprobs[1:]] + ([] if max_tokens == 0 else [e.logprob for e in want.logprobs])
    assert merged["token_logprobs"][1:] == pytest.approx(scored, abs=1e-4)
    assert merged["text_offset"][: len(prompt)] == [len("".join(f"<{t}>" for t in prompt[:i])) for i in range(len(prompt))]
    if generated:
        assert merged["text_offset"][len(prompt)] == len(prompt_text)
    assert (reason == "length") if max_tokens == 0 else reason == want.finish_reason
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(generated)


def test_logit_bias_reaches_the_engine(spec_server):
    """The openai client's logit_bias: the speculative server answers what plain decoding with
    the same bias does, and a bias of 100 forces a token."""
    server, _ = spec_server
    llm = LLM.from_loaded(chat_loaded(), EngineConfig(max_model_len=MAX_LEN, max_num_seqs=1))
    free = plain_greedy(chat_loaded(), PROMPTS[2], 16)[0]
    bias = {5: -100.0, 60: -100.0, 7: -100.0, 33: 2.0}
    want = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=16, logit_bias=bias))[0].text
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                          logit_bias={str(t): b for t, b in bias.items()})
    assert r.choices[0].text == want != free
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, logit_bias={"44": 100})
    assert r.choices[0].text == "<44>" * 4


def test_no_logprobs_field_unless_asked(spec_server):
    server, _ = spec_server
    r = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "1 2"}], max_tokens=4)
    assert r.choices[0].logprobs is None
    r = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "1 2"}], max_tokens=4,
                                               logprobs=True)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_max_completion_tokens_is_max_tokens(spec_server):
    """OpenAI's newer name (what current clients and load generators such as guidellm send)."""
    server, _ = spec_server
    messages = [{"role": "user", "content": "20 21 22"}]
    r = client(server).chat.completions.create(model=NAME, messages=messages, max_completion_tokens=7, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=NAME, messages=messages, max_completion_tokens=7, max_tokens=8)


def sse_events(url, body):
    """Raw server-sent events of one streamed request: the JSON payloads and the final marker."""
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming(spec_server, chat):
    server, _ = spec_server
    c = client(server)
    kw = dict(model=NAME, max_tokens=30, temperature=0)
    if chat:
        kw["messages"] = [{"role": "user", "content": text_of(PROMPTS[1])}]
        full = c.chat.completions.create(**kw)
        stream = c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        want = full.choices[0].message.content
    else:
        kw["prompt"] = PROMPTS[1]
        full = c.completions.create(**kw)
        stream = c.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        want = full.choices[0].text
    assert text == want and len(chunks) > 2  # streamed in pieces
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    # Raw SSE: JSON events, then [DONE] last; without include_usage there is no usage event.
    path = "/chat/completions" if chat else "/completions"
    body = {k: v for k, v in kw.items()} | {"stream": True}
    events = sse_events(server.url + path, body)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p.get("usage") is None for p in payloads)


@pytest.fixture(scope="module")
def plain_server(one_thread):
    server, engine = start(chat_loaded())
    yield server, engine
    server.stop()


def test_n_choices_with_seeds(plain_server):
    # Plain decoding: under speculation a seed fixes the sample only for identical drafts, and
    # the suffix drafter's shared state changes drafts from one request to the next.
    server, _ = plain_server
    c = client(server)
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, n=3, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded: reproducible
    assert len({ch.text for ch in a.choices}) > 1  # each choice has its own stream of randomness
    other = c.completions.create(**{**kw, "seed": 8})
    assert [ch.text for ch in other.choices] != [ch.text for ch in a.choices]
    assert a.usage.prompt_tokens == len(PROMPTS[0])
    assert a.usage.completion_tokens == 3 * 16  # 16 each unless one sampled EOS
    # n also streams: every choice index finishes once
    chunks = list(c.completions.create(**kw, stream=True))
    finished = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert finished == [0, 1, 2]
    texts = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [ch.text for ch in a.choices]


def _stop_in_first_only(a: str, b: str) -> str:
    """A piece of text a holds and b does not (texts here are runs of '<id>' pieces)."""
    pieces = [f"<{p}" for p in a.split("<") if p]
    return next(p for p in pieces[1:] if p not in b)


def test_each_choice_gets_its_own_prompts_answer_and_finish(plain_server):
    """Two prompts x n = 2: choice i answers prompt i // n, with its own text and its own finish
    reason (a stop string only one prompt's answer reaches), streamed or not, on completions and chat."""
    server, _ = plain_server
    c = client(server)
    greedy = dict(model=NAME, max_tokens=12, temperature=0)
    single = [c.completions.create(prompt=p, **greedy).choices[0].text for p in PROMPTS[:2]]
    stop = _stop_in_first_only(single[0], single[1])
    want_text = [single[0][: single[0].index(stop)], single[1]]
    for stream in (False, True):
        r = c.completions.create(prompt=PROMPTS[:2], n=2, stop=[stop], stream=stream, **greedy)
        if stream:
            chunks = [ch.choices[0] for ch in r if ch.choices]
            got = {i: ("".join(ch.text for ch in chunks if ch.index == i),
                       next(ch.finish_reason for ch in chunks if ch.index == i and ch.finish_reason)) for i in range(4)}
        else:
            got = {ch.index: (ch.text, ch.finish_reason) for ch in r.choices}
        assert [got[i] for i in range(4)] == [(want_text[0], "stop")] * 2 + [(want_text[1], "length")] * 2, stream
    # chat: one prompt, n = 2 seeded choices that differ; a stop string only the first one reaches
    kw = dict(model=NAME, messages=[{"role": "user", "content": text_of(PROMPTS[0])}], max_tokens=16,
              temperature=1.0, n=2, seed=7)
    free = c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in sorted(free.choices, key=lambda ch: ch.index)]
    assert texts[0] != texts[1] and free.choices[1].finish_reason == "length"
    stop = _stop_in_first_only(texts[0], texts[1])
    cut = c.chat.completions.create(**kw, stop=[stop])
    got = [(ch.message.content, ch.finish_reason) for ch in sorted(cut.choices, key=lambda ch: ch.index)]
    assert got == [(texts[0][: texts[0].index(stop)], "stop"), (texts[1], "length")]


def test_null_sampling_fields_mean_their_defaults(spec_server):
    """OpenAI's fields are nullable (the playground sends null for a cleared box): null temperature,
    top_p, top_k, n ... are the defaults, not a 400."""
    server, _ = spec_server
    base = {"prompt": PROMPTS[0], "max_tokens": 6, "seed": 3, "speculative_num_draft_tokens": 0}  # seeded: exact
    want = httpx.post(server.url + "/completions", json=base, timeout=30).json()["choices"][0]["text"]
    r = httpx.post(server.url + "/completions", json={**base, "temperature": None, "top_p": None, "top_k": None,
                                                     "n": None, "stream": None, "presence_penalty": None}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_stop_token_ids_end_the_choice_without_their_text(spec_server):
    """vLLM's stop_token_ids: the answer ends after the first of them, which counts as a
    completion token and leaves no text, and unknown fields are ignored."""
    server, engine = spec_server
    full = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True}, timeout=30).json()
    ids = [int(t) for t in re.findall(r"<(\d+)>", full["choices"][0]["text"])]
    stop = ids[4]
    cut = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                                       "ignore_eos": True, "stop_token_ids": [stop],
                                                       "best_of": 1}, timeout=30).json()
    first = ids.index(stop)
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == "".join(f"<{t}>" for t in ids[:first])
    assert cut["usage"]["completion_tokens"] == first + 1


def test_min_tokens_holds_back_stop_token_ids(spec_server):
    """vLLM's min_tokens, through the openai client's extra_body: a stop token the answer would
    end on early cannot be drawn before it; more than max_tokens is a 400 naming the field."""
    server, _ = spec_server
    c = client(server)
    full = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    ids = [int(t) for t in re.findall(r"<(\d+)>", full)]
    stop = ids[2]
    held = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 6})
    got = [int(t) for t in re.findall(r"<(\d+)>", held.choices[0].text)]
    assert stop not in got[:6] and held.usage.completion_tokens >= 6
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, extra_body={"min_tokens": 5})
    assert err.value.body["param"] == "min_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # no max_tokens: the room the prompt leaves
        c.completions.create(model=NAME, prompt=PROMPTS[0], extra_body={"min_tokens": MAX_LEN})
    assert err.value.body["param"] == "min_tokens" and "room" in err.value.body["message"]


def test_stop_string_ends_the_choice(spec_server):
    server, _ = spec_server
    c = client(server)
    full = c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0).choices[0].text
    pieces = full.split(">")
    stop = pieces[3] + ">"  # the 4th token's text
    r = c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    assert stop not in r.choices[0].text


def test_concurrent_requests_equal_single_request_output(spec_server):
    server, engine = spec_server
    loaded = chat_loaded()
    prompts = [p[i:] + p[:i] for p in PROMPTS for i in range(3)]  # 15 prompts, 4 run at a time
    want = [plain_greedy(loaded, p, 16)[0] for p in prompts]

    def one(p):
        return client(server).completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == want
    assert engine.cache.num_free == engine.config.max_num_seqs


def test_cancelled_streams_abort_and_free_the_cache(spec_server):
    server, engine = spec_server

    async def cancel_one(http, i):
        body = {"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 100, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", server.url + "/completions", json=body) as r:
            assert r.status_code == 200
            if i % 2:  # half leave while still queued, half after their first tokens
                await asyncio.sleep(0.05)
                return
            async for line in r.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    return

    async def cancel_all():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(cancel_one(http, i) for i in range(50)))

    asyncio.run(cancel_all())
    t0 = time.perf_counter()
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert time.perf_counter() - t0 < 10  # not stuck behind 50 abandoned 100-token requests
    deadline = time.monotonic() + 10
    while (engine.has_work() or engine.cache.num_free != engine.config.max_num_seqs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_work()
    assert engine.cache.num_free == engine.config.max_num_seqs
    assert engine.drafter is not None and engine.policy is not None


def test_non_streaming_request_is_aborted_when_its_client_leaves():
    server, engine = start(chat_loaded(), max_len=8192)
    try:
        # ~8000 steps: far longer than the client waits, so only an abort can end it soon.
        body = {"prompt": [5], "max_tokens": 8000, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 1  # the server hears the disconnect at once, the engine at its next step
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.has_work()
        assert engine.cache.num_free == engine.config.max_num_seqs
        aborted = [line for line in httpx.get(server.url.removesuffix("/v1") + "/metrics").text.splitlines()
                   if line.startswith("tandem:request_success_total") and 'finished_reason="abort"' in line]
        assert aborted and float(aborted[0].rsplit(" ", 1)[1]) == 1
    finally:
        server.stop()


ERRORS = [
    # (path, body, status, param)
    ("/completions", {"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ("/completions", {"prompt": [1, 2], "temperature": 2.5}, 400, "temperature"),
    ("/completions", {"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("/completions", {"prompt": [1, 2], "top_p": 1.5}, 400, "top_p"),
    ("/completions", {"prompt": [1, 2], "max_tokens": -5}, 400, "max_tokens"),
    ("/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("/completions", {"prompt": [1, 2], "max_tokens": 10**9}, 400, "max_tokens"),
    ("/completions", {"prompt": [1] * (MAX_LEN + 5)}, 400, "prompt"),
    ("/completions", {"prompt": [1, 200]}, 400, "prompt"),
    ("/completions", {"prompt": []}, 400, "prompt"),
    ("/completions", {"prompt": [1, 2], "n": 1000}, 400, "n"),
    ("/completions", {"prompt": [1, 2], "stop": [""]}, 400, "stop"),
    ("/completions", {"prompt": [1, 2], "logprobs": 21}, 400, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1"}], "echo": True}, 400, "echo"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"500": 1}}, 400, "logit_bias"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs"),
    ("/completions", {"prompt": [1, 2], "seed": 2**70}, 400, "seed"),
    ("/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/completions", {"prompt": [1, 2], "model": "gpt-4"}, 404, "model"),
    ("/chat/completions", {"messages": []}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "wizard", "content": "1"}]}, 400, "messages.0.role"),
    ("/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("/chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "1"}]}, 400,
     "messages.0"),
    ("/completions", {"prompt": [1, 2], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/completions", {"prompt": [1, 2], "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1 2"}], "model": "nope"}, 404, "model"),
    ("/chat/completions", {"messages": [{"role": "user", "content": " ".join(["1"] * MAX_LEN)}]}, 400, "messages"),
    # a lone UTF-16 surrogate (JSON's "\ud800" without its pair) anywhere: no tokenizer or grammar takes it
    ("/completions", {"prompt": "1 \ud800"}, 400, "prompt"),
    ("/completions", {"prompt": ["1", "2 \udc00"]}, 400, "prompt.1"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1 \ud800"}]}, 400, "messages.0.content"),
    ("/completions", {"prompt": [1, 2], "stop": ["\ud800"]}, 400, "stop.0"),
    ("/completions", {"prompt": [True, False]}, 400, "prompt"),  # not token ids
    ("/completions", {"prompt": [1, 2], "temperature": float("nan")}, 400, "temperature"),
    ("/completions", {"prompt": [1, 2], "stop_token_ids": [500]}, 400, "stop_token_ids"),
    ("/completions", {"prompt": [1, 2], "max_tokens": 3, "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ("/completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # a top_k past int64 broke the engine's step for every request in it
    ("/completions", {"prompt": [1, 2], "top_k": 2**64, "temperature": 1.0}, 400, "top_k"),
    # a lone surrogate in a key is named with the surrogate escaped (a 500 before: the body could not be encoded)
    ("/completions", {"prompt": [1, 2], "\ud800": 1}, 400, "\\ud800"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"\ud800": 1}}, 400, "logit_bias.\\ud800"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"\u0665": 1}}, 400, "logit_bias"),  # an Arabic-Indic 5
    ("/completions", {"prompt": [1, 2], "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    ("/chat/completions", {"messages": [{"role": "user",
                                          "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    # the wrong JSON type is refused, not converted (as OpenAI's API does)
    ("/completions", {"prompt": [1, 2], "max_tokens": "7"}, 400, "max_tokens"),
    ("/completions", {"prompt": [1, 2], "max_tokens": True}, 400, "max_tokens"),
    ("/completions", {"prompt": [1, 2], "max_tokens": 7.0}, 400, "max_tokens"),
    ("/completions", {"prompt": [1, 2], "n": "2"}, 400, "n"),
    ("/completions", {"prompt": [1, 2], "seed": True}, 400, "seed"),
    ("/completions", {"prompt": [1, 2], "temperature": True}, 400, "temperature"),
    ("/completions", {"prompt": [1, 2], "temperature": "0.5"}, 400, "temperature"),
    ("/completions", {"prompt": [1, 2], "logprobs": True}, 400, "logprobs"),
    ("/completions", {"prompt": [1, 2], "logit_bias": {"5": True}}, 400, "logit_bias.5"),
    ("/completions", {"prompt": [1, 2], "stream": 1}, 400, "stream"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1"}], "logprobs": 1}, 400, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": True},
     400, "top_logprobs"),
]


@pytest.mark.parametrize("path, body, status, param", ERRORS)
def test_errors_use_the_openai_body(spec_server, path, body, status, param):
    server, _ = spec_server
    # json.dumps escapes lone surrogates as JSON does ("\ud800") and writes NaN as Python's json reads it
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_too_many_generations_are_refused_before_any_prompt_is_tokenized(spec_server, monkeypatch):
    """prompts x n past what the server holds is a 400 naming n, decided from the count alone: a
    list of thousands of prompts is not tokenized first."""
    server, _ = spec_server
    from tandem.server import app as app_module

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a prompt was tokenized")

    monkeypatch.setattr(app_module, "_encode_prompt", no_tokenizing)
    r = httpx.post(server.url + "/completions", json={"prompt": ["1 2"] * 5000, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "5000 prompts" in r.json()["error"]["message"]


def test_malformed_json_and_client_exceptions(spec_server):
    server, _ = spec_server
    r = httpx.post(server.url + "/completions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=NAME, prompt=[1, 2], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=[{"role": "user", "content": "1"}])


def test_metrics_count_what_responses_report(spec_server):
    server, _ = spec_server
    base = server.url.removesuffix("/v1")

    def scrape():
        """{(name, frozenset of label pairs): value} from the Prometheus text format."""
        values = {}
        for line in httpx.get(f"{base}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, _, labels = series.partition("{")
                pairs = frozenset(tuple(kv.split("=", 1)) for kv in labels.rstrip("}").split(",") if kv)
                values[(name, pairs)] = float(value)
        return values

    def metric(values, name, **labels):
        want = frozenset([("model_name", f'"{NAME}"')] + [(k, f'"{v}"') for k, v in labels.items()])
        return values.get((name, want), 0.0)

    before = scrape()
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=30, temperature=0)
    after = scrape()
    spec = r.model_extra["spec"]
    for key, name in [("num_drafts", "tandem:spec_decode_num_drafts_total"),
                      ("num_draft_tokens", "tandem:spec_decode_num_draft_tokens_total"),
                      ("num_accepted_tokens", "tandem:spec_decode_num_accepted_tokens_total")]:
        assert metric(after, name) - metric(before, name) == spec[key], name
    for pos, count in enumerate(spec["accepted_per_position"]):
        name = "tandem:spec_decode_num_accepted_tokens_per_pos_total"
        assert metric(after, name, position=pos) - metric(before, name, position=pos) == count
    assert metric(after, "tandem:request_success_total", finished_reason="length") - \
        metric(before, "tandem:request_success_total", finished_reason="length") == 1
    assert metric(after, "tandem:generation_tokens_total") - metric(before, "tandem:generation_tokens_total") == 30
    assert metric(after, "tandem:prompt_tokens_total") - metric(before, "tandem:prompt_tokens_total") == len(PROMPTS[3])
    assert metric(after, "tandem:time_to_first_token_seconds_count") - metric(before, "tandem:time_to_first_token_seconds_count") == 1
    assert metric(after, "tandem:inter_token_latency_seconds_count") - metric(before, "tandem:inter_token_latency_seconds_count") == 29
    assert metric(after, "tandem:e2e_request_latency_seconds_count") - metric(before, "tandem:e2e_request_latency_seconds_count") == 1
    assert metric(after, "tandem:num_requests_running") == 0
    assert metric(after, "tandem:num_requests_waiting") == 0
    # tau from the counters is the response's
    name = "tandem:spec_decode_num_forwards_total"
    forwards = metric(after, name) - metric(before, name)
    assert forwards == spec["num_target_forwards"] and round(30 / forwards, 4) == spec["mean_acceptance_length"]
    # a scored prompt (echo, max_tokens 0) draws a token no answer holds: no generated token, and
    # `length` as the answer says, even where the draw was EOS
    before = scrape()
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=0, echo=True, temperature=0,
                                          logit_bias={"2": 100})
    after = scrape()
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert metric(after, "tandem:generation_tokens_total") == metric(before, "tandem:generation_tokens_total")
    for reason, added in (("length", 1), ("stop", 0)):
        name = "tandem:request_success_total"
        assert metric(after, name, finished_reason=reason) - metric(before, name, finished_reason=reason) == added
    assert metric(after, "tandem:prompt_tokens_total") - metric(before, "tandem:prompt_tokens_total") == len(PROMPTS[3])
    # n choices share one prompt: counted once, as usage counts it
    before = scrape()
    r = client(server).completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=4, temperature=0, n=3)
    after = scrape()
    assert r.usage.prompt_tokens == len(PROMPTS[3])
    assert metric(after, "tandem:prompt_tokens_total") - metric(before, "tandem:prompt_tokens_total") == len(PROMPTS[3])


def test_a_call_cancelled_before_its_first_token_counts_no_prompt_tokens():
    """tandem:prompt_tokens counts what the responses' usage counts: a call whose client left
    while it waited for a running slot has no usage."""
    server, engine = start(chat_loaded(), max_num_seqs=1, max_len=8192)

    def prompt_tokens() -> float:
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
        return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                          if line.startswith("tandem:prompt_tokens_total")))

    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # its first token came: it holds the one running slot
            counted = prompt_tokens()
            assert counted == len(PROMPTS[0])
            with pytest.raises(httpx.ReadTimeout):  # waits for the slot, then its client leaves
                httpx.post(server.url + "/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}, timeout=0.5)
            deadline = time.monotonic() + 10
            while engine.waiting and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not engine.waiting and prompt_tokens() == counted
    finally:
        server.stop()


def test_full_queue_returns_503():
    # Held requests long enough that neither can finish while the full queue is probed (120
    # tokens of the tiny model once ended within the probes on a fast CPU); leaving aborts them.
    server, engine = start(chat_loaded(), max_num_seqs=1, max_queued=1, max_len=8192)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            holds = [http.stream("POST", server.url + "/completions", json=body) for _ in range(2)]
            responses = [h.__enter__() for h in holds]  # one running, one queued
            assert [r.status_code for r in responses] == [200, 200]
            r = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"]
            with pytest.raises(openai.InternalServerError):
                client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)
            for h in holds:
                h.__exit__(None, None, None)
        deadline = time.monotonic() + 10
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client(server).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)  # room again
        assert r.usage.completion_tokens >= 1
    finally:
        server.stop()


def test_nan_logits_end_only_that_request():
    _, model = build_tiny("qwen2", seed=3)  # untied LM head: a NaN embedding row poisons only its own sequence
    model.embed.data[96] = math.nan
    loaded = LoadedModel(model, ChatToyTokenizer(), model.cfg, "tiny-nan", torch.float32, "none")
    server, engine = start(loaded, SpecConfig(algorithm="suffix", num_draft_tokens=3))
    try:
        good_prompt = PROMPTS[1]
        want = plain_greedy(loaded, good_prompt, 24)[0]

        def good():
            return client(server).completions.create(model=NAME, prompt=good_prompt, max_tokens=24, temperature=0)

        def bad():
            return httpx.post(server.url + "/completions", json={"prompt": [5, 96, 7], "max_tokens": 24}, timeout=30)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(good), pool.submit(bad), pool.submit(good)]
            results = [f.result() for f in futures]
        assert results[0].choices[0].text == want and results[2].choices[0].text == want
        assert results[1].status_code == 500
        assert "NaN" in results[1].json()["error"]["message"]
        events = sse_events(server.url + "/completions", {"prompt": [5, 96, 7], "max_tokens": 5, "stream": True})
        assert "error" in json.loads(events[0]) and events[-1] == "[DONE]"
        assert engine.cache.num_free == engine.config.max_num_seqs
    finally:
        server.stop()


def test_a_step_that_fails_for_one_request_ends_only_that_request():
    """A forward that raises whenever one request's rows are in it (a bug, not bad logits): that
    request gets a 500 naming the failure, and the streams beside it finish with their own text."""
    loaded = chat_loaded()
    server, engine = start(loaded, SpecConfig(algorithm="suffix", num_draft_tokens=3))
    bad_prompt = [5, 96, 7]
    forward = engine.runner.forward

    def failing(inputs, *args, **kwargs):
        bad = {r.seq for r in [*engine.running, *engine.prefilling] if r.prompt_ids == bad_prompt}
        if any(i.seq in bad for i in inputs):
            raise RuntimeError("a kernel fault")
        return forward(inputs, *args, **kwargs)

    engine.runner.forward = failing
    try:
        want = plain_greedy(loaded, PROMPTS[1], 24)[0]

        def good():
            stream = client(server).completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                                       stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)

        def bad():
            return httpx.post(server.url + "/completions", json={"prompt": bad_prompt, "max_tokens": 24}, timeout=30)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(good), pool.submit(bad), pool.submit(good)]
            results = [f.result() for f in futures]
        assert results[0] == want and results[2] == want
        assert results[1].status_code == 500
        assert "RuntimeError" in results[1].json()["error"]["message"]
        events = sse_events(server.url + "/completions", {"prompt": bad_prompt, "max_tokens": 5, "stream": True})
        assert "RuntimeError" in json.loads(events[0])["error"]["message"] and events[-1] == "[DONE]"
        assert engine.admission.kv_reserved == 0
    finally:
        server.stop()


def test_a_failure_outside_every_requests_round_ends_those_in_flight_and_the_server_goes_on():
    """What no request's round can be blamed for (here: admission) ends the requests in flight
    with an error; the next request is served."""
    loaded = chat_loaded()
    server, engine = start(loaded, max_len=8192)
    admit = engine.admission.admit
    failing = threading.Event()

    def broken(waiting):
        if failing.is_set() and waiting:
            failing.clear()
            raise RuntimeError("an admission bug")
        return admit(waiting)

    engine.admission.admit = broken
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/completions", json=body) as running:
            lines = running.iter_lines()
            next(lines)
            failing.set()  # the next request's admission raises
            r = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}, timeout=30)
            assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert any("engine failed" in e.get("error", {}).get("message", "") for e in rest)
            assert rest[-1]["choices"][0]["finish_reason"] == "error"
        want = plain_greedy(loaded, PROMPTS[1], 4)[0]
        assert client(server).completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=4,
                                                 temperature=0).choices[0].text == want
        assert engine.admission.kv_reserved == 0
    finally:
        server.stop()


def test_adaptive_policy_server_is_lossless_under_load():
    cheap = CostCurve.from_points({1: 0.01, 64: 0.0101, 128: 0.0102})
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=5, policy="adaptive")
    server, engine = start(chat_loaded(), spec, curve=cheap)
    try:
        loaded = chat_loaded()
        want = [plain_greedy(loaded, p, 30)[0] for p in PROMPTS]

        def one(p):
            return client(server).completions.create(model=NAME, prompt=p, max_tokens=30, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(one, PROMPTS)) == want
        assert engine.stats.num_draft_tokens > 0  # the cheap curve made it speculate
    finally:
        server.stop()


def test_tree_launch_flags_reach_the_spec_config():
    import argparse

    from tandem.launch_server import add_serve_args, configs_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([
        "--speculative-algorithm", "eagle3", "--speculative-num-draft-tokens", "16",
        "--speculative-eagle-topk", "4", "--speculative-num-steps", "6", "--no-speculative-lookup",
    ])
    spec = configs_from_args(args)[0].spec
    assert (spec.algorithm, spec.num_draft_tokens, spec.eagle_topk, spec.num_steps) == ("eagle3", 16, 4, 6)
    assert spec.tree and not spec.lookup and spec.max_draft_len == 6
    assert configs_from_args(parser.parse_args([]))[0].spec.lookup


def test_an_event_whose_text_holds_unicode_line_separators_stays_one_line():
    """U+2028, U+2029 and NEL are valid raw in JSON, but line readers such as httpx's split on
    them: every event goes out on one line, and decodes to the same text."""
    from httpx._decoders import LineDecoder

    from tandem.server.answers import sse
    from tandem.server.responses import ChatCompletionChunk

    text = "a\u2028b\x85c\u2029d \u00e9"
    chunk = ChatCompletionChunk(id="x", model="m", choices=[{"index": 0, "delta": {"content": text}}])
    for event in (sse(json.dumps({"text": text}, ensure_ascii=False)), sse(chunk)):
        lines = [line for line in LineDecoder().decode(event) if line]
        assert len(lines) == 1 and lines[0].startswith("data: {")
        decoded = json.loads(lines[0][6:])
        assert (decoded.get("text") or decoded["choices"][0]["delta"]["content"]) == text
