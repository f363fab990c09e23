"""The transformers side of `tandem bench spec`: `generate` plain, with prompt lookup, and assisted
generation with a smaller same-tokenizer model when one exists, on tandem's fp32 float copy."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.bench.spec import HF_ASSISTED, HF_PLD, PLAIN, Run, RunConfig
from tandem.model.catalogue import BUILTIN_MODELS, resolve_model
from tandem.model.loader import _ensure_gguf_metadata, float_checkpoint


def _hf_config(name: str, model, temperature: float, **extra) -> RunConfig:
    """transformers `generate` with the same sampling as tandem's (no top-k/top-p filters);
    `extra` selects prompt lookup or assisted generation."""
    if temperature > 0:
        gen = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen = dict(do_sample=False)
    gen.update(extra, pad_token_id=_hf_pad_id(model))

    def run(prompt_ids: list[int], max_new: int, seed: int) -> Run:
        ids = torch.tensor([prompt_ids])
        torch.manual_seed(seed)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, **gen)
            seconds = time.perf_counter() - t
        return Run([int(x) for x in out[0, ids.shape[1]:]], seconds)

    return RunConfig(name, run)


def _hf_pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else int(eos)


@dataclass
class Baselines:
    """The transformers side: its model, prompt-lookup length, and an assistant model for
    assisted generation (None, with the reason, when there is none)."""

    model: object
    pld_tokens: int = 10
    assistant: object = None
    assistant_name: str | None = None
    assistant_reason: str = ""

    def configs(self, temperature: float) -> list[RunConfig]:
        configs = [_hf_config(PLAIN, self.model, temperature),
                   _hf_config(HF_PLD, self.model, temperature, prompt_lookup_num_tokens=self.pld_tokens)]
        if self.assistant is not None:
            configs.append(_hf_config(HF_ASSISTED, self.model, temperature, assistant_model=self.assistant))
        return configs

    def describe(self) -> dict:
        assisted = {"model": self.assistant_name, "applicable": self.assistant is not None}
        if self.assistant is not None:
            cfg = self.assistant.generation_config
            assisted.update(num_assistant_tokens=cfg.num_assistant_tokens,
                            num_assistant_tokens_schedule=cfg.num_assistant_tokens_schedule)
        else:
            assisted["reason"] = self.assistant_reason
        return {"dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "prompt_lookup_num_tokens": self.pld_tokens, "assisted": assisted}


def load_transformers(model_name: str):
    """The float copy in tandem's cache (the GGUF dequantised once), fp32, as `bench base` uses."""
    from transformers import AutoModelForCausalLM  # lazy: ~1 s to import, the transformers rows only

    return AutoModelForCausalLM.from_pretrained(str(float_checkpoint(model_name)), dtype=torch.float32).eval()


def _vocab(model_name: str) -> dict[str, int]:
    from transformers import AutoTokenizer  # lazy: ~1 s to import, the transformers rows only

    src = resolve_model(model_name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
    return AutoTokenizer.from_pretrained(str(src.hf_dir)).get_vocab()


def pick_assistant(model_name: str, requested: str) -> tuple[str | None, str]:
    """The assistant for transformers' assisted generation: `requested` if given, or with `auto` a
    built-in model with a smaller GGUF and the target's exact tokenizer. (None, why) if there is none."""
    if requested == "none":
        return None, "disabled with --hf-assistant none"
    if requested != "auto":
        return requested, ""
    if model_name not in BUILTIN_MODELS:
        return None, (f"{model_name} is not a built-in model, so no smaller same-tokenizer model is known; "
                      "pass --hf-assistant PATH")
    size = resolve_model(model_name).gguf_path.stat().st_size
    smaller = [n for n in BUILTIN_MODELS if n != model_name and resolve_model(n).gguf_path.stat().st_size < size]
    if not smaller:
        return None, (f"no built-in model is smaller than {model_name} (the others: "
                      f"{', '.join(n for n in BUILTIN_MODELS if n != model_name)}); assisted generation needs a "
                      "smaller model with the same tokenizer: pass --hf-assistant PATH")
    vocab = _vocab(model_name)
    same = [n for n in smaller if _vocab(n) == vocab]
    if not same:
        return None, (f"the smaller built-in models ({', '.join(smaller)}) use another tokenizer than {model_name}; "
                      "assisted generation needs the same tokenizer: pass --hf-assistant PATH")
    return same[0], ""
