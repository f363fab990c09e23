"""`tandem serve` with no flags on the real default model: its default drafter under the adaptive
policy (cost curve measured once and cached), chat through the official client, output equal to
plain greedy decoding."""

from __future__ import annotations

import argparse
import json

import openai
import pytest

from tandem.config import SamplingParams, StructuredOutput
from tandem.launch_server import add_serve_args, build_server_app, configs_from_args, serve_in_background
from tandem.model.catalogue import DEFAULT_DRAFTERS, DEFAULT_MODEL

pytestmark = pytest.mark.slow


def test_default_serve_is_speculative_and_lossless():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine_config, server_config = configs_from_args(parser.parse_args(["--max-model-len", "1024"]))
    assert engine_config.model == DEFAULT_MODEL
    assert engine_config.spec.algorithm == DEFAULT_DRAFTERS[DEFAULT_MODEL]
    assert engine_config.spec.policy == "adaptive"
    app = build_server_app(engine_config, server_config)
    server = serve_in_background(app)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        question = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"
        r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=48, temperature=0)
        assert r.choices[0].message.content
        assert r.usage.completion_tokens >= 1
        spec = r.model_extra["spec"]
        assert spec["num_target_forwards"] <= r.usage.completion_tokens
        structured = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": PERSON_PROMPT}], max_tokens=96, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            logprobs=True)
    finally:
        server.stop()
    from tandem.llm import LLM

    llm = LLM(DEFAULT_MODEL, max_model_len=1024, max_num_seqs=1)
    want = llm.generate(question, SamplingParams(temperature=0.0, max_tokens=48), chat=True)[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    # A JSON schema through response_format: valid JSON with the schema's fields, what plain
    # decoding under the same schema writes, and one logprob per token, each the token's own.
    person = llm.generate(PERSON_PROMPT, SamplingParams(temperature=0.0, max_tokens=96, logprobs=0,
                                                        structured_output=StructuredOutput.json_schema(PERSON)),
                          chat=True)[0]
    text = structured.choices[0].message.content
    assert text == person.text and structured.choices[0].finish_reason == "stop"
    assert set(json.loads(text)) == {"name", "age"} and isinstance(json.loads(text)["age"], int)
    entries = structured.choices[0].logprobs.content
    assert len(entries) == len(person.token_ids) == structured.usage.completion_tokens
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in person.logprobs], abs=1e-4)
    assert bytes(b for e in entries for b in e.bytes).decode() == text + "<|im_end|>"


PERSON_PROMPT = "Describe a made-up person as JSON with their name and age."
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
