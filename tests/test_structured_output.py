"""Structured output (tandem.grammar): masks that follow the grammar and leave the matcher where
it was; constrained greedy decoding that matches its regex, with speculative output equal to plain
output token for token (chains cut at refused tokens, trees, sampled drafts); the law of
constrained sampling under speculation against the exact constrained law, with a negative
control; compile errors."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from conftest import ToyTokenizer, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig, StructuredOutput
from tandem.drafters import Drafter, register
from tandem.grammar import GrammarCompiler, GrammarError, GrammarState
from tandem.llm import LLM
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput
from tandem.sampling import processed_probs
from tandem.types import Draft
from tandem.verify.stats import chi_square_test, total_variation, tv_bound
from test_engine import PROMPTS, SCRIPT, ScriptedDrafter, ScriptedTreeDrafter  # noqa: F401 (registers them)
from test_engine_sampling import sharp_loaded

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
EOS = 2


class CharTokenizer(ToyTokenizer):
    """One character per token for the tiny models' 97 ids: ids 0-2 are special (2 is EOS), id
    i >= 3 is chr(29 + i), space to '}', so every printable ASCII text but '~' has a spelling
    and regexes read as text."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 29 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if i < 3 and skip_special_tokens else chr(29 + i) if i >= 3 else f"<{i}>" for i in ids)

    def vocabulary_bytes(self) -> list[bytes]:
        return [b"\xff<pad>", b"\xff<bos>", b"\xff<eos>"] + [chr(29 + i).encode() for i in range(3, VOCAB)]


def char(c: str) -> int:
    return ord(c) - 29


def spelled(*chars: str) -> str:
    return "[" + "".join(chars) + "]"


def constrained_loaded(loaded=None):
    return dataclasses.replace(loaded or tiny_loaded("llama")[1], tokenizer=CharTokenizer())


def compiler() -> GrammarCompiler:
    return GrammarCompiler(CharTokenizer(), VOCAB, [EOS])


def ids_of(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def test_masks_follow_the_grammar_and_leave_the_matcher_where_it_was():
    a, b, x, y, z = (char(c) for c in "abxyz")
    state = compiler().state(StructuredOutput(regex="[ab][xy]*"))
    assert ids_of(state.allowed()) == [a, b]
    rows, valid = state.allowed_along([a, x, z, y])
    assert valid == 2 and rows.shape == (5, VOCAB)
    assert ids_of(rows[0]) == [a, b]
    assert ids_of(rows[1]) == [EOS, x, y] and ids_of(rows[2]) == [EOS, x, y]  # may end after any
    assert torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])  # past the refused z: never read
    assert ids_of(state.allowed()) == [a, b]  # unmoved
    tree = state.allowed_paths([[b], [a], [a, y], [a, z]])
    assert ids_of(tree[1]) == [EOS, x, y] and ids_of(tree[3]) == [EOS, x, y] and torch.equal(tree[4], tree[0])
    state.consume([b, y])
    assert ids_of(state.allowed()) == [EOS, x, y] and state.valid_prefix([x, a]) == 1


