"""What no single request may do to the server: an API key shuts out every route but /health, an
oversized body is refused unread (413), a prompt that cannot fit the context is refused before it
is tokenized, and tokenizing runs off the event loop so other requests keep flowing."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import ToyTokenizer, tiny_loaded
from tandem.config import EngineConfig, ServerConfig
from tandem.engine.engine import Engine
from tandem.launch_server import add_serve_args, configs_from_args, serve_in_background
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.context import longest_token_chars
from tandem.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "tiny"
MAX_LEN = 128
KEY = "sk-tandem-test"


class VocabTokenizer(ToyTokenizer):
    """ToyTokenizer with a vocabulary to read (entries of up to 8 characters, which covers any
    number it encodes plus its separating space) and a switch that holds encode() until released."""

    hold = threading.Event()
    held = threading.Event()
    encode_calls = 0
    chat_template = "toy"

    def get_vocab(self):
        return {"12345678": 1, "7": 7}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [4] + [t for m in messages for t in self.encode(m["content"])] + [7]

    def encode(self, text):
        VocabTokenizer.encode_calls += 1
        if text.startswith("hold"):
            VocabTokenizer.held.set()
            assert VocabTokenizer.hold.wait(30)
            text = text.removeprefix("hold")
        return super().encode(text)


def start(server_kwargs: dict | None = None, max_len: int = MAX_LEN, **app_kwargs):
    _, loaded = tiny_loaded("llama")
    loaded = dataclasses.replace(loaded, tokenizer=VocabTokenizer())
    engine = Engine(loaded, EngineConfig(max_model_len=max_len, max_num_seqs=4))
    return serve_in_background(build_app(AsyncEngine(engine, 16, ServerMetrics(NAME)), NAME, **app_kwargs),
                               **(server_kwargs or {}))


@pytest.fixture(scope="module")
def keyed_server():
    server = start(api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_server():
    server = start()
    yield server
    server.stop()


def root(server) -> str:
    return server.url.removesuffix("/v1")


def test_api_key_is_required_on_every_route_but_health_and_the_page(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url, api_key=KEY, max_retries=0)
    r = good.completions.create(model=NAME, prompt="5 6 7", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=keyed_server.url, api_key="wrong", max_retries=0).models.list()
    assert err.value.status_code == 401
    assert err.value.body["code"] == "invalid_api_key"
    base = root(keyed_server)
    assert httpx.get(f"{base}/health").status_code == 200
    page = httpx.get(f"{base}/")  # static; the requests it sends carry the key typed into it
    assert page.status_code == 200 and "API key" in page.text
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    # only the whole key: not a prefix of it, not it with more, not an empty token
    for token in (KEY[:-1], KEY[:1], KEY + "x", ""):
        header = f"Bearer {token}".strip()  # httpx sends no trailing space: "Bearer" alone
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": header}).status_code == 401, token


def test_a_20_mb_request_is_refused_unread_and_the_next_one_is_served(open_server):
    url = f"{open_server.url}/chat/completions"
    huge = json.dumps({"messages": [{"role": "user", "content": "1 " * (10 * 2**20)}], "max_tokens": 4}).encode()
    before = VocabTokenizer.encode_calls
    t = time.monotonic()
    r = httpx.post(url, content=huge, headers={"Content-Type": "application/json"}, timeout=30)
    refused_after = time.monotonic() - t
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert refused_after < 5, f"refusing took {refused_after:.1f} s"
    assert VocabTokenizer.encode_calls == before
    client = openai.OpenAI(base_url=open_server.url, api_key="unused", max_retries=0)
    r = client.completions.create(model=NAME, prompt="5 6 7", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_a_chunked_body_over_the_cap_is_refused():
    server = start(max_request_bytes=4096)
    try:
        def chunks():
            for _ in range(64):
                yield b" " * 1024

        r = httpx.post(f"{server.url}/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        small = httpx.post(f"{server.url}/completions", json={"prompt": "5 6", "max_tokens": 2})
        assert small.status_code == 200
    finally:
        server.stop()


def raw_exchange(server, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send `data` on a fresh connection, send nothing more, and read until the server closes it."""
    with socket.create_connection((server.host, server.port), timeout=wait_s) as conn:
        if data:
            conn.sendall(data)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    return got


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.fixture(scope="module")
def impatient_server():
    server = start({"read_timeout_s": 0.5, "max_header_bytes": 4096, "drain_timeout_s": 0.5},
                   request_read_timeout_s=0.5, max_request_header_bytes=4096, max_len=8192)
    yield server
    server.stop()


