"""Model configs: `configs/models/<name>.yaml` -> `transformers.GPTBigCodeConfig`.

A config file names only the architecture; everything else takes GPTBigCodeConfig's defaults
(tied embeddings, scaled attention, fp32 softmax). Unknown keys are an error, so a typo never
silently falls back to a default. Two keys are not HF's: `train:` (the model is trained here,
`load_train_spec`) and `tokenizer:` (a name from plugins.core.tokenizer.TOKENIZERS, default the
project's 49152-token one; `load_tokenizer_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from transformers import GPTBigCodeConfig

from plugins.core.paths import (CONFIGS_DIR, DEFAULT_TOKENIZER, MODELS_DIR, REPO_ROOT,  # noqa: F401 (re-exported)
                                TOKENIZERS)

# HF activation names that are the tanh approximation of GELU (what gpt_bigcode uses)
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
# Where the KV cache of a TP group lives: "head" splits it by KV head (MQA's one head replicated on
# every rank), "batch" gives each rank every KV head of B / TP sequences (injection.kv_shard).
KV_LAYOUTS = ("head", "batch")


class ConfigError(ValueError):
    """A config file or a requested setting is invalid."""


@dataclass(frozen=True)
class ModelSpec:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int
    multi_query: bool = True
    activation_function: str = "gelu_pytorch_tanh"
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self):
        check_hf_config(self, "model config")

    def to_hf(self) -> GPTBigCodeConfig:
        return GPTBigCodeConfig(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            vocab_size=self.vocab_size,
            n_positions=self.n_positions,
            multi_query=self.multi_query,
            activation_function=self.activation_function,
            layer_norm_epsilon=self.layer_norm_epsilon,
            n_inner=self.n_inner,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=0,  # <|endoftext|> in configs/tokenizer
            eos_token_id=0,
            # Inference only: dropouts off so every backend computes the same function.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )


_SPEC_KEYS = {f.name for f in fields(ModelSpec)}


@dataclass(frozen=True)
class TrainSpec:
    """The `train:` section of a model config: a config with one is trained (plugins.train), not seeded."""
    steps: int
    seq_len: int
    batch: int
    lr: float
    warmup: int = 0
    seed: int = 0
    min_lr_ratio: float = 0.1     # cosine decay ends at lr * this
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "bf16"       # bf16 autocast (fp32 master weights) or plain fp32
    checkpoint_every: int = 100   # steps between resumable training states
    eval_windows: int = 32        # held-out windows of seq_len for the held-out loss

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch", "warmup", "seed", "checkpoint_every", "eval_windows"):
            value = getattr(self, name)
            least = 0 if name in ("warmup", "seed") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"train: {name} must be an integer >= {least}, got {value!r}")
        for name, lo, hi in (("lr", 0, 1), ("min_lr_ratio", 0, 1), ("weight_decay", 0, 1), ("grad_clip", 0, 1e6)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
                raise ConfigError(f"train: {name} must be a number in [{lo}, {hi:g}], got {value!r}")
        if self.lr == 0:
            raise ConfigError("train: lr must be > 0")
        if self.precision not in ("bf16", "fp32"):
            raise ConfigError(f"train: precision must be bf16 or fp32, got {self.precision!r}")
        if self.warmup > self.steps:
            raise ConfigError(f"train: warmup ({self.warmup}) exceeds steps ({self.steps})")


_TRAIN_KEYS = {f.name for f in fields(TrainSpec)}


def read_yaml(path: Path) -> dict:
    """A YAML file that must hold a mapping (empty file: {}); anything else is one ConfigError."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    return raw


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def _model_file(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = MODELS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model config {str(name_or_path)!r}; known: {', '.join(model_names())}")
    return path


def _train_section(path: Path, raw: dict) -> TrainSpec | None:
    train = raw.pop("train", None)
    if train is None:
        return None
    if not isinstance(train, dict):
        raise ConfigError(f"{path.name}: train must be a mapping")
    unknown = sorted(set(train) - _TRAIN_KEYS)
    if unknown:
        raise ConfigError(f"{path.name}: unknown train key(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(sorted(_TRAIN_KEYS))}")
    missing = sorted({"steps", "seq_len", "batch", "lr"} - set(train))
    if missing:
        raise ConfigError(f"{path.name}: train needs {', '.join(missing)}")
    try:
        return TrainSpec(**train)
    except ConfigError as e:
        raise ConfigError(f"{path.name}: {e}") from None


def _tokenizer_key(path: Path, raw: dict) -> str:
    name = raw.pop("tokenizer", DEFAULT_TOKENIZER)
    if name not in TOKENIZERS:
        raise ConfigError(f"{path.name}: unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")
    return name


def load_spec(name_or_path: str | Path, **overrides) -> ModelSpec:
    """Read a model config by name (`tiny`) or path; `overrides` replace single keys."""
    path = _model_file(name_or_path)
    raw = read_yaml(path)
    train = _train_section(path, raw)
    tokenizer = _tokenizer_key(path, raw)
    raw.update(overrides)
    unknown = sorted(set(raw) - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"{path.name}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_SPEC_KEYS))}")
    spec = ModelSpec(**raw)
    size = TOKENIZERS[tokenizer][1]
    if size > spec.vocab_size:
        raise ConfigError(f"{path.name}: tokenizer {tokenizer} has {size} tokens but vocab_size is "
                          f"{spec.vocab_size}: token ids would index past the embedding")
    if train is not None and train.seq_len > spec.n_positions:
        raise ConfigError(f"{path.name}: train seq_len {train.seq_len} exceeds n_positions {spec.n_positions}")
    if train is not None and train.seq_len < spec.n_positions:  # learned positions past seq_len stay random
        raise ConfigError(f"{path.name}: train seq_len {train.seq_len} is shorter than n_positions "
                          f"{spec.n_positions}: the position embeddings past it would never be trained")
    return spec


def load_train_spec(name_or_path: str | Path, **overrides) -> TrainSpec | None:
    """The `train:` section of a model config (validated with the model), or None: seeded weights."""
    load_spec(name_or_path, **overrides)
    path = _model_file(name_or_path)
    return _train_section(path, read_yaml(path))


def load_tokenizer_name(name_or_path: str | Path, **overrides) -> str:
    """The tokenizer a model config is built for (validated with the model)."""
    load_spec(name_or_path, **overrides)
    path = _model_file(name_or_path)
    return _tokenizer_key(path, read_yaml(path))


def load_model_config(name_or_path: str | Path, **overrides) -> GPTBigCodeConfig:
    return load_spec(name_or_path, **overrides).to_hf()


def kv_heads(config: GPTBigCodeConfig) -> int:
    """KV heads of the whole model: 1 (MQA), n_head (MHA), or `num_query_groups` for the GQA configs
    the converters make (Megatron formats only: HF gpt_bigcode implements MQA and MHA)."""
    return getattr(config, "num_query_groups", None) or (1 if config.multi_query else config.n_head)


def kv_heads_per_rank(config: GPTBigCodeConfig, tp_size: int = 1) -> int:
    """KV heads one TP rank holds: its share, or the whole head(s) replicated when there are fewer
    KV heads than ranks (MQA: the one head on every rank)."""
    return max(1, kv_heads(config) // tp_size)


def head_dim(config: GPTBigCodeConfig) -> int:
    return config.n_embd // config.n_head


def check_tp(config: GPTBigCodeConfig, tp_size: int) -> None:
    """The one tensor-parallel check: every rank holds whole query heads, and KV heads are either
    split evenly over the ranks or replicated on groups of ranks."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    if config.n_head % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide n_head {config.n_head}: "
                          "each rank must hold a whole number of query heads")
    groups = kv_heads(config)
    if config.n_head % groups:
        raise ConfigError(f"{groups} KV heads do not divide n_head {config.n_head}")
    if groups % tp_size and tp_size % groups:
        raise ConfigError(f"tp_size {tp_size} and {groups} KV heads: one must divide the other")


def check_hf_config(config: GPTBigCodeConfig, where: str = "config") -> None:
    """A loaded config (from any file) describes a model this project can build: one ConfigError
    naming the field, before any tensor is allocated."""
    for name in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    if config.n_embd % config.n_head:
        raise ConfigError(f"{where}: n_embd ({config.n_embd}) is not divisible by n_head ({config.n_head})")
    inner = config.n_inner
    if inner is not None and (not isinstance(inner, int) or isinstance(inner, bool) or inner <= 0):
        raise ConfigError(f"{where}: n_inner must be null or a positive integer, got {inner!r}")
    eps = config.layer_norm_epsilon
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ConfigError(f"{where}: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
    if not isinstance(config.activation_function, str):
        raise ConfigError(f"{where}: activation_function must be a name, got {config.activation_function!r}")
    groups = kv_heads(config)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0 or config.n_head % groups:
        raise ConfigError(f"{where}: {groups!r} KV heads do not divide n_head {config.n_head}")


def hf_shapes(config: GPTBigCodeConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the HF model (HF names; lm_head only when untied)."""
    h, d, g = config.n_embd, config.n_embd // config.n_head, kv_heads(config)
    inner = config.n_inner or 4 * h
    shapes = {"transformer.wte.weight": (config.vocab_size, h), "transformer.wpe.weight": (config.n_positions, h)}
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
            p + "attn.c_attn.weight": (h + 2 * g * d, h), p + "attn.c_attn.bias": (h + 2 * g * d,),
            p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
            p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
            p + "mlp.c_fc.weight": (inner, h), p + "mlp.c_fc.bias": (inner,),
            p + "mlp.c_proj.weight": (h, inner), p + "mlp.c_proj.bias": (h,),
        })
    shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes




_BYTE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def byte_size(text: str) -> int:
    """'512MB', '2GiB', '1.5G' or a plain number of bytes (binary units); an argparse type."""
    import argparse

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])
