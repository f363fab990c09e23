"""The kernel switch: every path the quantized linears can take on this CPU (tandem's block-kernel
variants and torch's int4/int8 kernels) runs the engine losslessly, the variants agree with each
other, and TANDEM_KERNELS refuses what the CPU cannot run."""

import hashlib

import pytest
import torch
import torch.nn.functional as F
from conftest import quantized_tiny

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.llm import LLM
from tandem.model import kernels
from tandem.model.block_linear import BlockQ4Linear, BlockQ8Linear
from tandem.model.quant import Int4Linear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_kernel_path_keeps_speculative_greedy_output_plain(kernel_path, arch):
    loaded = quantized_tiny(arch)
    linear = type(loaded.model.layers[0].qkv)
    assert linear is (Int4Linear if kernel_path == "torch" else BlockQ4Linear)
    prompts = [[5, 6, 7, 8] * 6, list(range(20, 44)), [9, 10, 11] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    plain = LLM.from_loaded(loaded, EngineConfig(max_model_len=96))
    spec = LLM.from_loaded(loaded, EngineConfig(max_model_len=96, spec=SpecConfig("ngram", 4)))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_draft_tokens for o in got) > 0


@pytest.mark.parametrize("kind", [BlockQ4Linear, BlockQ8Linear])
def test_block_variants_agree(kind):
    """The variants differ in vector width, not in the arithmetic of one output element (exact
    integer block sums, then the same float operations per element), so on the CPUs seen they
    agree bit for bit; the stated tolerance is 1e-5 relative."""
    variants = kernels.supported_variants()
    if len(variants) < 2:
        pytest.skip(f"this CPU runs only {variants}")
    torch.manual_seed(0)
    layer = kind.quantize(torch.randn(100, 576), torch.randn(100))
    x = torch.randn(7, 576)
    outs = {v: kernels.load_variant(v).linear(x, layer.blocks(kernels.load_variant(v))) for v in variants}
    ref = F.linear(x, layer.dequantize(), layer.bias)
    for v, y in outs.items():
        torch.testing.assert_close(y, outs[variants[0]], rtol=1e-5, atol=1e-5, msg=f"{v} vs {variants[0]}")
        torch.testing.assert_close(y, ref, rtol=0.05, atol=0.5)


def test_kernels_choice_is_validated(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", "sse9")
    with pytest.raises(ValueError, match="choose one of"):
        kernels.block_kernels()
    missing = [v for v in kernels.VARIANT_NAMES if v not in kernels.supported_variants()]
    if missing:
        monkeypatch.setenv("TANDEM_KERNELS", missing[0])
        with pytest.raises(ValueError, match="cannot run"):
            kernels.block_kernels()
    monkeypatch.setenv("TANDEM_KERNELS", "torch")
    assert kernels.block_kernels() is None and kernels.kernel_description() == "torch int4/int8"


def test_auto_picks_the_best_supported_variant(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", "auto")
    supported = kernels.supported_variants()
    if not supported:
        pytest.skip("no block-kernel variant runs here")
    assert kernels.selected_variant() == supported[0]
    assert kernels.block_kernels().variant == supported[0]


def test_variants_follow_the_cpu_flags(monkeypatch):
    zen3 = frozenset({"avx", "avx2", "fma", "f16c"})
    zen4 = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    alder = zen3 | {"avx_vnni"}
    for flags, expected in ((zen3, ["avx2"]), (zen4, ["avx512", "vnni256", "avx2"]), (alder, ["vnni256", "avx2"]),
                            (frozenset({"sse2"}), [])):
        monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda flags=flags: flags)
        assert kernels.supported_variants() == expected


def test_a_damaged_kernel_library_is_built_again(tmp_path, monkeypatch):
    """A cached kernel library that is not the file its build wrote (truncated, overwritten, or
    without its digest) is compiled again instead of loaded: a truncated one killed the process
    with SIGBUS, a garbage one fell back to torch's kernels for good."""
    from tandem.model.kernels import build as kernels  # where the kernels are built and chosen

    variant = kernels.selected_variant()
    if variant is None:
        pytest.skip("no tandem kernels on this CPU")
    from tandem.paths import cache_root

    key = kernels.load_variant(variant).build_key
    built = cache_root() / "kernels" / f"block_matmul-{variant}-{key}.so"  # the real library, to copy
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    builds = []

    def replace(path, data: bytes):  # a new file: never rewrite one this process has mapped
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(data)
        tmp.replace(path)

    def fake_build(out, flags, source):  # the build's own steps, with the real library as output
        builds.append(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        replace(out, built.read_bytes())
        kernels._digest_path(out).write_text(hashlib.sha256(out.read_bytes()).hexdigest() + "\n")

    monkeypatch.setattr(kernels, "_build", fake_build)
    load = kernels.load_variant.__wrapped__
    load(variant)
    lib = builds[-1]
    assert kernels._intact(lib)
    load(variant)
    assert len(builds) == 1  # intact: loaded as it is
    for damage in (lambda: replace(lib, lib.read_bytes()[:50000]), lambda: replace(lib, b"garbage"),
                   lambda: kernels._digest_path(lib).unlink()):
        damage()
        assert not kernels._intact(lib)
        load(variant)
        assert kernels._intact(lib)
    assert len(builds) == 4


def test_forced_kernels_that_cannot_load_are_an_error(monkeypatch):
    from tandem.model.kernels import build as kernels  # where the kernels are built and chosen

    def cannot(name, source=None):
        raise OSError("invalid ELF header")

    monkeypatch.setattr(kernels, "load_variant", cannot)
    monkeypatch.setenv("TANDEM_KERNELS", "avx2")
    with pytest.raises(ValueError, match="TANDEM_KERNELS=avx2: tandem's avx2 kernels cannot be built or loaded"):
        kernels._block_kernels.__wrapped__("avx2")
    monkeypatch.setenv("TANDEM_KERNELS", "auto")
    with pytest.warns(UserWarning, match="using torch's"):
        assert kernels._block_kernels.__wrapped__("avx2") is None
