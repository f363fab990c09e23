"""Output logprobs (SamplingParams.logprobs): each token's log-probability is the target's
log_softmax at its position, the same whether the token came from plain decoding, an accepted
draft, a recovered or a bonus token, in chains and trees; one entry per kept token through
stops; token texts and bytes as OpenAI spells them."""

import math

import pytest
import torch

from conftest import quantized_tiny, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.llm import LLM
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput
from tandem.sampling import token_logprobs
from tandem.server.logprobs import TextOffsets, TokenStrings, chat_logprobs, completion_logprobs
from test_engine import PROMPTS, _install_script

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    """The HF model's log_softmax for each output token, teacher-forced over prompt + output."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_token_logprobs_by_hand():
    rows = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    out = token_logprobs(rows, [0, 0], top=2)
    norm = [math.log(1 + math.e + math.e**2), math.log(math.e**3 + 2)]
    assert out[0].logprob == pytest.approx(0.0 - norm[0]) and out[1].logprob == pytest.approx(3.0 - norm[1])
    assert [t for t, _ in out[0].top] == [2, 1] and out[0].top[0][1] == pytest.approx(2.0 - norm[0])
    assert [t for t, _ in out[1].top] == [0, 1]  # ties: the lower id first (topk's order)
    assert token_logprobs(rows, [1, 2], top=0)[0].top == ()


def test_sampling_params_bound_logprobs():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_log_softmax(temperature):
    """Raw logprobs (before temperature): the reference model's teacher-forced log_softmax of
    the tokens the engine emitted, greedy or sampled."""
    hf, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128))
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=3, logprobs=5)
    for prompt in PROMPTS:
        out = llm.generate(prompt, params)[0]
        assert len(out.logprobs) == len(out.token_ids) == 12
        assert [e.token_id for e in out.logprobs] == out.token_ids
        want = reference_logprobs(hf, prompt, out.token_ids)
        assert [e.logprob for e in out.logprobs] == pytest.approx(want, abs=1e-4)
        for e in out.logprobs:
            assert len(e.top) == 5 and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
            if temperature == 0.0:
                assert e.top[0] == (e.token_id, e.logprob)  # greedy takes the most likely token


def test_no_logprobs_unless_asked():
    _, loaded = tiny_loaded("llama")
    out = LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(PROMPTS[0], SamplingParams(max_tokens=4))[0]
    assert out.logprobs is None


@pytest.mark.parametrize("algorithm, tree", [("test_scripted", False), ("test_scripted_tree", True)])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_speculative_logprobs_equal_plain_decodings(algorithm, tree, wrong_every):
    """Accepted, recovered and bonus tokens each get the logprob of the row they were graded
    from: the same as plain decoding's (here within fp32 rounding: the general path's rows are
    computed in forwards of another size)."""
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=3)
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=10 if tree else 4, eagle_topk=2 if tree else 1, num_steps=4)
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, max_num_seqs=4, spec=spec))
    plain = _install_script(llm, params, wrong_every)
    out = llm.generate(PROMPTS, params)
    assert out[0].spec.num_accepted_tokens > 0
    for o, p in zip(out, plain):
        assert o.token_ids == p.token_ids
        assert [e.logprob for e in o.logprobs] == pytest.approx([e.logprob for e in p.logprobs], abs=1e-5)
        assert [[t for t, _ in e.top] for e in o.logprobs] == [[t for t, _ in e.top] for e in p.logprobs]


def test_logprobs_bit_for_bit_on_the_fused_path(block_variant):
    """On the block kernels every verified row is the row plain decoding computes, so the
    logprobs are the same floats."""
    loaded = quantized_tiny("llama")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(PROMPTS, params)
    spec = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=SpecConfig(algorithm="ngram", num_draft_tokens=4)))
    out = spec.generate(PROMPTS, params)
    assert sum(o.spec.num_accepted_tokens for o in out) > 0
    assert [o.logprobs for o in out] == [o.logprobs for o in plain]


def test_one_logprob_per_kept_token_through_stops():
    """A stop inside an accepted run keeps the stop token and nothing after it: its logprobs too."""
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=SpecConfig(algorithm="test_scripted",
                                                                                   num_draft_tokens=8)))
    base = _install_script(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), 0)[0]
    stop = base.token_ids[9]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop,),
                                                  ignore_eos=True, logprobs=0))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids)
    assert out.logprobs[-1].token_id == stop and all(e.top == () for e in out.logprobs)


class ByteLevelTokenizer:
    """Three byte-level BPE entries: 'Ġhi' (' hi'), and 'é' split over two tokens."""

    pieces = {0: "Ġhi", 1: "Ã", 2: "©", 3: "<|end|>"}

    def convert_ids_to_tokens(self, i):
        return self.pieces[i]

    def decode(self, ids, skip_special_tokens=False):
        if ids == [3]:
            return "" if skip_special_tokens else "<|end|>"
        raw = b"".join({0: b" hi", 1: b"\xc3", 2: b"\xa9"}[i] for i in ids)
        return raw.decode("utf-8", errors="replace")


def test_token_strings_spell_bytes_as_openai_does():
    strings = TokenStrings(ByteLevelTokenizer())
    assert strings(0) == (" hi", list(b" hi"))
    assert strings(1) == ("bytes:\\xc3", [0xC3]) and strings(2) == ("bytes:\\xa9", [0xA9])
    assert bytes(strings(1)[1] + strings(2)[1]).decode() == "é"  # a character's tokens join to it
    assert strings(3) == ("<|end|>", list(b"<|end|>"))  # a special token: its text's bytes


def test_response_shapes():
    from tandem.types import TokenLogprob

    strings = TokenStrings(ByteLevelTokenizer())
    entries = [TokenLogprob(0, -0.5, ((0, -0.5), (3, -1.5))), TokenLogprob(1, -2.0, ((0, -0.1),))]
    legacy = completion_logprobs(entries, strings, TextOffsets(4))
    assert legacy.tokens == [" hi", "bytes:\\xc3"] and legacy.token_logprobs == [-0.5, -2.0]
    assert legacy.text_offset == [4, 7]
    assert legacy.top_logprobs == [{" hi": -0.5, "<|end|>": -1.5}, {" hi": -0.1, "bytes:\\xc3": -2.0}]
    chat = chat_logprobs(entries, strings)
    assert [c.token for c in chat.content] == [" hi", "bytes:\\xc3"] and chat.content[1].bytes == [0xC3]
    assert [t.token for t in chat.content[0].top_logprobs] == [" hi", "<|end|>"]


def test_text_offsets_count_characters_of_the_choice_text():
    """text_offset is where each token's text starts in the choice's text, in characters: both
    tokens of a split character start where the character does, a special token adds nothing
    (the choice's text skips it), and the offsets carry on across a stream's chunks."""
    from tandem.types import TokenLogprob

    strings = TokenStrings(ByteLevelTokenizer())
    ids = [0, 1, 2, 0, 1, 2, 3]  # " hi" + "é" + " hi" + "é" + <|end|>: the text " hié hié", 8 characters
    offsets = TextOffsets()
    first = completion_logprobs([TokenLogprob(i, -1.0, ()) for i in ids[:2]], strings, offsets)
    rest = completion_logprobs([TokenLogprob(i, -1.0, ()) for i in ids[2:]], strings, offsets)
    assert first.text_offset + rest.text_offset == [0, 3, 3, 4, 7, 7, 8]
    assert offsets.chars == len(" hié hié")


def test_an_echoed_prompts_offsets_count_the_special_tokens_it_spells():
    """An echoed prompt is the text the client sent, where a special token may stand as text
    ("<|im_start|>user..."): that token spans it there. One the tokenizer added (a BOS) is not in
    the text and adds nothing."""
    from tandem.types import TokenLogprob

    strings = TokenStrings(ByteLevelTokenizer())
    entries = [None] + [TokenLogprob(i, -1.0, ()) for i in (0, 1, 2, 3)]
    spelled = completion_logprobs(entries, strings, TextOffsets(text="<|end|> hié<|end|>"), unscored=3)
    assert spelled.text_offset == [0, 7, 10, 10, 11]
    added = completion_logprobs(entries[:4], strings, TextOffsets(text=" hi\u00e9"), unscored=3)
    assert added.text_offset == [0, 0, 3, 3]


@pytest.mark.slow
def test_text_offsets_on_the_real_tokenizer():
    """On the default model's byte-level tokenizer, text whose characters span several tokens:
    each token's offset is where the complete characters before it end."""
    from transformers import AutoTokenizer

    from tandem.model.catalogue import DEFAULT_MODEL, resolve_model
    from tandem.model.loader import _ensure_gguf_metadata

    src = resolve_model(DEFAULT_MODEL)
    _ensure_gguf_metadata(src)
    tok = AutoTokenizer.from_pretrained(str(src.hf_dir))
    text = "日本語で挨拶してください。🙂 hi é, naïve café"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    strings, offsets = TokenStrings(tok), TextOffsets()
    got = [offsets.next(strings.in_text(i)) for i in ids]
    assert got == [len(tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets.chars == len(tok.decode(ids, skip_special_tokens=True)) == len(text)
    assert any(strings(i)[0].startswith("bytes:") for i in ids)  # the text does split characters


def test_prompt_logprobs_are_the_targets_log_softmax_over_the_prompt():
    """Every prompt token but the first gets the reference model's teacher-forced log_softmax,
    with its alternatives; the first gets None."""
    hf, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128))
    for prompt in PROMPTS:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
        want = reference_logprobs(hf, prompt[:1], prompt[1:])
        assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)
        assert all(len(e.top) == 2 for e in out.prompt_logprobs[1:])
        assert out.logprobs is None


