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
])
def test_a_spec_that_does_not_compile_is_refused(spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler().check(spec)
    llm = LLM.from_loaded(constrained_loaded(), EngineConfig(max_model_len=128))
    with pytest.raises(ValueError, match="does not compile"):
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
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None),
])
def test_bad_structured_outputs_are_a_400(server, extra, param):
    import httpx

    r = httpx.post(server.url + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)
