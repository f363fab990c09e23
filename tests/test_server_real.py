"""`tandem serve` with no flags on the real default model: its default drafter under the adaptive
policy (cost curve measured once and cached), chat through the official client, output equal to
plain greedy decoding."""

from __future__ import annotations

import argparse

import openai
import pytest

from tandem.config import SamplingParams
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
    finally:
        server.stop()
    from tandem.llm import LLM

    llm = LLM(DEFAULT_MODEL, max_model_len=1024, max_num_seqs=1)
    want = llm.generate(question, SamplingParams(temperature=0.0, max_tokens=48), chat=True)[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