def test_a_json_schema_keeps_its_property_order():
    """Properties come in the schema's order, as OpenAI and vLLM keep it (a schema of reasoning
    then answer must not have the answer written first; a tool call names its function before
    its arguments)."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    for spec in (StructuredOutput.json_schema(schema), StructuredOutput.json_schema(json.dumps(schema))):
        state = compiler().state(spec)
        state.consume(CharTokenizer().encode('{"'))
        assert ids_of(state.allowed()) == [char("r")]


def test_a_draft_that_completes_the_output_then_ends_leaves_the_matcher_where_it_was():
    """llguidance stops a matcher by itself once a JSON object closes, and then takes EOS
    without counting it: rolling back by the draft's length undid one token too many, so the
    next round's masks let through what the schema refuses (sampled answers broke their schema
    with finish_reason "stop")."""
    enc = CharTokenizer().encode
    state = compiler().state(StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                                           "required": ["n"], "additionalProperties": False}))
    state.consume(enc('{"n": 1'))
    before = state.allowed()
    draft = enc("2}") + [EOS]
    rows, valid = state.allowed_along(draft)
    assert valid == 3 and ids_of(rows[2]) == [EOS]
    assert torch.equal(state.allowed(), before) and char("-") not in ids_of(state.allowed())
    state.allowed_paths([draft[:1], draft[:2], draft])
    assert torch.equal(state.allowed(), before)
    state.consume(draft)
    assert state.complete and ids_of(state.allowed()) == [EOS]


def test_a_complete_output_allows_only_eos():
    state = compiler().state(StructuredOutput(choice=("yes", "no")))
    assert ids_of(state.allowed()) == [char("n"), char("y")]
    state.consume(CharTokenizer().encode("no"))
    assert state.complete and ids_of(state.allowed()) == [EOS]
    state.consume([EOS])  # the end of a matched output is committed too
    assert ids_of(state.allowed()) == [EOS]


def test_a_json_schema_is_followed():
    state = compiler().state(StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                                           "required": ["n"], "additionalProperties": False}))
    assert state.valid_prefix(CharTokenizer().encode('{"n": 12}')) == 9
    assert state.valid_prefix(CharTokenizer().encode('{"m": 1}')) == 2


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput(regex="(ab"), "unclosed group"),
    (StructuredOutput(grammar="start: nowhere"), "unknown name"),
    (StructuredOutput(regex=r"[^\s\S]"), "matches no text"),  # compiles, and no output could match it
])
def test_a_spec_that_does_not_compile_is_refused(spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler().check(spec)
    llm = LLM.from_loaded(constrained_loaded(), EngineConfig(max_model_len=128))
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_output=spec))


def test_a_tokenizer_without_its_bytes_is_refused():
    with pytest.raises(GrammarError, match="fast"):
        GrammarCompiler(ToyTokenizer(), VOCAB, [EOS]).check(StructuredOutput(regex="a"))


# A regex the tiny model would not follow on its own: several tokens allowed at each step, ending
# only after four.
REGEX = "[abcd][xyz]{2,3}[0-4]+"


def constrained_greedy(llm, params) -> list:
    return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True), ("ngram", False)])
@pytest.mark.parametrize("wrong_every", [0, 2])
def test_constrained_greedy_matches_the_regex_and_speculation_changes_nothing(algorithm, tree, wrong_every):
    params = SamplingParams(temperature=0, max_tokens=12, structured_output=StructuredOutput(regex=REGEX))
    loaded = constrained_loaded()
    plain = LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(PROMPTS, params)
    free = LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in plain] != [o.token_ids for o in free]  # the constraint is felt
    for out in plain:
        text = out.text
        assert re.fullmatch(REGEX, text[: re.match(REGEX, text).end()]) and (
            out.finish_reason == "length" or re.fullmatch(REGEX, text))
    # The scripted drafters draft the constrained continuation, corrupted every `wrong_every`
    # tokens: corrupted tokens are mostly ones the grammar refuses.
    SCRIPT["continuations"] = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    SCRIPT["wrong_every"] = wrong_every
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    out = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=spec)).generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    if algorithm != "ngram":
        assert out[0].spec.num_accepted_tokens > 0


def test_a_complete_output_ends_at_eos():
    params = SamplingParams(temperature=0, max_tokens=12, structured_output=StructuredOutput(choice=("yes", "no")))
    for out in LLM.from_loaded(constrained_loaded(), EngineConfig(max_model_len=128)).generate(PROMPTS, params):
        assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.token_ids[-1] == EOS


# ---- the law of constrained sampling under speculation ------------------------------------------

POSITIONS = ("abc", "xyz", "012")  # the characters allowed at each of three positions
LAW_REGEX = "".join(spelled(*chars) for chars in POSITIONS)
LAW_PARAMS = SamplingParams(temperature=1.0, max_tokens=3, structured_output=StructuredOutput(regex=LAW_REGEX))
N = 3000


@register("test_grammar_sampled")
class GrammarSampledDrafter(Drafter):
    """Samples its drafts from a fixed q over some allowed and some refused tokens and reports
    q: refused tokens meet the q-ratio rule's residual, allowed ones its ratio test."""

    support = tuple(char(c) for c in "axy01QR")

    def propose(self, batch):
        drafts = []
        q = torch.zeros(VOCAB)
        q[list(self.support)] = 1.0 / len(self.support)
        for inp in batch:
            k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
            rows = q.expand(k, VOCAB).clone()
            tokens = torch.multinomial(rows, 1, generator=inp.generator).flatten().tolist()
            drafts.append(Draft(tokens, probs=rows))
        return drafts