def test_headers_that_stop_arriving_get_408_and_an_idle_connection_is_closed(impatient_server):
    t = time.monotonic()
    status, error = status_and_error(raw_exchange(impatient_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))
    assert status == 408 and error["code"] == "request_timeout" and "--request-read-timeout" in error["message"]
    assert raw_exchange(impatient_server, b"") == b""  # nothing sent, nobody to answer: closed
    assert time.monotonic() - t < 8
    # A keep-alive connection serves request after request, each well within the timeout.
    with httpx.Client(timeout=10) as http:
        for _ in range(3):
            r = http.post(f"{impatient_server.url}/completions", json={"prompt": "5 6", "max_tokens": 2})
            assert r.status_code == 200
            time.sleep(0.3)


def test_headers_over_the_cap_get_431(impatient_server):
    """Whether they arrive at once (the app refuses them) or keep coming in pieces (the
    connection does, before they end)."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 8192 + b"\r\n\r\n"
    status, error = status_and_error(raw_exchange(impatient_server, head))
    assert status == 431 and error["code"] == "request_header_too_large"
    with socket.create_connection((impatient_server.host, impatient_server.port), timeout=10) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for i in range(100):  # until the answer is there (sending past the close would reset it)
            if select.select([conn], [], [], 0.01)[0]:
                break
            conn.sendall(f"X-Padding-{i}: {'a' * 200}\r\n".encode())
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    status, error = status_and_error(got)
    assert status == 431 and error["code"] == "request_header_too_large"


def test_headers_piling_up_behind_an_answer_close_the_connection(impatient_server):
    """A client that streams the next request's headers behind a long answer on the same
    connection: they count against the cap as well (they were read without end), and as no
    status line can cut into the answer being written, the connection closes."""
    body = json.dumps({"prompt": "5 6", "max_tokens": 8000, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    # Loopback socket buffers take a few MB unread, so a busy server may not have read the first
    # MB yet: offer far more than buffers hold (a server that read on without end would take it all).
    limit = 64 * 2**20
    with socket.create_connection((impatient_server.host, impatient_server.port), timeout=20) as conn:
        conn.sendall(head + body + b"GET /health HTTP/1.1\r\nHost: x\r\n")
        got, sent, closed = b"", 0, False
        try:
            while sent < limit:
                conn.sendall(f"X-Pad-{sent}: {'a' * 500}\r\n".encode())
                sent += 512
                if select.select([conn], [], [], 0)[0]:
                    chunk = conn.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    got += chunk
        except TimeoutError:  # nobody read what we sent: not a close
            pass
        except OSError:  # closed while we sent
            closed = True
        try:
            while chunk := conn.recv(65536):
                got += chunk
            closed = True
        except TimeoutError:
            pass
        except OSError:
            closed = True
    assert closed and sent < limit and b"data: [DONE]" not in got  # closed long before the answer ended


def test_a_refused_key_reads_the_body_it_came_with_and_closes(keyed_server):
    body = b'{"prompt": "5", "pad": "' + b"a" * 300_000 + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    response = raw_exchange(keyed_server, head + body)
    status, error = status_and_error(response)
    assert status == 401 and error["code"] == "invalid_api_key" and response.count(b"HTTP/1.1") == 1


def test_malformed_http_gets_an_openai_error_body(open_server):
    status, error = status_and_error(raw_exchange(open_server, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and error["code"] == "invalid_http_request"


def test_an_oversized_body_announced_with_expect_100_continue_is_refused_at_once(open_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(9 * 2**20).encode() + b"\r\n\r\n")
    t = time.monotonic()
    status, error = status_and_error(raw_exchange(open_server, head))
    assert status == 413 and error["code"] == "request_too_large" and time.monotonic() - t < 5


def test_a_body_that_stops_arriving_gets_408(impatient_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    status, error = status_and_error(raw_exchange(impatient_server, head + b'{"prompt": "5'))
    assert status == 408 and error["code"] == "request_timeout"
    assert httpx.post(f"{impatient_server.url}/completions", json={"prompt": "5 6", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("what", ["a half-sent body", "an answer still running"])
def test_a_request_the_shutdown_cuts_before_its_answer_gets_503(what):
    """uvicorn cancels what still runs when the drain timeout ends; an answer that had not begun
    (its body still arriving, or a non-streamed completion still generating) gets OpenAI's
    error body, not uvicorn's plain-text 500."""
    server = start({"drain_timeout_s": 0.5}, max_len=8192)
    got = {}

    def send():
        body = json.dumps({"prompt": "5 6", "max_tokens": 8000, "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        got["response"] = raw_exchange(server, head + (body[:5] if what == "a half-sent body" else body), 60)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)
    server.stop()
    sender.join(timeout=60)
    status, error = status_and_error(got["response"])
    assert status == 503 and error["code"] == "shutting_down"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(open_server):
    before = VocabTokenizer.encode_calls
    # 2 * 8 characters per token at most -> 4096 characters are at least 256 tokens > 128.
    for path, body in (("completions", {"prompt": "1 " * 2048}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "1 " * 2048}]})):
        r = httpx.post(f"{open_server.url}/{path}", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert "at least" in r.json()["error"]["message"]
    assert VocabTokenizer.encode_calls == before
    # Shorter than the bound: tokenized, then refused by the exact count.
    r = httpx.post(f"{open_server.url}/completions", json={"prompt": "1 " * 200})
    assert r.status_code == 400 and "at least" not in r.json()["error"]["message"]
    assert VocabTokenizer.encode_calls == before + 1


def test_the_context_is_filled_to_its_last_token_and_not_one_past(open_server):
    """prompt + max_tokens may fill max_model_len exactly; one more is a 400, and so is a prompt
    that fills it alone. Without max_tokens a request gets the whole rest of the context."""
    url = f"{open_server.url}/completions"

    def ask(prompt_len: int, **fields):
        return httpx.post(url, json={"prompt": "5 " * prompt_len, "temperature": 0, "ignore_eos": True, **fields},
                          timeout=60)

    r = ask(MAX_LEN - 8, max_tokens=8)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    r = ask(MAX_LEN - 8, max_tokens=9)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = ask(MAX_LEN - 8)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert ask(MAX_LEN - 40).json()["usage"]["completion_tokens"] == 40  # not some fixed default
    assert ask(MAX_LEN - 1).json()["usage"]["completion_tokens"] == 1
    r = ask(MAX_LEN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_stop_counts_strings_not_characters(open_server):
    """One long stop string is one stop string; more than MAX_STOP of them is a 400 naming stop."""
    from tandem.server.protocol import MAX_STOP

    url = f"{open_server.url}/completions"
    r = httpx.post(url, json={"prompt": "5 6", "max_tokens": 2, "stop": "x" * (MAX_STOP + 12)}, timeout=60)
    assert r.status_code == 200
    r = httpx.post(url, json={"prompt": "5 6", "max_tokens": 2, "stop": ["x"] * (MAX_STOP + 1)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_tokenizing_does_not_hold_up_other_requests(open_server):
    VocabTokenizer.hold.clear()
    VocabTokenizer.held.clear()
    client = openai.OpenAI(base_url=open_server.url, api_key="unused", max_retries=0, timeout=60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.completions.create, model=NAME, prompt="hold 5 6", max_tokens=2, temperature=0)
        try:
            assert VocabTokenizer.held.wait(30)
            # The held request is inside encode(); the event loop still answers and streams.
            assert httpx.get(f"{open_server.url}/models", timeout=10).status_code == 200
            stream = client.completions.create(model=NAME, prompt=[5, 6], max_tokens=3, stream=True, temperature=0)
            assert sum(1 for c in stream if c.choices and c.choices[0].text) >= 1
            assert not slow.done()
        finally:
            VocabTokenizer.hold.set()
        assert slow.result(timeout=30).usage.completion_tokens == 2


def test_serve_flags_and_environment_give_the_key(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    _, server = configs_from_args(parser.parse_args(["--max-request-bytes", "65536"]))
    assert server.api_key == "from-env" and server.max_request_bytes == 65536
    assert "from-env" not in repr(server)
    _, server = configs_from_args(parser.parse_args(["--api-key", "from-flag"]))
    assert server.api_key == "from-flag"
    monkeypatch.delenv("TANDEM_API_KEY")
    _, server = configs_from_args(parser.parse_args([]))
    assert server.api_key is None and server.max_request_bytes == ServerConfig.max_request_bytes
    with pytest.raises(ValueError):
        ServerConfig(max_request_bytes=10)


def test_longest_token_chars_bounds_real_text():
    """On a byte-level BPE vocabulary no token covers more characters than the bound."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["the quick brown fox jumps over the lazy dog " * 20, "    indented code\n\tline " * 20, "naïve café 東京 " * 20]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    class Wrapped:
        def get_vocab(self):
            return tok.get_vocab()

    bound = longest_token_chars(Wrapped())
    for t in text:
        assert len(t) <= bound * len(tok.encode(t).ids)
    assert longest_token_chars(ToyTokenizer()) is None


def test_the_server_leaves_a_core_to_its_http_thread(monkeypatch):
    from tandem import launch_server

    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert launch_server.server_threads(None) == 1
    assert launch_server.server_threads(2) == 2
    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert launch_server.server_threads(None) == 1
    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert launch_server.server_threads(None) == 7


def test_an_address_the_server_cannot_listen_on_is_refused_before_loading():
    """`tandem serve` checks its --host/--port before the model loads (the first request must not
    be what finds out): a port in use, a host that does not resolve; a free port (0) passes."""
    import socket

    from tandem.launch_server import check_listenable

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="in use"):
            check_listenable("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(ValueError, match="--host 'not_a_host'"):
        check_listenable("not_a_host", 8000)
    check_listenable("127.0.0.1", 0)
