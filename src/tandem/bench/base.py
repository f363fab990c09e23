"""`tandem bench base`: plain decoding speed of every configuration side by side, in one run.

Rows: tandem at each dtype/quantization, transformers `generate` (fp32, its best eager setup) and
llama.cpp on the same GGUF when llama-cpp-python is installed. Columns: tokens/s, ratio to
transformers, fraction of the bandwidth limit measured in the same run, and the forward cost
curve (time of a forward over n new tokens relative to n = 1), which bounds what speculation can
gain: verifying k drafts costs curve[k + 1].
"""

from __future__ import annotations

import gc
import importlib.util
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tandem.bench.kernel_report import kernel_report, measure_bandwidth, model_weight_bytes, print_kernel_report
from tandem.bench.plots import stamp_machine
from tandem.bench.prompts import spec_bench_prompts
from tandem.bench.spec import machine_info, machine_line
from tandem.bench.steal import StealMeter, steal_notice
from tandem.config import DTYPES, QUANTIZATIONS, SamplingParams
from tandem.llm import LLM
from tandem.model.kernels import kernel_description
from tandem.model.cost import CONTEXT_FOR_CURVE, CURVE_SIZES, fastest_of, forward_cost_curve
from tandem.model.catalogue import resolve_model
from tandem.model.loader import float_checkpoint, load_model


# The clock every timing in a run uses: wall time, or with --cpu-time the CPU time of the calling
# thread with every engine on one thread (on a shared host wall time mostly measures the
# neighbours; single-thread CPU time compares the work each engine does per token). Process CPU
# time would not do: idle OpenMP workers spinning after a parallel region count in it.
_clock = time.perf_counter


def use_cpu_clock(enabled: bool) -> None:
    global _clock
    _clock = time.thread_time if enabled else time.perf_counter


@dataclass
class BaseResult:
    name: str
    tokens_per_second: float
    weight_bytes: int = 0
    bandwidth_fraction: float | None = None
    cost_curve: dict[int, float] = field(default_factory=dict)
    step_ms: float | None = None
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Greedy agreement with tandem's fp32 run (identical to transformers' fp32 greedy): mean
    # number of tokens before the first divergence, and prompts identical over all tokens.
    agreement_tokens: float | None = None
    agreement_identical: int | None = None


def run_tandem(model_name: str, dtype: str, quant: str, prompts: list[str], max_new: int, threads: int | None):
    llm = LLM(model_name, dtype=dtype, quantization=quant, threads=threads, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    chat = llm.tokenizer.chat_template is not None  # a base model (Gemma 3 270M) takes the plain text
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), chat=chat)
    tokens, seconds, token_ids = 0, 0.0, []
    for p in prompts:
        t = _clock()
        out = llm.generate(p, params, chat=chat)[0]
        seconds += _clock() - t
        tokens += len(out.token_ids)
        token_ids.append(out.token_ids)
    curve = forward_cost_curve(llm.loaded, clock=_clock)
    loaded = llm.loaded
    label = f"tandem {loaded.quantization}/{str(loaded.dtype).replace('torch.', '')}"
    if loaded.quantization != "none":
        label += f" ({kernel_description() if loaded.kernels == 'block' else 'torch kernels'})"
    return BaseResult(label, tokens / seconds, model_weight_bytes(llm.loaded.model), cost_curve=curve,
                      step_ms=curve[1] * 1000, token_ids=token_ids)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_transformers(model_name: str, prompts: list[str], max_new: int) -> BaseResult:
    """transformers `generate`, fp32, greedy, static-free default cache: its documented default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: ~1 s to import, this row only

    hf_dir = float_checkpoint(model_name)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    def encode(p):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True, return_tensors="pt")
        return ids["input_ids"]

    gen = dict(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        model.generate(encode(prompts[0]), **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
        tokens, seconds = 0, 0.0
        for p in prompts:
            ids = encode(p)
            t = _clock()
            out = model.generate(ids, **gen)
            seconds += _clock() - t
            tokens += out.shape[1] - ids.shape[1]
        curve = _transformers_cost_curve(model)
    return BaseResult("transformers generate fp32", tokens / seconds,
                      model_weight_bytes(model, skip=("model.embed_tokens",)) if not model.config.tie_word_embeddings
                      else model_weight_bytes(model, skip=()), cost_curve=curve, step_ms=curve[1] * 1000)


def _transformers_cost_curve(model, repeats: int = 5) -> dict[int, float]:
    from transformers import DynamicCache  # lazy: ~1 s to import, the transformers row only

    cache = DynamicCache(config=model.config)
    prefix = torch.tensor([[100 + i % 1000 for i in range(CONTEXT_FOR_CURVE)]])
    model(prefix, past_key_values=cache, use_cache=True)

    def fwd(n):
        ids = torch.tensor([[200 + i for i in range(n)]])
        model(ids, past_key_values=cache, use_cache=True)
        cache.crop(-n)  # transformers 5: a negative count drops that many trailing tokens

    return fastest_of(fwd, CURVE_SIZES, repeats, _clock, size=int)  # measured as tandem's curve is


def run_llamacpp(model_name: str, prompts: list[str], max_new: int, threads: int | None,
                 cpu_time: bool = False) -> tuple[BaseResult | None, str]:
    """llama.cpp (llama-cpp-python) on the same GGUF, same prompts and token count, in a child
    process: a build that dies on this CPU (an illegal instruction) costs its line, not the run.
    Returns the result, or None and why there is none."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed"
    src = resolve_model(model_name)
    if src.gguf_path is None:
        return None, f"{model_name} has no GGUF file"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        job = pool.submit(_llamacpp_tokens_per_second, str(src.gguf_path), prompts, max_new, threads, cpu_time)
        try:
            return BaseResult("llama.cpp (same GGUF)", job.result()), ""
        except BrokenProcessPool:
            return None, ("llama.cpp crashed in its process (a build using instructions this machine does not "
                          "run, such as AMX under a hypervisor?)")


