"""Integration tests on the real bundled models (marked slow: they load real weights)."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.model.kv_cache import KVCache
from tandem.model.catalogue import resolve_model
from tandem.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.slow

PROMPTS = [
    (True, "What is the capital of France?"),
    (False, "The quick brown fox"),
    (True, "Write a python function that reverses a list."),
    (True, "Summarize: The meeting was moved from Monday to Thursday because the room was booked."),
]


@pytest.fixture(scope="module")
def smol_fp32():
    return LLM("smollm2-135m-instruct", quantization="none", dtype="float32")


@pytest.fixture(scope="module")
def smol_hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2-135m-instruct").hf_dir), dtype=torch.float32).eval()


def test_smollm2_logits_match_transformers(smol_fp32, smol_hf):
    llm = smol_fp32
    runner = ModelRunner(llm.loaded.model, KVCache(llm.loaded.config, 1, 256, torch.float32))
    for chat, prompt in PROMPTS[:2]:
        ids = llm.encode(prompt, chat)
        seq = runner.cache.allocate()
        ours = runner.forward([SeqInput(seq, ids, logits="all")]).logits
        runner.cache.release(seq)
        with torch.no_grad():
            ref = smol_hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)


def test_smollm2_greedy_equals_transformers_generate(smol_fp32, smol_hf):
    for chat, prompt in PROMPTS:
        ids = smol_fp32.encode(prompt, chat)
        ours = smol_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=48))[0]
        ref = smol_hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48)[0, len(ids):].tolist()
        assert ours.token_ids == ref, prompt


def test_gemma3_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    llm = LLM("gemma3-270m", quantization="none", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model("gemma3-270m").hf_dir), dtype=torch.float32).eval()
    ids = llm.encode("The history of the printing press begins")
    runner = ModelRunner(llm.loaded.model, KVCache(llm.loaded.config, 1, 128, torch.float32))
    ours = runner.forward([SeqInput(runner.cache.allocate(), ids, logits="all")]).logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=5e-3, rtol=1e-3)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24))[0]
    ref_ids = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):].tolist()
    assert out.token_ids == ref_ids


@pytest.fixture(scope="module")
def smol_native():
    return LLM("smollm2-135m-instruct")  # auto: the GGUF's own 4-bit blocks, bf16 activations


SPEC_PROMPTS = [
    "Summarize this: The city council voted on Tuesday to extend the library's opening hours. "
    "The library will now open at 8 am and close at 9 pm on weekdays. The council said the library "
    "is one of the most used public buildings in the city.",
    "Write a python function that returns the squares of a list of numbers, then show how to call it.",
    "What is 12 times 13? Explain step by step.",
]


SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def native_plain(smol_native):
    return [o.token_ids for o in smol_native.generate(SPEC_PROMPTS, SPEC_PARAMS, chat=True)]


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_native_speculative_greedy_equals_plain(smol_native, native_plain, algorithm, k):
    """Lossless relative to the quantized target: same configuration, same tokens."""
    from tandem.config import EngineConfig, SpecConfig

    spec_llm = LLM.from_loaded(smol_native.loaded, EngineConfig(spec=SpecConfig(algorithm=algorithm, num_draft_tokens=k)))
    spec = spec_llm.generate(SPEC_PROMPTS, SPEC_PARAMS, chat=True)
    assert [o.token_ids for o in spec] == native_plain
    assert sum(o.spec.num_accepted_tokens for o in spec) > 0


def test_native_batched_equals_single(smol_native, native_plain):
    single = [smol_native.generate(p, SPEC_PARAMS, chat=True)[0].token_ids for p in SPEC_PROMPTS]
    assert single == native_plain  # native_plain ran the three prompts as one batch


def test_gemma3_native_speculative_greedy_equals_plain_on_the_fused_path():
    """Gemma 3 (q/k norms, sandwich norms, GeGLU, local and global rope tables, head dim 256) on
    the native one-call decoder: chains verified by the fused path reproduce plain decoding."""
    from tandem.config import EngineConfig, SpecConfig

    plain = LLM("gemma3-270m")
    spec = LLM.from_loaded(plain.loaded, EngineConfig(spec=SpecConfig(algorithm="ngram", num_draft_tokens=4)))
    assert spec.engine.runner.fused is not None
    prompts = [SPEC_PROMPTS[0], "def squares(numbers):\n    return [n * n for n in numbers]\n\n# squares([1, 2, 3]) =="]
    want = [o.token_ids for o in plain.generate(prompts, SPEC_PARAMS)]
    got = spec.generate(prompts, SPEC_PARAMS)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0
