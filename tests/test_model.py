"""Lean architectures vs transformers, and the runner's cache/tree/batch semantics, on tiny models."""

import pytest
import torch

from conftest import ARCHS, build_tiny
from tandem.model.arch import UnsupportedArchitectureError, model_config_from_hf
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

TOL = dict(atol=2e-4, rtol=1e-4)


def runner_for(model, max_seqs=4, max_len=64):
    return ModelRunner(model, KVCache(model.cfg, max_seqs, max_len, model.dtype))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch):
    hf, ours = build_tiny(arch)
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = runner_for(ours)
    seq = runner.cache.allocate()
    out = runner.forward([SeqInput(seq, ids, logits="all")])
    torch.testing.assert_close(out.logits, hf_logits(hf, ids), **TOL)


def test_gemmas_final_logit_softcap_matches_transformers():
    """The tiny Gemma config sets no softcap; with one (Gemma 2 style, 30 in real configs; 5 here so
    that it bites) the logits are cap * tanh(logits / cap), as transformers computes them."""
    hf, ours = build_tiny("gemma3", final_logit_softcapping=5.0)
    assert ours.cfg.final_logit_softcap == 5.0
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = runner_for(ours)
    out = runner.forward([SeqInput(runner.cache.allocate(), ids, logits="all")])
    torch.testing.assert_close(out.logits, hf_logits(hf, ids), **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_full_forward(arch):
    """Chunked prefill + one-token steps through the cache equal one full forward (sliding
    windows included: 20 tokens exceed the tiny window sizes)."""
    hf, ours = build_tiny(arch)
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    runner = runner_for(ours)
    seq = runner.cache.allocate()
    got = [runner.forward([SeqInput(seq, ids[:7], logits="all")]).logits]
    got.append(runner.forward([SeqInput(seq, ids[7:10], logits="all")]).logits)
    for t in ids[10:]:
        got.append(runner.forward([SeqInput(seq, [t])]).logits)
    torch.testing.assert_close(torch.cat(got), ref, **TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_ragged_forward_equals_single(arch):
    _, ours = build_tiny(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (9, 3, 14)]
    single = []
    for p in prompts:
        r = runner_for(ours)
        single.append(r.forward([SeqInput(r.cache.allocate(), p, logits="all")]).logits)
    r = runner_for(ours)
    seqs = [r.cache.allocate() for _ in prompts]
    out = r.forward([SeqInput(s, p, logits="all") for s, p in zip(seqs, prompts)])
    for b in range(3):
        torch.testing.assert_close(out.rows(b), single[b], **TOL)
    # then one decode step for all three at different lengths
    nxt = [[5], [6], [7]]
    out2 = r.forward([SeqInput(s, t) for s, t in zip(seqs, nxt)])
    for b, p in enumerate(prompts):
        rr = runner_for(ours)
        ref = rr.forward([SeqInput(rr.cache.allocate(), p + nxt[b])]).logits
        torch.testing.assert_close(out2.rows(b), ref, **TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_truncate_then_forward_equals_fresh(arch):
    _, ours = build_tiny(arch)
    ids = list(range(10, 22))
    r = runner_for(ours)
    seq = r.cache.allocate()
    r.forward([SeqInput(seq, ids)])
    r.forward([SeqInput(seq, [40, 41, 42, 43], logits="all")])  # a rejected draft
    r.cache.truncate(seq, len(ids) + 1)  # keep 40 only
    got = r.forward([SeqInput(seq, [50, 51], logits="all")]).logits
    fresh = runner_for(ours)
    s2 = fresh.cache.allocate()
    ref = fresh.forward([SeqInput(s2, ids + [40, 50, 51], logits="all")]).logits[-2:]
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_tree_forward_equals_each_path(arch):
    """Tree: node t sees the prefix and its ancestors; siblings share positions."""
    _, ours = build_tiny(arch)
    prefix = list(range(20, 31))
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tokens = [60, 61, 62, 63, 64, 65]
    parents = [-1, 0, 0, 1, 1, 2]
    depth = [0, 1, 1, 2, 2, 2]
    r = runner_for(ours)
    seq = r.cache.allocate()
    r.forward([SeqInput(seq, prefix)])
    n = len(prefix)
    out = r.forward([SeqInput(seq, tokens, positions=[n + d for d in depth], parents=parents, logits="all")])
    for node in range(len(tokens)):
        path, cur = [], node
        while cur >= 0:
            path.append(tokens[cur])
            cur = parents[cur]
        path.reverse()
        fresh = runner_for(ours)
        ref = fresh.forward([SeqInput(fresh.cache.allocate(), prefix + path)]).logits[0]
        torch.testing.assert_close(out.logits[node], ref, **TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_commit_path_then_forward_equals_fresh(arch):
    _, ours = build_tiny(arch)
    prefix = list(range(20, 31))
    tokens, parents, depth = [60, 61, 62, 63, 64, 65], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2]
    r = runner_for(ours)
    seq = r.cache.allocate()
    r.forward([SeqInput(seq, prefix)])
    n = len(prefix)
    r.forward([SeqInput(seq, tokens, positions=[n + d for d in depth], parents=parents)])
    r.cache.commit_path(seq, [0, 2, 5])
    assert r.cache.lengths[seq] == n + 3
    got = r.forward([SeqInput(seq, [70, 71], logits="all")]).logits
    fresh = runner_for(ours)
    ref = fresh.forward([SeqInput(fresh.cache.allocate(), prefix + [60, 62, 65, 70, 71], logits="all")]).logits[-2:]
    torch.testing.assert_close(got, ref, **TOL)


def test_hidden_states_of_requested_layers():
    hf, ours = build_tiny("llama")
    ids = list(range(5, 17))
    r = runner_for(ours)
    out = r.forward([SeqInput(r.cache.allocate(), ids, logits="last")], hidden_layers=(0, 2))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0][0], ref[1][0], **TOL)  # output of layer 0
    torch.testing.assert_close(out.hidden[2][0], ref[2][0], **TOL)  # final normed state (L = 2)
    assert out.logits.shape == (1, 97)


def test_logits_only_for_requested_positions():
    _, ours = build_tiny("llama")
    r = runner_for(ours)
    out = r.forward([SeqInput(r.cache.allocate(), list(range(5, 15)), logits=[2, 7])])
    assert out.logits.shape == (2, 97)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitectureError, match="llama.*gemma3|gemma3.*llama"):
        model_config_from_hf({"model_type": "gpt2"})