def _llamacpp_tokens_per_second(gguf_path: str, prompts: list[str], max_new: int, threads: int | None,
                                cpu_time: bool) -> float:
    from llama_cpp import Llama  # lazy: optional dependency (llama-cpp-python), in the child process only

    use_cpu_clock(cpu_time)
    llm = Llama(model_path=gguf_path, n_ctx=2048, n_threads=threads or os.cpu_count(), verbose=False)
    eos = llm.token_eos()

    def no_eos(_ids, logits):
        logits[eos] = -float("inf")
        return logits

    def answer(prompt: str, max_tokens: int) -> dict:
        if llm.metadata.get("tokenizer.chat_template"):
            return llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                              temperature=0.0, logits_processor=[no_eos])
        # a base model: the plain text, as tandem runs it
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, logits_processor=[no_eos])

    answer(prompts[0], 8)  # warmed up as tandem and transformers are: a first call's setup is no decoding
    tokens, seconds = 0, 0.0
    for p in prompts:
        t = _clock()
        out = answer(p, max_new)
        seconds += _clock() - t
        tokens += out["usage"]["completion_tokens"]
    return tokens / seconds


def bench_base(args) -> dict:
    if args.cpu_time and args.threads != 1:
        raise ValueError("--cpu-time measures one thread: run it with --threads 1")
    configs = [config.split("/", 1) if "/" in config else ("auto", config) for config in args.configs]
    for (dtype, quant), config in zip(configs, args.configs):  # before minutes of the other runs
        if dtype not in ("auto",) + DTYPES or quant not in QUANTIZATIONS:
            raise ValueError(f"--configs {config!r}: give DTYPE/QUANTIZATION or QUANTIZATION, DTYPE in "
                             f"{('auto',) + DTYPES}, QUANTIZATION in {QUANTIZATIONS}")
    use_cpu_clock(args.cpu_time)
    steal = StealMeter()
    prompts = [p.text for p in spec_bench_prompts(per_category=1)][: args.num_prompts]
    kernels = None
    if not args.skip_kernel_report:
        kernels = kernel_report(load_model(args.model), resolve_model(args.model).gguf_path)
        print_kernel_report(kernels)
        gc.collect()
    bandwidth = kernels.bandwidth_gb_s if kernels else measure_bandwidth()
    print(f"{len(prompts)} Spec-Bench prompts, {args.max_new_tokens} new tokens each")
    results: list[BaseResult] = []
    if not args.skip_transformers:
        results.append(run_transformers(args.model, prompts, args.max_new_tokens))
        gc.collect()
    for dtype, quant in configs:
        results.append(run_tandem(args.model, dtype, quant, prompts, args.max_new_tokens, args.threads))
        gc.collect()
    lcpp, why = run_llamacpp(args.model, prompts, args.max_new_tokens, args.threads, args.cpu_time)
    if lcpp:
        results.append(lcpp)
    elif args.require_llamacpp:
        raise RuntimeError(f"--require-llamacpp: {why}; install it built for this CPU: "
                           "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python")
    elif why != "llama-cpp-python is not installed":
        print(f"no llama.cpp line: {why}")
    reference = next((r for r in results if r.name == "tandem none/float32"), None)
    for r in results:
        if r.weight_bytes:
            r.bandwidth_fraction = r.tokens_per_second / (bandwidth * 1e9 / r.weight_bytes)
        if reference is not None and r.token_ids and r is not reference:
            spans = [first_divergence(a, b) for a, b in zip(r.token_ids, reference.token_ids)]
            r.agreement_tokens = sum(spans) / len(spans)
            r.agreement_identical = sum(s == len(b) for s, b in zip(spans, reference.token_ids))
    report = {"model": args.model, "bandwidth_gb_s": bandwidth, "max_new_tokens": args.max_new_tokens,
              "clock": "thread CPU time" if args.cpu_time else "wall", "threads": args.threads,
              "num_prompts": len(prompts), "kernels": kernels.as_dict() if kernels else None,
              "results": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in results],
              "machine": machine_info(steal)}
    share = steal.share()
    if share is not None:
        report["steal"] = round(share, 4)
    print_table(report)
    notice = steal_notice(share)
    if notice:
        print(notice)
    if args.out:
        save_report(report, args.out)
    if args.plot:
        plot_cost_curves(report, args.plot)
    return report


