"""tandem's block kernels (model/kernels) and the fused decode path (model/fused.py)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny

from tandem.model.arch import model_config_from_hf
from tandem.model.block_linear import BlockQ4Linear, BlockQ8Linear
from tandem.model.fused import fused_eligible
from tandem.model.kernels import GEGLU, RMS_NORM, SWIGLU, block_kernels
from tandem.model.kernels.arena import place_contiguously
from tandem.model.kv_cache import KVCache
from tandem.model.loader import StateDictSource
from tandem.model.runner import ModelRunner, SeqInput
from tandem.model.transformer import TransformerLM

# Every test here runs once per block-kernel variant this CPU supports (conftest.block_variant):
# each must reproduce one-token decoding bit for bit when it verifies k tokens.
pytestmark = [
    pytest.mark.usefixtures("one_thread", "block_variant"),
    pytest.mark.skipif(block_kernels() is None, reason="needs an AVX2 CPU and g++"),
]


def block_quantized(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply by: each row's blocks of 32 rounded to int8 at max|x| / 127."""
    g = x.reshape(x.shape[0], -1, 32)
    s = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(s > 0, s, 1)) * s).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("kind", [BlockQ4Linear, BlockQ8Linear])
def test_block_linear_equals_its_dequantised_matmul(kind, rows):
    torch.manual_seed(0)
    w, b = torch.randn(80, 96), torch.randn(80)
    layer = kind.quantize(w, b)
    x = torch.randn(rows, 96)
    ref = F.linear(block_quantized(x), layer.dequantize(), b)
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)
    # the weight quantisation itself: within half a step of each block's scale
    assert (layer.dequantize() - w).abs().max() < (w.abs().max() / (7 if kind is BlockQ4Linear else 127))


@pytest.mark.parametrize("kind", [BlockQ4Linear, BlockQ8Linear])
def test_block_linear_rows_are_independent_bitwise(kind):
    torch.manual_seed(1)
    layer = kind.quantize(torch.randn(100, 64))
    x = torch.randn(17, 64)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    # 9, 11, 16 and 17 rows run in row tiles of 5 + 4, 6 + 5, 8 + 8 and 6 + 6 + 5
    for n in (3, 9, 11, 16, 17):
        assert torch.equal(layer(x[:n]), alone[:n]), n
    torch.set_num_threads(2)
    assert torch.equal(layer(x), alone)  # thread count does not change any element


@pytest.mark.parametrize("kind", [BlockQ4Linear, BlockQ8Linear])
def test_linear_argmax_is_numpys_over_the_rows_it_wrote(kind):
    """The LM head's argmax and finiteness per row: numpy's first index of the largest value
    (ties included: weight rows repeated give equal outputs), a NaN or an infinity anywhere in
    a row flags it, with one thread or two."""
    torch.manual_seed(3)
    base = torch.randn(70, 96)
    w = torch.cat([base, base[:3], base[5:6].repeat(4, 1), base])  # 147 outputs: repeats tie with earlier ones
    layer = kind.quantize(w)
    k = block_kernels()
    x = torch.randn(9, 96)
    x[4] = 0.0  # every output 0: a tie across all columns, the first wins
    x[6, 10] = float("nan")
    x[7, 3] = float("inf")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, best, finite = k.linear_argmax(x, layer.blocks(k))
        torch.testing.assert_close(y, k.linear(x, layer.blocks(k)), rtol=0, atol=0, equal_nan=True)
        assert finite.tolist() == [bool(torch.isfinite(row).all()) for row in y]
        rows = [i for i in range(len(x)) if finite[i]]
        assert best[rows].tolist() == y[rows].numpy().argmax(-1).tolist()
        assert best[4] == 0
    torch.set_num_threads(1)


def test_linear_argmax_adds_the_residual_before_its_scan():
    """With a residual (DSpark's backbone logits under its sequential head's bias), the output is
    torch's `residual + linear(x)` bit for bit, and the argmax and finiteness are of that sum."""
    torch.manual_seed(4)
    layer = BlockQ8Linear.quantize(torch.randn(147, 64))
    k = block_kernels()
    x, residual = torch.randn(5, 64), 3 * torch.randn(5, 147)
    residual[2, 7] = float("inf")
    y, best, finite = k.linear_argmax(x, layer.blocks(k), residual=residual)
    expected = residual + k.linear(x, layer.blocks(k))
    assert torch.equal(y, expected)
    assert finite.tolist() == [True, True, False, True, True]
    assert best[finite].tolist() == expected[finite].numpy().argmax(-1).tolist()
    with pytest.raises(ValueError, match="residual"):
        k.linear_argmax(x, layer.blocks(k), residual=residual[:, :100])


