"""Shared by the draft-head tests: a tiny target with confident outputs, training batches made by
running it over random sequences (every layer's hidden states), and a short optimisation loop."""

from __future__ import annotations

import functools

import torch

from conftest import ToyTokenizer, build_tiny
from tandem.drafters.heads.base import TargetParts, TrainBatch
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel
from tandem.model.runner import ModelRunner, SeqInput

# Scales the tiny target's LM head so its next-token distributions are confident (entropy well
# below log V), like a trained model's: a head's loss can then fall far below its start.
HEAD_SCALE = 80.0
NUM_LAYERS = 4


@functools.lru_cache(maxsize=None)
def sharp_target(arch: str = "qwen2", seed: int = 0) -> LoadedModel:
    """A 4-layer tiny model (untied LM head, scaled) wrapped as an engine-ready LoadedModel."""
    _, model = build_tiny(arch, seed, num_hidden_layers=NUM_LAYERS)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return LoadedModel(model, ToyTokenizer(), model.cfg, f"sharp-{arch}-{seed}", torch.float32, "none")


@functools.lru_cache(maxsize=None)
def parts(arch: str = "qwen2", seed: int = 0) -> TargetParts:
    return TargetParts.from_loaded(sharp_target(arch, seed))


@functools.lru_cache(maxsize=None)
def make_batch(arch: str = "qwen2", n: int = 6, length: int = 24, prompt_len: int = 4, seed: int = 0,
               target_seed: int = 0, self_distilled: bool = False) -> TrainBatch:
    """Random sequences (the first rows shorter, so padding is exercised) with every layer's
    hidden states (0..L) from the target; the heads learn the target's distributions on them.
    self_distilled: only the prompt is random, the target answers it greedily (as `tandem
    train`'s data: every answer token is the target's argmax after its prefix)."""
    loaded = sharp_target(arch, target_seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, loaded.config.vocab_size, (length - (b % 3),), generator=g).tolist() for b in range(n)]
    L = loaded.config.num_layers
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, length + 1, torch.float32))
    if self_distilled:
        for s in seqs:
            full = len(s)
            del s[prompt_len:]
            while len(s) < full:
                seq = runner.cache.allocate()
                s.append(int(runner.forward([SeqInput(seq, s)]).logits[-1].argmax()))
                runner.cache.release(seq)
    hidden = {layer: torch.zeros(n, length, loaded.config.hidden_size) for layer in range(L + 1)}
    tokens = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.bool)
    for b, s in enumerate(seqs):
        seq = runner.cache.allocate()
        out = runner.forward([SeqInput(seq, s, logits="all")], tuple(range(L + 1)))
        runner.cache.release(seq)
        for layer in hidden:
            hidden[layer][b, : len(s)] = out.hidden[layer][0].float()
        tokens[b, : len(s)] = torch.tensor(s)
        mask[b, prompt_len - 1 : len(s) - 1] = True  # token t + 1 is an "answer" token
    lengths = torch.tensor([len(s) for s in seqs])
    return TrainBatch(tokens, lengths, mask, hidden)


def train(head, batch: TrainBatch, target: TargetParts, steps: int, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Adam on head.training_loss; the loss before each step."""
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    head.train()
    for _ in range(steps):
        loss, _ = head.training_loss(batch, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.eval()
    return losses


def expected_tau(correct: torch.Tensor) -> float:
    """1 + sum_i mean(prod_{j<=i} correct_j) over draft_accuracy's [N, k] matrix."""
    return 1.0 + float(correct.float().cumprod(dim=1).mean(dim=0).sum())


@functools.lru_cache(maxsize=None)
def hf_tokenizer(vocab_size: int = 97):
    """A saveable Hugging Face tokenizer over the toy ids ("5 17 33" <-> [5, 17, 33]), for
    exported draft models (the loader reads a tokenizer from the model directory)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0", eos_token="2")
