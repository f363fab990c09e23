"""Integration tests on the real bundled models (marked slow: they load real weights)."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.model.kv_cache import KVCache
from tandem.model.loader import resolve_model
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
