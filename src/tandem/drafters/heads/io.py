"""Build, save and load draft heads: one directory per trained head.

Layout: head.json (format, method, the target's name and shapes, hidden layers, draft vocab size,
the module's config_dict and a free-form training record) + head.safetensors (the trained
parameters only: tied target parts are filled from the target at load, and a 16-row embedding
signature of the target is stored so a head loaded against another target is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tandem.drafters.heads.base import DraftHead, TargetParts, head_class, head_methods
from tandem.paths import cache_root, shipped_drafter_dir, save_safetensors

FORMAT = "tandem-draft-head"
VERSION = 1
CONFIG_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"
SIGNATURE_KEY = "__target_signature__"
# Minimum cosine similarity between the recorded and the actual target embedding rows: quantised
# copies of one model agree to > 0.999; unrelated or retrained models fall far below.
SIGNATURE_MIN_COSINE = 0.98


def with_article(method: str) -> str:
    """A method's name with its article, as a message reads it: 'an eagle3 head', 'a medusa head'."""
    return ("an " if method[:1] in "aeiou" else "a ") + method


def shipped_head_dir(model_name: str, method: str) -> Path | None:
    """The head tandem ships for a built-in model and method (drafters/shipped/<model>/<method>),
    None when there is none: a trained-head drafter without --speculative-draft-model-path uses it."""
    return shipped_drafter_dir(model_name, method, CONFIG_FILE)


def build_head(method: str, target: TargetParts, **options) -> DraftHead:
    """A fresh, trainable head of `method` for `target` (options: the method's constructor args)."""
    head = head_class(method).build(target, **options)
    _attach_target(head, target)
    return head


def _attach_target(head: DraftHead, target: TargetParts, signature: torch.Tensor | None = None) -> None:
    # Plain attributes, not submodules: the target's parts are never part of the head's state.
    head.target_parts = target
    head.target_config = target.config
    head.target_signature = target.signature() if signature is None else signature


# The target shapes a head (or a training run) fits only, as its record states them.
TARGET_SHAPES = ("vocab_size", "hidden_size", "num_layers")


def target_record(cfg, target_name: str) -> dict:
    """The target a head is trained for: its name, model type and shapes (head.json's "target",
    a training checkpoint's)."""
    return {"model_name": target_name, "model_type": cfg.model_type,
            **{k: getattr(cfg, k) for k in TARGET_SHAPES}}


def shape_differences(record: dict, cfg) -> list[str]:
    """How the target of a record differs in shape from the ModelConfig `cfg` ([] if it fits)."""
    return [f"{k} {record[k]} vs {getattr(cfg, k)}" for k in TARGET_SHAPES if record[k] != getattr(cfg, k)]


def save_head(head: DraftHead, out_dir: str | Path, target_name: str, extra_record: dict | None = None,
              dtype: torch.dtype = torch.float32, tokenizer=None) -> Path:
    """Write `head` to out_dir (created); returns the directory.

    dtype: float tensors are stored in it (bfloat16 halves a shipped file; loading upcasts).
    tokenizer: written alongside for heads exported as standalone models (draft_model).
    """
    if not hasattr(head, "target_signature"):
        raise ValueError("save_head needs a head made by build_head or load_head (they record the target)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu().contiguous()
        for name, t in head.state_dict().items()
    }
    tensors[SIGNATURE_KEY] = head.target_signature.float().contiguous()
    record = {
        "format": FORMAT,
        "version": VERSION,
        "method": head.method,
        "target": target_record(head.target_config, target_name),
        "hidden_layers": list(head.hidden_layers),
        "serving_layers": list(head.serving_layers),
        "draft_vocab_size": head.draft_vocab_size,
        "config": head.config_dict(),
        "record": extra_record or {},
    }
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_safetensors(tensors, tmp)
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    head.export(out, target_name, tokenizer, dtype)
    return out


def read_head_config(path: str | Path) -> dict:
    """The head.json of a head directory (or the file itself), validated."""
    p = Path(path)
    cfg_path = p / CONFIG_FILE if p.is_dir() else p
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"no trained draft head at {path}: expected a directory with {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(made by `tandem train` or save_head)"
        )
    try:
        record = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{cfg_path} is not a draft head's {CONFIG_FILE} (not JSON: {err}); give the head's "
                         "directory, as `tandem train --out` wrote it") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise ValueError(f"{cfg_path} is not a tandem draft head (format {found!r})")
    if record.get("version", 0) > VERSION:
        raise ValueError(f"{cfg_path} has format version {record['version']}; this tandem reads up to {VERSION}: upgrade tandem")
    if record.get("method") not in head_methods():
        raise ValueError(f"{cfg_path}: unknown method {record.get('method')!r}; available: {', '.join(head_methods())}")
    return record


