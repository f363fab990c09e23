"""A corpus of the target's own answers for suffix decoding (a datastore, as in REST and
SuffixDecoding's global tree): one directory per corpus.

Layout: corpus.json (format, the target's name and vocabulary size, how many answers and tokens,
and a free-form record of how it was made) + corpus.safetensors (`tokens`: every answer's token
ids end to end, int32; `offsets`: where each answer starts, with the total at the end, int64).
`tandem train --method suffix` writes one from the target's greedy answers to the training
prompts; tandem ships one per built-in chat model (drafters/shipped/<model>/suffix/).

The suffix drafter builds a trie over the answers once per process and depth, and keeps it: it
is only read afterwards (suffix.py). Drafts from it are deterministic token ids like every other
suffix draft, so they change what is proposed, never what is committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.drafters.suffix_trie import SuffixTrie
from tandem.paths import shipped_drafter_dir, save_safetensors

FORMAT = "tandem-suffix-corpus"
VERSION = 1
CONFIG_FILE = "corpus.json"
TOKENS_FILE = "corpus.safetensors"
# The answer tokens a corpus keeps by default: on 30 Spec-Bench prompts (SmolLM2, Zen 5) 200k of
# them raised suffix decoding's tau from 1.59 to 1.77 and all 925k to 1.80, for a trie of 0.44M
# nodes (about 100 MB, built in 1.5 s) against 2.0M (about 450 MB, 8 s).
DEFAULT_CORPUS_TOKENS = 200_000


def shipped_corpus_dir(model_name: str) -> Path | None:
    """The corpus tandem ships for a built-in model (drafters/shipped/<model>/suffix), or None."""
    return shipped_drafter_dir(model_name, "suffix", CONFIG_FILE)


def save_corpus(out: str | Path, answers: list[list[int]], target_name: str, vocab_size: int,
                record: dict | None = None) -> Path:
    """Write the answers (lists of token ids) as a corpus directory for `target_name`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(a) for a in answers], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = torch.tensor([t for a in answers for t in a], dtype=torch.int32)
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise ValueError(f"answer token ids must lie in [0, {vocab_size})")
    save_safetensors({"tokens": tokens, "offsets": offsets}, out / TOKENS_FILE)
    config = {"format": FORMAT, "version": VERSION, "target": {"model_name": target_name, "vocab_size": vocab_size},
              "answers": len(answers), "tokens": int(tokens.numel()), "record": record or {}}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_corpus(path: str | Path, vocab_size: int) -> tuple[dict, list[list[int]]]:
    """(corpus.json, the answers) of a corpus directory; refused for another vocabulary."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.exists():
        raise FileNotFoundError(f"{path} holds no suffix corpus ({CONFIG_FILE}); make one with "
                                "`tandem train --method suffix --out DIR`")
    config = json.loads(config_file.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_file} is not a {FORMAT} (format {config.get('format')!r})")
    if config["target"]["vocab_size"] != vocab_size:
        raise ValueError(f"{path} was made for {config['target']['model_name']} (vocabulary of "
                         f"{config['target']['vocab_size']}), not for a target with {vocab_size} tokens")
    tensors = load_file(str(path / TOKENS_FILE))
    tokens, offsets = tensors["tokens"].tolist(), tensors["offsets"].tolist()
    return config, [tokens[a:b] for a, b in zip(offsets, offsets[1:])]


_tries: dict[tuple[str, int, int], SuffixTrie] = {}


def corpus_trie(path: str | Path, depth: int, vocab_size: int) -> SuffixTrie:
    """The trie of every suffix of the corpus's answers (cut at `depth` tokens), built once per
    process, corpus and depth and shared by every drafter that asks (it is only read)."""
    key = (str(Path(path).resolve()), depth, vocab_size)
    trie = _tries.get(key)
    if trie is None:
        _, answers = read_corpus(path, vocab_size)
        trie = SuffixTrie(depth)
        for answer in answers:
            trie.add(answer)
        trie.freeze()
        _tries[key] = trie
    return trie
