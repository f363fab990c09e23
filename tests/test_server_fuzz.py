"""Schemathesis fuzzing of the server's own OpenAPI schema (valid and invalid requests): no
request may produce a 5xx. A small context keeps every generated request short."""

from __future__ import annotations

import dataclasses

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from conftest import tiny_loaded
from tandem.config import EngineConfig, SpecConfig
from tandem.engine.engine import Engine
from tandem.launch_server import serve_in_background
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")


class ByteTokenizer:
    """Any text -> ids (one per UTF-8 byte, folded into the tiny vocabulary), with a chat template."""

    eos_token_id = 2
    chat_template = "bytes"

    def encode(self, text: str) -> list[int]:
        return [7 + b % 90 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == self.eos_token_id))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = [3]
        for m in messages:
            ids += [4] + self.encode(m["role"] + ":" + m["content"])
        return ids + [5]


@pytest.fixture(scope="module")
def api_schema(one_thread):
    _, loaded = tiny_loaded("llama")
    loaded = dataclasses.replace(loaded, tokenizer=ByteTokenizer())
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=3)
    engine = Engine(loaded, EngineConfig(max_model_len=32, max_num_seqs=4, spec=spec))
    server = serve_in_background(build_app(AsyncEngine(engine, 8, ServerMetrics("tiny")), "tiny"))
    yield schemathesis.openapi.from_url(server.url.removesuffix("/v1") + "/openapi.json")
    server.stop()


CASES = [  # (path, method, generation mode, examples); parameterless GETs have no invalid form
    ("/v1/completions", "POST", GenerationMode.POSITIVE, 30),
    ("/v1/completions", "POST", GenerationMode.NEGATIVE, 30),
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 30),
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 30),
    ("/v1/models", "GET", GenerationMode.POSITIVE, 3),
    ("/health", "GET", GenerationMode.POSITIVE, 3),
    ("/metrics", "GET", GenerationMode.POSITIVE, 3),
]


@pytest.mark.parametrize("path, method, mode, examples", CASES, ids=lambda v: getattr(v, "value", v))
def test_no_request_makes_a_server_error(api_schema, path, method, mode, examples):
    # Hypothesis drives schemathesis' strategies directly (its pytest plugin's lazy fixture
    # loader does not run under pytest 9).
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        case.call_and_validate(checks=[not_a_server_error], timeout=60)

    run()