def test_cache_overflow_is_a_clear_error():
    _, ours = build_tiny("llama")
    r = runner_for(ours, max_len=16)
    seq = r.cache.allocate()
    with pytest.raises(RuntimeError, match="max_model_len"):
        r.forward([SeqInput(seq, list(range(3, 23)))])
    assert r.cache.lengths[seq] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_token_by_token_verification_is_bitwise_plain_decoding(arch):
    """With row-independent linears (int8 kernel), a verification forward over several tokens,
    batched with another sequence, reproduces one-token decoding bit for bit (sliding windows
    included): the basis of greedy identity on the quantized target."""
    from tandem.model.loader import StateDictSource
    from tandem.model.transformer import TransformerLM

    hf, _ = build_tiny(arch)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = TransformerLM(model_config_from_hf(hf.config.to_dict()), StateDictSource(state, "int8", torch.bfloat16), torch.bfloat16)
    prompt, new = list(range(10, 19)), [40, 41, 42, 43, 44, 45, 46]
    plain = runner_for(model)
    seq = plain.cache.allocate()
    plain.forward([SeqInput(seq, prompt)])
    ref = torch.cat([plain.forward([SeqInput(seq, [t])]).logits for t in new])
    spec = runner_for(model)
    s1, s2 = spec.cache.allocate(), spec.cache.allocate()
    spec.forward([SeqInput(s1, prompt), SeqInput(s2, [7, 8, 9])])
    out = spec.forward([SeqInput(s1, new, logits="all"), SeqInput(s2, [50, 51])], token_by_token=True)
    assert torch.equal(out.rows(0), ref)