def test_the_first_tokens_logprob_is_the_same_with_prompt_logprobs_asked():
    """With prompt_logprobs the prompt's last forward returns every row; the first output token's
    entry must still come from the last one, as without them."""
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128))
    for prompt in PROMPTS:
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
        both = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1))[0]
        assert both.token_ids == plain.token_ids and both.logprobs == plain.logprobs


def test_prompt_logprobs_skip_the_prefix_cache_and_come_in_pieces_bit_for_bit(block_variant):
    """On the fused path a long prompt's logprobs come 128 rows per forward, the same floats as
    one forward over the whole prompt; a prompt the prefix cache holds is still computed."""
    loaded = quantized_tiny("llama")
    prompt = [(7 * i + 3) % 97 for i in range(300)]
    cfg = EngineConfig(max_model_len=512, enable_prefix_caching=True)
    llm = LLM.from_loaded(loaded, cfg)
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]  # cached now
    assert len(first.prompt_logprobs) == 300 and first.prompt_logprobs == again.prompt_logprobs
    cache = KVCache(loaded.config, 1, 512, loaded.dtype, storage=loaded.kv_dtype())  # the engine's KV dtype
    runner = ModelRunner(loaded.model, cache)
    whole = runner.forward([SeqInput(cache.allocate(), prompt, logits="all")]).logits
    want = token_logprobs(whole[:-1], prompt[1:], 1)
    assert first.prompt_logprobs[1:] == want


def test_nan_logits_end_the_request_on_the_fused_path(block_variant):
    """The LM head's greedy rows flag a NaN: a greedy request fed a poisoned token ends with an
    error, plain or speculative, where the others finish as without it."""
    loaded = quantized_tiny("qwen2")  # untied head: the NaN embedding row poisons only its own sequence
    loaded.model.embed.data[96] = float("nan")
    for spec in (SpecConfig(), SpecConfig(algorithm="ngram", num_draft_tokens=3)):
        llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=spec))
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        good, bad = llm.generate([PROMPTS[1], [5, 96, 7]], params)
        assert bad.finish_reason == "error" and good.finish_reason == "length" and len(good.token_ids) == 8
        alone = LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(PROMPTS[1], params)[0]
        assert good.token_ids == alone.token_ids
