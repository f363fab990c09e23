"""Single-thread CPU time per generated token of transformers, llama.cpp and tandem (robust to a busy host).

Usage: .venv/bin/python scripts/cpu_time_per_token.py {hf,llamacpp,tandem}   (TANDEM_KERNELS=torch for torch's kernels)
"""
import time, torch, sys
torch.set_num_threads(1)
N = 48
prompt = "Explain in detail how photosynthesis works in plants."
which = sys.argv[1]
if which == "hf":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tandem.model.catalogue import resolve_model
    src = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(src.hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    gen = dict(do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        model.generate(ids, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        t = time.thread_time(); model.generate(ids, **gen); dt = time.thread_time() - t
elif which == "llamacpp":
    from llama_cpp import Llama
    from tandem.model.catalogue import resolve_model
    llm = Llama(model_path=str(resolve_model("smollm2-135m-instruct").gguf_path), n_ctx=512, n_threads=1, verbose=False)
    eos = llm.token_eos()
    def no_eos(_ids, logits):
        logits[eos] = -float("inf"); return logits
    llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=4, temperature=0.0)
    t = time.process_time()
    llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=N, temperature=0.0, logits_processor=[no_eos])
    dt = time.process_time() - t
else:
    import os
    from tandem.llm import LLM
    from tandem.config import SamplingParams
    llm = LLM("smollm2-135m-instruct", threads=1, max_num_seqs=1)
    p = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), chat=True)
    t = time.thread_time(); llm.generate(prompt, p, chat=True); dt = time.thread_time() - t
print(f"{which}{' ' + os.environ.get('TANDEM_KERNELS', '') if which == 'tandem' else ''}: {dt / N * 1e3:.1f} ms CPU per token (incl. prefill), {N / dt:.1f} tok/s-equivalent")