def test_q4_blocks_keep_gguf_affine_groups_exactly():
    torch.manual_seed(2)
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    # GGUF stores scales and offsets as fp16: those survive exactly
    scale, offset = torch.rand(16, 2).half().float(), torch.randn(16, 2).half().float()
    layer = BlockQ4Linear.from_affine_groups(q, scale, offset)
    expected = q.float().reshape(16, 2, 32) * scale[..., None] + offset[..., None]
    assert torch.equal(layer.codes(), q)
    assert torch.equal(layer.dequantize(), expected.reshape(16, 64))
    # a group of 64 splits into two blocks with the same scale and offset
    wide = BlockQ4Linear.from_affine_groups(q, scale[:, :1], offset[:, :1])
    assert torch.equal(wide.dequantize(), (q.float() * scale[:, :1] + offset[:, :1]))


def test_block_scales_are_rounded_to_fp16_and_must_fit():
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    scale = torch.full((16, 2), 0.1)  # not an fp16 value
    layer = BlockQ4Linear.from_affine_groups(q, scale, torch.zeros(16, 2))
    assert torch.equal(layer.d, scale.half().float())
    assert not torch.equal(layer.d, scale)
    with pytest.raises(ValueError, match="fit fp16"):
        BlockQ8Linear(torch.zeros(4, 32, dtype=torch.int8), torch.full((4, 1), 1e6))


def test_fused_input_transforms_and_residual():
    torch.manual_seed(3)
    k = block_kernels()
    layer = BlockQ8Linear.quantize(torch.randn(48, 64))
    x = torch.randn(3, 64)
    w = torch.rand(64) + 0.5
    normed = F.rms_norm(x, (64,), w, 1e-6)
    got = k.linear(x, layer.blocks(k), transform=RMS_NORM, norm_weight=w, eps=1e-6)
    torch.testing.assert_close(got, layer(normed), atol=2e-2, rtol=1e-2)
    gate_up = torch.randn(3, 128)
    for transform, act in ((SWIGLU, F.silu), (GEGLU, lambda g: F.gelu(g, approximate="tanh"))):
        got = k.linear(gate_up, layer.blocks(k), transform=transform)
        torch.testing.assert_close(got, layer(act(gate_up[:, :64]) * gate_up[:, 64:]), atol=2e-2, rtol=1e-2)
    residual = torch.randn(3, 48)
    expected = layer(x) + residual
    k.linear(x, layer.blocks(k), residual=residual, out=residual)  # in place
    torch.testing.assert_close(residual, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="width"):
        k.linear(torch.randn(3, 64), layer.blocks(k), transform=SWIGLU)


@pytest.mark.parametrize("transform", [RMS_NORM, SWIGLU])
def test_transformed_rows_do_not_depend_on_who_prepares_them(transform):
    """Up to 8 rows every thread transforms and quantizes all of them itself; more are split
    over the threads. Either way a row's output is the one it gets alone, bit for bit."""
    torch.manual_seed(4)
    k = block_kernels()
    layer = BlockQ4Linear.quantize(torch.randn(112, 64))
    width = 128 if transform == SWIGLU else 64
    x = torch.randn(19, width)
    w = torch.rand(64) + 0.5

    def run(rows: torch.Tensor) -> torch.Tensor:
        return k.linear(rows, layer.blocks(k), transform=transform, norm_weight=w, eps=1e-6)

    alone = torch.cat([run(x[i : i + 1]) for i in range(len(x))])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in (2, 8, 9, 19):
            assert torch.equal(run(x[:n]), alone[:n]), (threads, n)