def exact_law(loaded, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of constrained sampling: at each position the processed target
    distribution over that position's allowed tokens."""
    cache = KVCache(loaded.config, 1, 64, loaded.dtype)
    runner = ModelRunner(loaded.model, cache)
    row = cache.allocate()

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        out = runner.forward([SeqInput(row, prompt + list(prefix), logits="last")])
        cache.truncate(row, 0)
        refused = torch.full((1, VOCAB), float("-inf"))
        refused[0, [char(c) for c in POSITIONS[len(prefix)]]] = 0.0
        return processed_probs(out.rows(0), LAW_PARAMS, shift=refused)[0].double()

    law = {}
    for a in map(char, POSITIONS[0]):
        pa = dist(())[a]
        for b in map(char, POSITIONS[1]):
            pb = dist((a,))[b]
            for c in map(char, POSITIONS[2]):
                law[(a, b, c)] = float(pa * pb * dist((a, b))[c])
    return law


def sampled(loaded, spec: SpecConfig | None, prompt: list[int]) -> dict[tuple[int, ...], int]:
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=64, max_num_seqs=128, spec=spec or SpecConfig()))
    outs = llm.generate([prompt] * N, [dataclasses.replace(LAW_PARAMS, seed=s) for s in range(N)])
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts


def law_check(counts: dict, law: dict) -> tuple[float, float]:
    keys = sorted(set(law) | set(counts))
    observed = [counts.get(k, 0) for k in keys]
    expected = [law.get(k, 0.0) for k in keys]
    return chi_square_test(observed, expected).p_value, total_variation(observed, expected)


@pytest.mark.parametrize("algorithm", [None, "test_grammar_sampled", "ngram"])
def test_constrained_sampling_follows_the_exact_constrained_law(algorithm):
    loaded = constrained_loaded(sharp_loaded())
    prompt = CharTokenizer().encode("ay0bz1ax")  # repeats allowed tokens, so the n-gram drafter drafts
    law = exact_law(loaded, prompt)
    spec = None if algorithm is None else SpecConfig(algorithm=algorithm, num_draft_tokens=2)
    counts = sampled(loaded, spec, prompt)
    assert sum(counts.values()) == N and set(counts) <= set(law)  # nothing outside the grammar
    p_value, tv = law_check(counts, law)
    assert p_value > 1e-4 and tv < tv_bound(N, len(law)), (p_value, tv)


def test_the_law_check_catches_rows_masked_as_the_first():
    """Negative control: every verified row masked with the first row's allowed tokens (the
    matcher not advanced along the draft) leaves the grammar or moves the law."""
    loaded = constrained_loaded(sharp_loaded())
    prompt = CharTokenizer().encode("ay0bz1ax")
    law = exact_law(loaded, prompt)
    real = GrammarState.allowed_along

    def not_advanced(self, tokens):
        rows, valid = real(self, tokens)
        return rows[:1].expand_as(rows).clone(), valid

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GrammarState, "allowed_along", not_advanced)
        counts = sampled(loaded, SpecConfig(algorithm="test_grammar_sampled", num_draft_tokens=2), prompt)
    p_value, tv = law_check(counts, law)
    assert p_value < 1e-4 or not set(counts) <= set(law)


# ---- through the server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from tandem.engine.engine import Engine
    from tandem.launch_server import serve_in_background
    from tandem.server.app import build_app
    from tandem.server.async_engine import AsyncEngine
    from tandem.server.metrics import ServerMetrics

    engine = Engine(constrained_loaded(), EngineConfig(max_model_len=128, max_num_seqs=4,
                                                       spec=SpecConfig(algorithm="suffix", num_draft_tokens=4)))
    running = serve_in_background(build_app(AsyncEngine(engine, 16, ServerMetrics("tiny")), "tiny"))
    yield running
    running.stop()


def test_the_server_follows_a_regex_and_answers_what_plain_decoding_does(server):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    llm = LLM.from_loaded(constrained_loaded(), EngineConfig(max_model_len=128))
    for prompt in PROMPTS:
        want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                   structured_output=StructuredOutput(regex=REGEX)))[0].text
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": REGEX}})
        assert r.choices[0].text == want and re.match(REGEX, want)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want


def test_the_server_follows_response_format(server):
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "n", "schema": schema}}})
    assert r.choices[0].finish_reason == "stop"  # the tiny model, held to the schema, closes it
    assert isinstance(json.loads(r.choices[0].text)["n"], int)


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None),
    ({"structured_outputs": {"nonsense": "a"}}, None),
    ({"response_format": {"type": "json_schema"}}, None),
    ({"response_format": {"type": "yaml"}}, None),
    # unknown keys, as in structured_outputs
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "shema": {}}}}, None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None),
])
def test_bad_structured_outputs_are_a_400(server, extra, param):
    import httpx

    r = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)