def check_target(record: dict, target: TargetParts, where: str) -> None:
    """Refuse a head trained for another target, saying which one it was trained for."""
    check_target_shapes(record, target.config, target.model_name, where)


def check_target_shapes(record: dict, cfg, model_name: str, where: str) -> None:
    """check_target from the target's ModelConfig alone (its shapes; no weights loaded)."""
    want = record["target"]
    diffs = shape_differences(want, cfg)
    if diffs:
        raise ValueError(
            f"the {record['method']} head at {where} was trained for target {want['model_name']!r}, not for "
            f"{model_name or 'this target'} ({'; '.join(diffs)}). Serve it with --model {want['model_name']}, "
            f"or train a head for this target: tandem train --target {model_name or 'MODEL'} "
            f"--method {record['method']}"
        )


def _check_signature(record: dict, recorded: torch.Tensor, target: TargetParts, where: str) -> None:
    actual = target.signature()
    cos = torch.nn.functional.cosine_similarity(recorded.float(), actual.float(), dim=-1)
    if float(cos.min()) < SIGNATURE_MIN_COSINE:
        want = record["target"]["model_name"]
        raise ValueError(
            f"the {record['method']} head at {where} was trained for target {want!r}; "
            f"{target.model_name or 'this target'} has the same shapes but different weights (embedding "
            f"similarity {float(cos.min()):.3f}). Serve it with --model {want}, or train a head for this "
            f"target: tandem train --target {target.model_name or 'MODEL'} --method {record['method']}"
        )


def load_head(path: str | Path, target: TargetParts, device: str | torch.device = "cpu") -> DraftHead:
    """The head saved at `path`, checked against `target`, in float32 eval mode on `device`."""
    record = read_head_config(path)
    where = str(path)
    check_target(record, target, where)
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, SafetensorError) as err:
        raise ValueError(f"{directory / WEIGHTS_FILE} cannot be read ({err}): the file is damaged or incomplete; "
                         "copy or train the head again") from None
    signature = tensors.pop(SIGNATURE_KEY, None)
    if signature is None:
        raise ValueError(f"{directory / WEIGHTS_FILE} has no target signature: re-save the head with save_head")
    _check_signature(record, signature, target, where)
    cls = head_class(record["method"])
    head = cls.from_config(record["config"], target)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not match {with_article(record['method'])} head of config "
            f"{record['config']}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    _attach_target(head, target, signature)
    head.record = record
    return head.to(device).eval()


# ---- serving a head directory: the model directory made on first use ------------------------------


def is_head_dir(path: str | Path) -> bool:
    """Whether `path` is a saved draft head (head.json) rather than a model directory."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and not (p / "config.json").is_file()


def materialize_draft_model(head_dir: str | Path, target) -> Path:
    """The loadable model directory of a draft_model head directory that holds the trained layers
    only (as tandem ships them): the target's embedding (and LM head) are copied in from the
    serving target (`target`: a drafters.base.TargetInfo) and the export is cached under
    $TANDEM_CACHE_DIR/drafters, keyed by the head's weights, so it is made once.

    The head's target signature is checked first: a head trained for another model is refused.
    """
    record = read_head_config(head_dir)
    if record["method"] != "draft_model":
        raise ValueError(f"{head_dir} holds {with_article(record['method'])} head; the draft_model drafter serves "
                         f"draft_model heads or model directories (use --speculative-algorithm {record['method']})")
    digest = hashlib.sha256(Path(head_dir, WEIGHTS_FILE).read_bytes()).hexdigest()[:16]
    out = cache_root() / "drafters" / f"{target.model_name or 'target'}-draft_model-{digest}"
    if (out / "config.json").is_file():
        return out
    parts = target.parts
    if parts is None:
        raise ValueError("serving a draft_model head needs the target's parts (TargetInfo.of a loaded target)")
    cfg = parts.config
    with torch.no_grad():
        embed = parts.embed(torch.arange(cfg.vocab_size)).float().cpu()
        # An untied LM head is read back through the serving head: lm_head(I) = W^T.
        lm_head = embed if cfg.tie_word_embeddings else parts.lm_head(torch.eye(cfg.hidden_size)).float().cpu().T
    parts = dataclasses.replace(parts, embed_weight=embed, lm_head_weight=lm_head.contiguous())
    head = load_head(head_dir, parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        head.export(tmp, target.model_name, target.tokenizer, torch.float32)
        try:
            tmp.rename(out)
        except OSError:  # another process made it first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
