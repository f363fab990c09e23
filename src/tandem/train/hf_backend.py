"""The transformers backend of `tandem train`'s data stages: self-distillation and capture on a GPU.

tandem's engine is built for decoding on a CPU, one attention call per sequence; on a GPU a single
padded `generate` over hundreds of prompts is what keeps the chip busy. This backend runs the
target through transformers (float32, the same weights tandem serves: a GGUF is dequantised once)
and writes exactly the caches `distill` and `capture` write (same records, same shards, same
resume), so training, evaluation and `--resume` do not know which backend made them.

Greedy answers only: seeded per-prompt sampling is the engine's (data.distill).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.llm import chat_token_ids
from tandem.model.loader import float_checkpoint
from tandem.train.capture import Sequence, write_captures
from tandem.train.data import DistillConfig, answer_prompts

log = logging.getLogger("tandem.train")


def load_hf_target(name: str, device: str, dtype: torch.dtype = torch.float32):
    """(transformers causal LM on `device` in eval mode, its tokenizer) for a tandem model name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: ~1 s to import, the transformers backend only

    hf_dir = float_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(str(hf_dir))


def encode_chat(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A user prompt -> token ids, through the chat template when asked and the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None) is not None:
        return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def distill_hf(model, tokenizer, eos_ids: set[int], prompts: list[str], directory: str | Path, cfg: DistillConfig,
               batch_size: int = 256, max_model_len: int = 1024, deadline: float | None = None) -> list[dict]:
    """`data.distill` through batched greedy `generate`: prompts of similar length are answered
    together (left-padded); each answer ends after its first EOS id (kept, as the engine keeps it)
    or at max_new_tokens."""
    from transformers import GenerationConfig  # lazy: ~1 s to import, the transformers backend only

    if cfg.temperature != 0:
        raise ValueError("the transformers backend answers greedily only; sample with --backend tandem")
    if not eos_ids:
        raise ValueError("the target declares no EOS token; answers would never stop")
    device = next(model.parameters()).device
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else min(eos_ids)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=False, eos_token_id=sorted(eos_ids),
                           pad_token_id=pad)

    @torch.no_grad()
    def answer(prompts_ids: list[list[int]], _texts: list[str]) -> list[tuple[list[int], str]]:
        T = max(map(len, prompts_ids))
        ids = torch.full((len(prompts_ids), T), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts_ids), T, dtype=torch.long)
        for b, p in enumerate(prompts_ids):
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        results = []
        for row in out[:, T:].tolist():
            stop = next((i for i, tok in enumerate(row) if tok in eos_ids), None)
            if stop is not None:
                results.append((row[: stop + 1], "stop"))
            else:
                results.append((row[: cfg.max_new_tokens], "length"))
        return results

    return answer_prompts(prompts, directory, cfg, answer, lambda p: encode_chat(tokenizer, p, cfg.chat),
                          max_model_len, batch_size, by_length=True, deadline=deadline)


def capture_hf(model, target_name: str, seqs: list[Sequence], directory: str | Path, layers: tuple[int, ...],
               shard_size: int = 64, batch_size: int = 32, store_dtype: torch.dtype = torch.bfloat16,
               desc: str = "capture") -> list[Path]:
    """`capture.capture` through the transformers model."""
    return write_captures(target_name, len(model.model.layers), hf_forward_factory(model), seqs, directory, layers,
                          shard_size, batch_size, store_dtype, desc)


def hf_forward_factory(model):
    """forward_factory (see capture.write_captures) running the transformers model: forward hooks read
    the outputs of the wanted decoder layers, and of the final norm for layer L (tandem's layer
    convention)."""
    base = model.model
    decoder, norm = base.layers, base.norm
    L = len(decoder)
    device = next(model.parameters()).device

    def forward_factory(_max_len: int):
        @torch.no_grad()
        def forward(group: list[Sequence], wanted: tuple[int, ...]) -> dict[int, list[torch.Tensor]]:
            lens = [len(s.token_ids) for s in group]
            T = max(lens)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            mask = torch.zeros(len(group), T, dtype=torch.long)
            for b, s in enumerate(group):  # right-padded: padding never precedes a real token
                ids[b, : lens[b]] = torch.tensor(s.token_ids)
                mask[b, : lens[b]] = 1
            seen: dict[int, torch.Tensor] = {}

            def keep(layer: int):
                def hook(_module, _inputs, output):
                    seen[layer] = output[0] if isinstance(output, tuple) else output
                return hook

            hooks = [(norm if layer == L else decoder[layer]).register_forward_hook(keep(layer)) for layer in wanted]
            try:
                base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            finally:
                for h in hooks:
                    h.remove()
            return {layer: [seen[layer][b, :n] for b, n in enumerate(lens)] for layer in wanted}

        return forward

    return forward_factory
