"""Trained checkpoints made on first use: a model config with a `train:` section becomes
`checkpoints/<name>-trained/` once, and is reused while its config, train section and tokenizer are
unchanged."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from plugins.core.checkpoint import WEIGHTS_NAME
from plugins.core.config import ConfigError, load_model_config, load_tokenizer_name, load_train_spec
from plugins.train.loop import LOG_FILE, TOKENIZER_NAME, tokenizer_id, train

ARCH_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "multi_query", "n_inner")
# Effective training FLOP/s on 2 CPU cores (measured: ~200 G bf16 with avx512_bf16, ~40 G fp32), for the
# announcement only; slower machines take proportionally longer.
ROUGH_FLOPS = {"bf16": 150e9, "fp32": 40e9}


def is_trained(dst: Path, config, spec, tokenizer: str) -> bool:
    """`dst` holds a finished run of exactly this architecture, train section and tokenizer (by content)."""
    import hashlib

    try:
        saved = json.loads((dst / "config.json").read_text())
        log = json.loads((dst / LOG_FILE).read_text())
        own = hashlib.sha256((dst / TOKENIZER_NAME).read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    want = config.to_dict()
    return ((dst / WEIGHTS_NAME).is_file() and all(saved.get(k) == want.get(k) for k in ARCH_KEYS)
            and log.get("spec") == asdict(spec) and log.get("tokenizer") == tokenizer_id(tokenizer)
            and own == log["tokenizer"]["sha256"])


def estimate_minutes(config, spec) -> float:
    h, v, n = config.n_embd, config.vocab_size, config.n_layer
    params = v * h + n * 12 * h * h  # the tied LM head, then attention + MLP per layer
    return 6 * params * spec.steps * spec.batch * spec.seq_len / ROUGH_FLOPS[spec.precision] / 60


def ensure_trained(name_or_path: str | Path, dst: str | Path, progress: bool = True, **overrides) -> Path:
    """The trained checkpoint of a model config with a `train:` section, trained now if `dst` does not
    hold it (an interrupted run resumes from `<dst>.state`)."""
    from plugins.core.console import announce

    config = load_model_config(name_or_path, **overrides)
    spec = load_train_spec(name_or_path, **overrides)
    if spec is None:
        raise ConfigError(f"model config {str(name_or_path)!r} has no train section: it has seeded weights only")
    tokenizer = load_tokenizer_name(name_or_path, **overrides)
    dst = Path(dst)
    if is_trained(dst, config, spec, tokenizer):
        return dst
    label = Path(str(name_or_path)).stem
    announce(f"training {label} (~{max(1, round(estimate_minutes(config, spec)))} min, once) into {dst}...")
    train(config, spec, dst, name=label, force=dst.exists(), progress=progress, tokenizer=tokenizer)
    return dst
