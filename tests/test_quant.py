"""Weight-only quantized linears: exactness of packing, kernel accuracy, shapes, fusion."""

import pytest
import torch
import torch.nn.functional as F

from tandem.model.quant import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    concat_out_features,
    quantize_linear,
)

# bf16 activations and bf16 outputs: the kernels' results may differ from an fp32 matmul with
# the same (dequantised) weights by bf16 rounding of inputs/outputs, ~0.3% in practice.
REL_TOL = 1e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def exact_affine_groups(out_f: int, in_f: int, group: int, seed: int = 0):
    """Codes with a power-of-two scale and an offset that make scale and offset + 8 * scale
    exact in bf16, so the int4 layer must reproduce q * scale + offset bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = 2.0 ** torch.randint(-8, -3, (out_f, in_f // group), generator=g).float()
    offset = -8.0 * scale + torch.randint(-64, 64, scale.shape, generator=g).float() / 256
    return q, scale, offset


def expand(groups: torch.Tensor, in_f: int) -> torch.Tensor:
    return groups.repeat_interleave(in_f // groups.shape[1], dim=1)


@pytest.mark.parametrize("out_f", [16, 48, 64, 80, 100, 576])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_from_affine_groups_round_trips_exactly(out_f, group):
    in_f = 384
    q, scale, offset = exact_affine_groups(out_f, in_f, group)
    layer = Int4Linear.from_affine_groups(q, scale, offset)
    assert (layer.in_features, layer.out_features, layer.group_size) == (in_f, out_f, group)
    assert torch.equal(layer.codes(), q)
    w = q.float() * expand(scale, in_f) + expand(offset, in_f)
    assert torch.equal(layer.dequantize(), w)


@pytest.mark.parametrize("out_f", [64, 100])
def test_int4_forward_matches_dequantised_matmul(out_f):
    in_f = 256
    q, scale, offset = exact_affine_groups(out_f, in_f, 32, seed=1)
    bias = torch.randn(out_f)
    layer = Int4Linear.from_affine_groups(q, scale, offset, bias)
    w = q.float() * expand(scale, in_f) + expand(offset, in_f)
    x = torch.randn(2, 3, in_f)
    y = layer(x)
    assert y.shape == (2, 3, out_f) and y.dtype == torch.bfloat16
    assert rel_err(y, F.linear(x, w, bias)) < REL_TOL
    one = layer(x[0, 0])
    assert one.shape == (out_f,)
    assert torch.equal(one, y[0, 0])


def test_int4_quantize_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = Int4Linear.quantize(w, group_size=32)
    groups = w.view(96, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    # Half a quantisation step, plus bf16 rounding of scale and zero (relative 2^-8 each).
    bound = 0.5 * step + 2.0 ** -8 * (8 * step + groups.abs().amax(-1))
    err = (layer.dequantize() - w).abs().view(96, -1, 32).amax(-1)
    assert (err <= bound).all()


def test_int4_constant_group_is_exact():
    w = torch.full((16, 64), 0.25)
    w[:, 32:] = -1.5
    assert torch.equal(Int4Linear.quantize(w).dequantize(), w)


def test_int4_rejects_bad_shapes():
    with pytest.raises(ValueError):
        Int4Linear.quantize(torch.randn(16, 48), group_size=32)
    with pytest.raises(ValueError):
        Int4Linear.quantize(torch.randn(16, 64), group_size=16)
    q, scale, offset = exact_affine_groups(16, 64, 32)
    with pytest.raises(ValueError):
        Int4Linear.from_affine_groups(q + 16, scale, offset)


def test_int4_state_dict_round_trip():
    torch.manual_seed(0)
    layer = Int4Linear.quantize(torch.randn(100, 128), torch.randn(100), group_size=64)
    fresh = Int4Linear(128, 100, group_size=64, bias=True)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(5, 128)
    assert torch.equal(fresh(x), layer(x))


def test_int8_quantize_and_forward():
    torch.manual_seed(0)
    w, bias = torch.randn(100, 136), torch.randn(100)
    layer = Int8Linear.quantize(w, bias)
    step = layer.scales.float()[:, None]
    assert ((layer.dequantize() - w).abs() <= 0.5 * step * (1 + 2.0 ** -7)).all()
    x = torch.randn(4, 2, 136)
    y = layer(x)
    assert y.shape == (4, 2, 100) and y.dtype == torch.bfloat16
    assert rel_err(y, F.linear(x, layer.dequantize(), bias)) < REL_TOL
    assert rel_err(y, F.linear(x, w, bias)) < REL_TOL


@pytest.mark.parametrize("in_features", [1, 3, 8, 24, 40, 100, 127, 136, 144])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_int8_any_width_runs_and_is_right(in_features, rows):
    # torch's _weight_int8pack_mm segfaults or returns wrong sums on widths that are not a
    # multiple of 16 (AVX-512) or 8 (AVX2); Int8Linear pads them, on whatever CPU this runs on.
    torch.manual_seed(in_features * 100 + rows)
    w, bias = torch.randn(100, in_features), torch.randn(100)
    layer = Int8Linear.quantize(w, bias)
    x = torch.randn(rows, in_features)
    y = layer(x)
    assert y.shape == (rows, 100)
    assert rel_err(y, F.linear(x, layer.dequantize(), bias)) < REL_TOL
    assert layer.dequantize().shape == (100, in_features)


def test_int8_fused_parts_keep_their_width():
    torch.manual_seed(1)
    parts = [Int8Linear.quantize(torch.randn(n, 100)) for n in (20, 36)]
    fused = concat_out_features(parts)
    x = torch.randn(3, 100)
    assert fused.in_features == 100
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_int4_on_a_width_without_whole_groups_uses_padded_int8():
    torch.manual_seed(2)
    w = torch.randn(48, 100)
    with pytest.warns(UserWarning, match="use int8 weights"):
        layer = quantize_linear(w, None, "int4", group_size=32)
    assert isinstance(layer, Int8Linear)
    x = torch.randn(5, 100)
    assert rel_err(layer(x), F.linear(x, w)) < REL_TOL


def test_dense_linear_casts_input_to_its_dtype():
    torch.manual_seed(0)
    w, bias = torch.randn(24, 40), torch.randn(24)
    x = torch.randn(3, 40)
    layer = DenseLinear(w, bias, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    assert torch.equal(layer(x), F.linear(x.bfloat16(), w.bfloat16(), bias.bfloat16()))
    assert torch.equal(DenseLinear(w, bias)(x), F.linear(x, w, bias))


def test_quantize_linear_modes():
    w = torch.randn(32, 64)
    assert isinstance(quantize_linear(w, None, "none"), DenseLinear)
    assert isinstance(quantize_linear(w, None, "int8"), Int8Linear)
    assert isinstance(quantize_linear(w, None, "int4"), Int4Linear)
    with pytest.raises(ValueError):
        quantize_linear(w, None, "int3")


@pytest.mark.parametrize("make", [
    lambda w, b: Int4Linear.quantize(w, b),
    lambda w, b: Int8Linear.quantize(w, b),
    lambda w, b: DenseLinear(w, b, dtype=torch.bfloat16),
])
def test_concat_out_features_equals_concatenated_outputs(make):
    torch.manual_seed(0)
    # 40 and 100 rows are padded to 48 and 112 inside Int4Linear: fusion must drop the padding.
    parts = [make(torch.randn(40, 128), None), make(torch.randn(100, 128), torch.randn(100)),
             make(torch.randn(64, 128), None)]
    fused = concat_out_features(parts)
    assert fused.out_features == 204
    x = torch.randn(2, 3, 128)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_concat_out_features_rejects_mixed_kinds():
    w = torch.randn(32, 64)
    with pytest.raises(TypeError):
        concat_out_features([Int4Linear.quantize(w), Int8Linear.quantize(w)])
    with pytest.raises(ValueError):
        concat_out_features([Int8Linear.quantize(w), Int8Linear.quantize(torch.randn(32, 96))])


def test_non_cpu_buffers_fall_back_to_dequantised_linear(monkeypatch):
    # The meta device stands in for CUDA here: same branch, shapes and dtypes only.
    from tandem.model import quant

    monkeypatch.setattr(quant, "_warned_fallback", set())
    w, bias = torch.randn(100, 256), torch.randn(100)
    for layer in (Int4Linear.quantize(w, bias), Int8Linear.quantize(w, bias)):
        with pytest.warns(UserWarning, match="CPU-only"):
            y = layer.to("meta")(torch.randn(2, 3, 256, device="meta"))
        assert y.shape == (2, 3, 100) and y.dtype == torch.bfloat16 and y.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fallback_matches_cpu():
    torch.manual_seed(0)
    w, bias = torch.randn(100, 256), torch.randn(100)
    x = torch.randn(3, 256)
    for layer in (Int4Linear.quantize(w, bias), Int8Linear.quantize(w, bias)):
        expected = F.linear(x, layer.dequantize(), bias)
        gpu = layer.to("cuda")
        y = gpu(x.cuda())
        assert y.device.type == "cuda" and y.dtype == torch.bfloat16
        assert rel_err(y.cpu(), expected) < REL_TOL
