"""`tandem bench base`'s kernel section on a tiny block-quantized model and a tiny GGUF."""

import numpy as np
import pytest
import torch

from conftest import ToyTokenizer, build_tiny
from tandem.bench import kernel_report as kr
from tandem.model.arch import model_config_from_hf
from tandem.model.kernels import block_kernels
from tandem.model.loader import LoadedModel, StateDictSource
from tandem.model.transformer import TransformerLM

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="needs tandem's block kernels")


def test_the_report_measures_a_block_model(monkeypatch, capsys):
    monkeypatch.setattr(kr, "measure_bandwidth", lambda: 10.0)  # a 1 GB pass is not a unit test
    hf, _ = build_tiny("llama")
    cfg = model_config_from_hf(hf.config.to_dict())
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = TransformerLM(cfg, StateDictSource(state, "int4", torch.float32, kernels="block"), torch.float32)
    loaded = LoadedModel(model, ToyTokenizer(), cfg, "tiny", torch.float32, "int4", "block")
    monkeypatch.setattr(kr, "gguf_step_bytes", lambda path: 1_000_000)
    report = kr.kernel_report(loaded, gguf_path="model.gguf")
    assert report.curve[1] == 1.0 and set(report.curve) == set(kr.CURVE)
    assert report.int8_peak_gmac_s > 0 and report.tandem_bytes > 0
    assert 0 < report.q4_cached_gmac_s
    assert report.floor_ms == pytest.approx(1_000_000 / 10e9 * 1e3)
    assert report.macs_per_row == kr.linear_macs(model) > 0
    assert report.bf16_curve[1] == 1.0 and report.kernels.startswith("tandem ")
    kr.print_kernel_report(report)
    out = capsys.readouterr().out
    assert "weight-read floor" in out and "int8 peak" in out and "bf16 F.linear reference" in out
    assert "its weights in L1" in out and "of the q4 GEMM's ceiling" in out
    has_bf16 = bool(set(kr.BF16_MULTIPLY_FLAGS) & set(report.isa))
    assert ("no bf16 multiply instructions" in out) == (not has_bf16)


def test_the_bf16_line_says_when_the_cpu_cannot_multiply_bf16(capsys):
    report = kr.KernelReport(
        cpu="some CPU", cpu_model=None, isa=["avx2", "avx512f", "avx512_vnni"], kernels="tandem avx512", threads=2,
        bandwidth_gb_s=20.0, int8_peak_gmac_s=500.0, tandem_bytes=10, gguf_bytes=10, floor_ms=1.0, macs_per_row=10,
        context=300, step_ms=1.2, curve={1: 1.0, 16: 2.0}, extra_row_ms=0.1, extra_row_efficiency=0.4,
        bf16_step_ms=4.0, bf16_curve={1: 1.0, 16: 3.0})
    kr.print_kernel_report(report)
    assert "no bf16 multiply instructions" in capsys.readouterr().out
    report.isa.append("avx512_bf16")
    kr.print_kernel_report(report)
    assert "no bf16 multiply instructions" not in capsys.readouterr().out


def test_gguf_step_bytes_skip_the_embedding_only_when_the_head_is_separate(tmp_path):
    from gguf import GGUFWriter

    def write(name, tensors):
        path = tmp_path / name
        w = GGUFWriter(str(path), "llama")
        for tname, array in tensors.items():
            w.add_tensor(tname, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    embd, out, norm = np.zeros((8, 4), np.float32), np.zeros((8, 4), np.float32), np.zeros(4, np.float32)
    tied = write("tied.gguf", {"token_embd.weight": embd, "blk.0.attn_norm.weight": norm})
    assert kr.gguf_step_bytes(tied) == embd.nbytes + norm.nbytes
    untied = write("untied.gguf", {"token_embd.weight": embd, "output.weight": out, "blk.0.attn_norm.weight": norm})
    assert kr.gguf_step_bytes(untied) == out.nbytes + norm.nbytes


def test_the_bench_base_table_fits_its_longest_configuration_name(capsys):
    from tandem.bench.base import CURVE_SIZES, print_table

    curve = {n: float(n) for n in (1, *CURVE_SIZES)}
    rows = [{"name": name, "tokens_per_second": tps, "bandwidth_fraction": 0.5, "weight_bytes": 1e8,
             "cost_curve": curve, "agreement_tokens": 8} for name, tps in
            (("tandem native", 100.0), ("tandem native/float32 (tandem avx512, a long name)", 90.0))]
    print_table({"results": rows, "max_new_tokens": 8})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("configuration", "tandem"))]
    assert len(lines) == 3 and len({line.index(" tok/s") + 6 for line in lines[:1]} | {
        line.index(f"{tps:7.1f}") + 7 for line, tps in zip(lines[1:], (100.0, 90.0))}) == 1