# ---- tool calls: the arguments held to the tool's schema ------------------------------------------


class ChatCharTokenizer(CharTokenizer):
    """CharTokenizer with a chat template: each message as "role: content |" (the vocabulary has
    no newline), the tools' names first when there are any."""

    chat_template = "toy"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None):
        parts = [f"tools: {' '.join(t['function']['name'] for t in tools)}"] if tools else []
        parts += [f"{m['role']}: {m['content']}" for m in messages]
        return self.encode(" | ".join(parts) + (" | assistant: " if add_generation_prompt else ""))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def chat_server():
    from tandem.engine.engine import Engine
    from tandem.launch_server import serve_in_background
    from tandem.server.app import build_app
    from tandem.server.async_engine import AsyncEngine
    from tandem.server.metrics import ServerMetrics

    loaded = dataclasses.replace(tiny_loaded("llama")[1], tokenizer=ChatCharTokenizer())
    engine = Engine(loaded, EngineConfig(max_model_len=256, max_num_seqs=4,
                                         spec=SpecConfig(algorithm="suffix", num_draft_tokens=4)))
    running = serve_in_background(build_app(AsyncEngine(engine, 16, ServerMetrics("tiny")), "tiny"))
    yield running, loaded
    running.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_holds_its_arguments_to_the_schema(chat_server, stream):
    import openai

    server, loaded = chat_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model="tiny", messages=messages, max_tokens=60, temperature=0, tools=[WEATHER, ADD],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        calls = [c for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls for c in ch.choices[0].delta.tool_calls]
        reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)  # no text besides the call
    else:
        r = client.chat.completions.create(**kw)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert r.choices[0].message.content is None
    assert reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    # The arguments are what plain decoding under the tool's schema writes from the same prompt.
    prompt = ChatCharTokenizer().apply_chat_template(messages, tools=[WEATHER, ADD])
    compact = {**WEATHER["function"]["parameters"], "x-guidance": {"whitespace_flexible": False}}
    want = LLM.from_loaded(loaded, EngineConfig(max_model_len=256)).generate(prompt, SamplingParams(
        temperature=0, max_tokens=60, structured_output=StructuredOutput.json_schema(compact)))
    assert calls[0].function.arguments == want[0].text


def test_a_required_tool_call_names_one_of_the_tools(chat_server):
    import httpx
    import openai

    server, _ = chat_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1 + 2?"}], max_tokens=80,
                                       temperature=0, tools=[WEATHER, ADD], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "add")
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    assert set(json.loads(call.function.arguments)) == set(schema["required"])
    assert call.function.arguments == json.dumps(json.loads(call.function.arguments), separators=(",", ":"))  # compact
    metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics").text  # counted as the answer reports it
    assert any(line.startswith("tandem:request_success_total") and 'finished_reason="tool_calls"' in line
               for line in metrics.splitlines())
    # auto (the default with tools) and none answer in text
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1 + 2?"}], max_tokens=8,
                                           temperature=0, tools=[WEATHER, ADD], tool_choice=choice)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_function_without_parameters_is_called_without_arguments(chat_server):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list."""
    import openai

    server, _ = chat_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    ping = {"type": "function", "function": {"name": "ping"}}
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ping?"}],
                                           max_tokens=40, temperature=0, tools=[ping], tool_choice=choice)
        call = r.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("ping", "{}")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
     "tools"),
    ({"tools": [{"type": "retrieval"}]}, None),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),  # a call names its function: names must differ
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}], "tool_choice": "auto"},
     "tools"),  # a bad schema is refused even where no call is asked for
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "18"}]}, None),  # which call does it answer?
])
def test_bad_tool_requests_are_a_400(chat_server, extra, param):
    import httpx

    server, _ = chat_server
    r = httpx.post(server.url + "/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] and (param is None or r.json()["error"]["param"] == param)


def test_the_library_exports_what_its_docs_use():
    """docs/serving.md imports StructuredOutput from `tandem`, beside LLM and SamplingParams."""
    import tandem

    assert tandem.StructuredOutput is StructuredOutput and tandem.SamplingParams is SamplingParams
    assert set(tandem.__all__) >= {"LLM", "SamplingParams", "StructuredOutput"}