def save_report(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def print_table(report: dict) -> None:
    cpu = machine_line(report.get("machine", {}))
    if cpu:
        print(cpu)
    results = report["results"]
    ref = next((r["tokens_per_second"] for r in results if r["name"].startswith("transformers")), None)
    width = max([30, *(len(r["name"]) for r in results)])  # the longest configuration name sets the column
    head = (f"{'configuration':{width}} {'tok/s':>7} {'vs HF':>6} {'BW use':>7} {'weights':>8} {'agree':>7}"
            "  cost curve n=" + "/".join(map(str, CURVE_SIZES)))
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = f"{r['tokens_per_second'] / ref:.2f}x" if ref else "-"
        bw = f"{r['bandwidth_fraction'] * 100:.0f}%" if r["bandwidth_fraction"] else "-"
        mb = f"{r['weight_bytes'] / 1e6:.0f}MB" if r["weight_bytes"] else "-"
        curve = r["cost_curve"]
        c = "/".join(f"{curve[n] / curve[1]:.2f}" for n in CURVE_SIZES) if curve else "-"
        agree = f"{r['agreement_tokens']:.0f}" if r.get("agreement_tokens") is not None else "-"
        print(f"{r['name']:{width}} {r['tokens_per_second']:7.1f} {ratio:>6} {bw:>7} {mb:>8} {agree:>7}  {c}")
    print("agree: mean greedy tokens before the first divergence from tandem fp32 "
          f"(= transformers fp32 greedy), out of {report['max_new_tokens']}")


def plot_cost_curves(report: dict, path: str) -> None:
    try:
        import matplotlib  # lazy: optional dependency (plots only)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report["results"]:
        curve = {int(k): v for k, v in r["cost_curve"].items()}
        if curve:
            ns = sorted(curve)
            ax1.plot(ns, [curve[n] / curve[1] for n in ns], marker="o", label=r["name"])
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("new tokens in one forward")
    ax1.set_ylabel("time relative to 1 token")
    ax1.set_title("Forward cost curve (verification cost)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    names = [r["name"] for r in report["results"]]
    ax2.barh(names, [r["tokens_per_second"] for r in report["results"]], color="tab:blue")
    ax2.set_xlabel("tokens/s (greedy, batch 1)")
    ax2.set_title(f"Plain decoding, {report['model']}")
    ax2.invert_yaxis()
    stamp_machine(fig, report.get("machine"))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