def rope_tables(M: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(M + 1, dtype=torch.float32)[:, None] * (1.0 / 100 ** (torch.arange(D // 2) / (D // 2)))
    emb = torch.cat([pos, pos], -1)
    return emb.cos(), torch.cat([-emb.sin()[:, : D // 2], emb.sin()[:, D // 2 :]], -1)


# D 16 and 24 take the any-width path; 64, 128 and 256 the register paths, where queries of one
# kv head share each key load.
def blocked_keys(keys: torch.Tensor) -> torch.Tensor:
    """[S, Hkv, M, D] keys in the blocked layout [S, Hkv, M / 16, D, 16] (KVCache.block_keys)."""
    S, Hkv, M, D = keys.shape
    return keys.view(S, Hkv, M // 16, 16, D).transpose(3, 4).contiguous()


def logical_keys(blocked: torch.Tensor) -> torch.Tensor:
    S, Hkv, B, D, _ = blocked.shape
    return blocked.transpose(3, 4).reshape(S, Hkv, B * 16, D)


# D 16 and 24 take the any-width path; 64, 128 and 256 the register paths, where queries of one
# kv head share each key load. Keys stored [M, D] (a drafter's own caches) or in blocks of 16
# (the shared cache of the fused path), whose slots 20-34 cross a block boundary.
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("D", [16, 64, 128, 256])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["rows", "blocked"])
def test_attend_matches_reference_attention(window, D, kv_dtype, layout):
    torch.manual_seed(4)
    k = block_kernels()
    Hq, Hkv, M, T, start = 6, 2, 48, 15, 20
    kc, vc = torch.zeros(2, Hkv, M, D, dtype=kv_dtype), torch.zeros(2, Hkv, M, D, dtype=kv_dtype)
    kc[1, :, :start], vc[1, :, :start] = torch.randn(Hkv, start, D), torch.randn(Hkv, start, D)
    cos, sin = rope_tables(M, D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    slots = torch.arange(start, start + T)
    blocked = layout == "blocked"
    kb = blocked_keys(kc) if blocked else kc
    out = k.attend(qkv, torch.ones(T, dtype=torch.long), slots, cos, sin, kb, vc, Hq, Hkv, window, 0.25,
                   keys_blocked=blocked)
    if blocked:
        kc = logical_keys(kb)

    def rope(x, p):
        return x * cos[p] + torch.roll(x, D // 2, -1) * sin[p]

    for t in range(T):
        p = start + t
        q = qkv[t, : Hq * D].view(Hq, D)
        k_new = qkv[t, Hq * D : (Hq + Hkv) * D].view(Hkv, D)
        # written in the cache's dtype, rounded to nearest as torch rounds
        assert torch.equal(kc[1, :, p], rope(k_new, p).to(kv_dtype)) or kv_dtype == torch.float32
        torch.testing.assert_close(kc[1, :, p].float(), rope(k_new, p), atol=2e-3, rtol=2e-3)
        assert torch.equal(vc[1, :, p], qkv[t, (Hq + Hkv) * D :].view(Hkv, D).to(kv_dtype))
        lo = 0 if window is None else max(0, p - window + 1)
        keys, values = kc[1, :, lo : p + 1].float(), vc[1, :, lo : p + 1].float()
        ref = F.scaled_dot_product_attention(rope(q, p)[None, :, None], keys[None], values[None], scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out[t].view(Hq, D), ref[0, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D", [16, 24, 64])
def test_attend_rotates_keys_with_one_fused_multiply_add(D):
    """RoPE is x c + rot(x) s with the second product rounded and then one fused multiply-add,
    whether the head dim takes the 8-lane loop (16, 64) or the scalar one (24): the same bits
    either way (checked in float64, where x c is exact)."""
    torch.manual_seed(6)
    k = block_kernels()
    Hq, Hkv, M, T = 2, 2, 8, 4
    kc, vc = torch.zeros(1, Hkv, M, D), torch.zeros(1, Hkv, M, D)
    cos, sin = rope_tables(M, D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    k.attend(qkv, torch.zeros(T, dtype=torch.long), torch.arange(T), cos, sin, kc, vc, Hq, Hkv, None, 0.25)
    for p in range(T):
        x = qkv[p, Hq * D : (Hq + Hkv) * D].view(Hkv, D)
        second = (torch.roll(x, D // 2, -1) * sin[p]).double()
        expected = (x.double() * cos[p].double() + second).float()
        assert torch.equal(kc[0, :, p], expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("D", [24, 64, 128, 256])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_attend_tokens_do_not_depend_on_the_call(threads, D, kv_dtype):
    """Chains of two sequences in one call (queries then share key loads in blocks that depend on
    the token count and the threads) equal one-token calls bit for bit, windows included."""
    torch.manual_seed(5)
    torch.set_num_threads(threads)
    k = block_kernels()
    Hq, Hkv, M, prefix = 6, 2, 40, 9
    cos, sin = rope_tables(M, D)
    base_k = torch.randn(3, Hkv, M, D).to(kv_dtype)
    base_v = torch.randn(3, Hkv, M, D).to(kv_dtype)
    seq = torch.tensor([0, 0, 0, 0, 0, 2, 2])
    slot = torch.tensor([prefix, prefix + 1, prefix + 2, prefix + 3, prefix + 4, prefix, prefix + 1])
    qkv = torch.randn(len(seq), (Hq + 2 * Hkv) * D)
    for window in (None, 4):
        kc, vc = base_k.clone(), base_v.clone()
        together = k.attend(qkv, seq, slot, cos, sin, kc, vc, Hq, Hkv, window, 0.3)
        kc1, vc1 = base_k.clone(), base_v.clone()
        alone = torch.cat([k.attend(qkv[t : t + 1], seq[t : t + 1], slot[t : t + 1], cos, sin, kc1, vc1, Hq, Hkv,
                                    window, 0.3) for t in range(len(seq))])
        assert torch.equal(together, alone)
        assert torch.equal(kc, kc1) and torch.equal(vc, vc1)


def block_model(arch: str, mode: str = "int4", **overrides) -> tuple:
    hf, _ = build_tiny(arch, **overrides)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = model_config_from_hf(hf.config.to_dict())
    model = TransformerLM(cfg, StateDictSource(state, mode, torch.float32, kernels="block"), torch.float32)
    return hf, model


def runner_for(model, max_seqs=4, max_len=64, kv_dtype=None):
    return ModelRunner(model, KVCache(model.cfg, max_seqs, max_len, model.dtype, storage=kv_dtype))


# Head dims of the register attention paths (64 as SmolLM2's, 256 as Gemma 3's), on models the
# size of these tests; the others have heads of 16 or 24.
WIDE_HEADS = {"llama-d64": ("llama", dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1)),
              "gemma3-d256": ("gemma3", dict(head_dim=256, num_attention_heads=4, num_key_value_heads=1))}


def block_model_named(name: str):
    arch, overrides = WIDE_HEADS.get(name, (name, {}))
    return block_model(arch, **overrides)[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma3"])
def test_fused_path_matches_general_path(arch):
    _, model = block_model(arch)
    assert fused_eligible(model)
    prompt = list(range(10, 30))
    fused = runner_for(model)
    general = ModelRunner(model, KVCache(model.cfg, 4, 64, model.dtype), fused=False)
    assert fused.fused is not None and general.fused is None
    a, b = fused.cache.allocate(), general.cache.allocate()
    out_f = fused.forward([SeqInput(a, prompt, logits="all")], hidden_layers=(0, 2))
    out_g = general.forward([SeqInput(b, prompt, logits="all")], hidden_layers=(0, 2))
    # the same kernels for the linears; norms, RoPE and attention differ only in rounding
    torch.testing.assert_close(out_f.logits, out_g.logits, atol=0.05, rtol=0.02)
    torch.testing.assert_close(out_f.hidden[2][0], out_g.hidden[2][0], atol=0.05, rtol=0.02)
    assert (out_f.logits.argmax(-1) == out_g.logits.argmax(-1)).float().mean() > 0.9


def test_placing_weights_in_one_buffer_changes_their_addresses_not_their_products():
    k = block_kernels()
    torch.manual_seed(7)
    layers = [BlockQ4Linear.quantize(torch.randn(48, 64), bias=torch.randn(48)),
              BlockQ8Linear.quantize(torch.randn(40, 96))]
    weights = [layer.blocks(k) for layer in layers]
    xs = [torch.randn(3, 64), torch.randn(3, 96)]
    before = [k.linear(x, w) for x, w in zip(xs, weights)]
    buffer = place_contiguously(weights + weights[:1])  # a weight listed twice is placed once
    inside = []
    for w in weights:
        for t in (w.packed, w.pd, w.pm, w.bias):
            if t is not None:
                assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and t.data_ptr() % 64 == 0
                inside.append(t.data_ptr())
    assert inside == sorted(inside)  # in the order given, the first weight's codes first
    assert (weights[0].record.packed, weights[1].record.pd) == (weights[0].packed.data_ptr(), weights[1].pd.data_ptr())
    for x, w, y in zip(xs, weights, before):
        assert torch.equal(k.linear(x, w), y)
    with pytest.raises(ValueError, match="relocate needs"):
        weights[1].relocate(weights[1].packed)


def test_the_fused_decoder_streams_its_weights_from_one_buffer():
    _, model = block_model("llama")
    fused = runner_for(model).fused
    weights = [w for p in fused._parts for w in p.linears] + [fused._head]
    storages = {w.packed.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 1
    starts = [w.packed.data_ptr() for w in weights]
    assert starts == sorted(starts)  # in the order a forward reads them


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_final_norm_runs_fused_into_the_lm_head(arch):
    """The fused path's logits: one native call (the norm fused into the head's input), the
    model's own norm and head up to rounding, and each row the same bits alone or with others."""
    _, model = block_model(arch)
    fused = runner_for(model).fused
    assert fused._head is not None
    torch.manual_seed(5)
    h = torch.randn(5, model.cfg.hidden_size)
    got = fused.logits(h)
    torch.testing.assert_close(got, model.logits(h), atol=0.05, rtol=0.02)
    assert all(torch.equal(fused.logits(h[i : i + 1]), got[i : i + 1]) for i in range(5))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma3", *WIDE_HEADS])
def test_block_verification_is_bitwise_plain_decoding(arch, kv_dtype):
    """A verification forward over several tokens, batched with another sequence, reproduces
    one-token decoding bit for bit on the block kernels' fused path (mistral with its sliding
    window, qwen3 with q/k norms, gemma3 with sandwich norms, GeGLU and two rope tables), with
    either KV cache dtype."""
    model = block_model_named(arch)
    prompt, new = list(range(10, 19)), [40, 41, 42, 43, 44, 45, 46]
    plain = runner_for(model, kv_dtype=kv_dtype)
    seq = plain.cache.allocate()
    plain.forward([SeqInput(seq, prompt)])
    ref = torch.cat([plain.forward([SeqInput(seq, [t])]).logits for t in new])
    spec = runner_for(model, kv_dtype=kv_dtype)
    s1, s2 = spec.cache.allocate(), spec.cache.allocate()
    spec.forward([SeqInput(s1, prompt), SeqInput(s2, [7, 8, 9])])
    out = spec.forward([SeqInput(s1, new, logits="all"), SeqInput(s2, [50, 51])], token_by_token=True)
    assert torch.equal(out.rows(0), ref)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3", *WIDE_HEADS])
def test_tree_verification_commits_paths_bitwise_plain_decoding(arch, kv_dtype):
    """A tree verified token by token (batched with a chain), then one accepted path gathered
    with commit_path: every node's logits and the next forward's equal one-token decoding of
    that path bit for bit (on the fused path, every architecture, either KV cache dtype)."""
    model = block_model_named(arch)
    prompt = list(range(10, 21))
    #        0            tokens 40..46
    #      / | \
    #     1  2  3
    #    /|     |
    #   4 5     6
    tokens, parents = [40, 41, 42, 43, 44, 45, 46], [-1, 0, 0, 0, 1, 1, 3]
    paths = [[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 3, 6]]

    def decoded(path_tokens):
        plain = runner_for(model, kv_dtype=kv_dtype)
        seq = plain.cache.allocate()
        plain.forward([SeqInput(seq, prompt)])
        return torch.cat([plain.forward([SeqInput(seq, [t])]).logits for t in path_tokens])

    spec = runner_for(model, kv_dtype=kv_dtype)
    s1, s2 = spec.cache.allocate(), spec.cache.allocate()
    spec.forward([SeqInput(s1, prompt), SeqInput(s2, [7, 8, 9])])
    out = spec.forward([SeqInput(s1, tokens, parents=parents, logits="all"), SeqInput(s2, [50, 51])], token_by_token=True)
    for node, path in enumerate(paths):
        assert torch.equal(out.rows(0)[node], decoded([tokens[i] for i in path])[-1]), node
    spec.cache.commit_path(s1, [0, 3, 6])
    after = spec.forward([SeqInput(s1, [47, 48], logits="all")], token_by_token=True).logits
    assert torch.equal(after, decoded([40, 43, 46, 47, 48])[-2:])


def test_models_with_qk_norm_or_sandwich_norms_take_the_fused_path():
    for arch in ("qwen3", "gemma3"):
        _, model = block_model(arch)
        assert fused_eligible(model)
        assert runner_for(model).fused is not None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gemma3", *WIDE_HEADS])
def test_prompts_of_any_length_take_the_fused_path_and_decoding_stays_bitwise(arch, kv_dtype, monkeypatch):
    """Prompts run on the fused path too, split into pieces of FUSED_ROW_BUDGET rows: each
    prompt's numbers are the same alone, batched with others (of other lengths) or in one piece,
    and verification after such a prompt reproduces one-token decoding bit for bit."""
    import tandem.model.runner as runner_module

    model = block_model_named(arch)
    long, short = list(range(10, 50)), list(range(60, 72))
    alone = runner_for(model, kv_dtype=kv_dtype)
    ref = alone.forward([SeqInput(alone.cache.allocate(), long, logits="all")], hidden_layers=(1,))
    assert ref.logits.shape[0] == len(long)
    monkeypatch.setattr(runner_module, "FUSED_ROW_BUDGET", 16)  # pieces of 16, 16 and 8 rows
    batched = runner_for(model, kv_dtype=kv_dtype)
    seq, other = batched.cache.allocate(), batched.cache.allocate()
    out = batched.forward([SeqInput(other, short), SeqInput(seq, long, logits=[3, 20, 39])], hidden_layers=(1,))
    assert out.offsets == [0, 1, 4]
    assert torch.equal(out.rows(1), ref.logits[[3, 20, 39]]) and torch.equal(out.hidden[1][1], ref.hidden[1][0])
    assert batched.cache.lengths[seq] == len(long) and batched.cache.lengths[other] == len(short)

    new = [40, 41, 42, 43, 44]
    step = torch.cat([batched.forward([SeqInput(seq, [t])]).logits for t in new])
    verify = runner_for(model, kv_dtype=kv_dtype)
    s1 = verify.cache.allocate()
    verify.forward([SeqInput(s1, long)])
    out = verify.forward([SeqInput(s1, new, logits="all")])
    assert torch.equal(out.logits, step)


def test_a_batch_over_the_row_budget_packs_into_as_few_calls_as_fit(monkeypatch):
    """Many sequences' short drafts (and a tree) beyond FUSED_ROW_BUDGET run in ceil(rows / budget)
    native calls, not one per sequence, with every sequence's numbers those of a forward of its own."""
    import tandem.model.runner as runner_module

    model = block_model_named("llama")
    drafts = [[20 + i, 30 + i, 40 + i, 50 + i, 60 + i] for i in range(7)]
    tree = SeqInput(0, [5, 6, 7, 8], parents=[-1, 0, 0, 1], logits="all")

    def fresh():
        r = runner_for(model, max_seqs=8)
        seqs = [r.cache.allocate() for _ in range(8)]
        r.forward([SeqInput(s, [3, 4, 5 + s]) for s in seqs])  # a short prefix each
        return r, seqs

    alone, seqs = fresh()
    ref = [alone.forward([SeqInput(s, d, logits="all")], hidden_layers=(1,)) for s, d in zip(seqs, drafts)]
    ref_tree = alone.forward([SeqInput(seqs[7], tree.token_ids, parents=tree.parents, logits="all")])
    monkeypatch.setattr(runner_module, "FUSED_ROW_BUDGET", 16)
    packed, seqs = fresh()
    calls = []
    fused_call = packed._fused_call
    monkeypatch.setattr(packed, "_fused_call", lambda inputs, layers: calls.append(len(inputs)) or fused_call(inputs, layers))
    out = packed.forward([SeqInput(s, d, logits="all") for s, d in zip(seqs, drafts)]
                         + [SeqInput(seqs[7], tree.token_ids, parents=tree.parents, logits="all")], hidden_layers=(1,))
    assert len(calls) == 3  # 39 rows in calls of 16, 16 and 7 (the tree whole in the last)
    for b in range(7):
        assert torch.equal(out.rows(b), ref[b].logits) and torch.equal(out.hidden[1][b], ref[b].hidden[1][0])
    assert torch.equal(out.rows(7), ref_tree.logits)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_speculative_greedy_output_equals_plain_on_block_kernels_with_long_prompts(arch):
    """End to end through the engine: prompts past the fused path's length (the general path),
    batched, greedy; speculative output equals plain output token for token."""
    from conftest import ToyTokenizer

    from tandem.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.llm import LLM
    from tandem.model.loader import LoadedModel

    _, model = block_model(arch)
    loaded = LoadedModel(model, ToyTokenizer(), model.cfg, f"block-{arch}", torch.float32, "int4", "block")
    prompts = [[5, 6, 7, 8] * 12, list(range(20, 60)), [9, 10, 11] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLM.from_loaded(loaded, EngineConfig(max_model_len=128))
    spec = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=SpecConfig("ngram", 4)))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    alone = [spec.generate([p], params)[0].token_ids for p in prompts]
    assert alone == want
