"""Model configs: `configs/models/<name>.yaml` -> `transformers.GPTBigCodeConfig` or, for a file with
`model_type: starcoder2`, `transformers.Starcoder2Config` (each family's file uses its HF names).

A config file names only the architecture; everything else takes the HF config's defaults
(tied embeddings, scaled attention, fp32 softmax). Unknown keys are an error, so a typo never
silently falls back to a default. Three keys are not HF's: `model_type:` (the family, default
gpt_bigcode), `train:` (the model is trained here, `load_train_spec`; gpt_bigcode only) and
`tokenizer:` (a name from plugins.core.tokenizer.TOKENIZERS, default the project's 49152-token one;
`load_tokenizer_name`). What a config's shape is, whatever its family: `plugins.core.arch`.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import yaml
from transformers import GPTBigCodeConfig, Starcoder2Config

from plugins.core.arch import (NAMES, arch, family, head_dim, hf_shapes, kv_heads,  # noqa: F401 (re-exported)
                               kv_heads_per_rank)
from plugins.core.errors import ConfigError
from plugins.core.paths import (CONFIGS_DIR, DEFAULT_TOKENIZER, MODELS_DIR, REPO_ROOT,  # noqa: F401 (re-exported)
                                TOKENIZERS)

# HF activation names that are the tanh approximation of GELU (what gpt_bigcode uses)
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
# Where the KV cache of a TP group lives: "head" splits it by KV head (MQA's one head replicated on
# every rank), "batch" gives each rank every KV head of B / TP sequences (injection.kv_shard).
KV_LAYOUTS = ("head", "batch")


@dataclass(frozen=True)
class ModelSpec:
    model_type = "gpt_bigcode"  # the family (a class attribute, not a key)

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


@dataclass(frozen=True)
class Starcoder2Spec:
    """A `model_type: starcoder2` config file, in Starcoder2Config's own names (bigcode/starcoder2-*)."""
    model_type = "starcoder2"

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    sliding_window: int | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self):
        check_hf_config(self.to_hf(), "model config")

    def to_hf(self) -> Starcoder2Config:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_theta"}
        theta = self.rope_theta
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ConfigError(f"model config: rope_theta must be a positive number, got {theta!r}")
        try:
            return Starcoder2Config(**values, rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
                                    use_bias=True, bos_token_id=0, eos_token_id=0,  # <|endoftext|>
                                    # inference only: dropouts off so every backend computes the same function
                                    attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0)
        except Exception as e:  # transformers' strict field types
            raise ConfigError(f"model config: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


SPECS = {spec.model_type: spec for spec in (ModelSpec, Starcoder2Spec)}


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


def load_spec(name_or_path: str | Path, **overrides) -> ModelSpec | Starcoder2Spec:
    """Read a model config by name (`tiny`) or path; `overrides` replace single keys."""
    path = _model_file(name_or_path)
    raw = read_yaml(path)
    kind = raw.pop("model_type", "gpt_bigcode")
    if kind not in SPECS:
        raise ConfigError(f"{path.name}: unknown model_type {kind!r}; known: {', '.join(SPECS)}")
    train = _train_section(path, raw)
    if train is not None and kind != "gpt_bigcode":
        raise ConfigError(f"{path.name}: train: is for gpt_bigcode models (plugins.train), not {kind}")
    tokenizer = _tokenizer_key(path, raw)
    raw.update(overrides)
    cls = SPECS[kind]
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{path.name}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    missing = sorted(f.name for f in fields(cls) if f.name not in raw and f.default is MISSING)
    if missing:
        raise ConfigError(f"{path.name}: missing key(s) {', '.join(missing)}")
    spec = cls(**raw)
    size = TOKENIZERS[tokenizer][1]
    if size > spec.vocab_size:
        raise ConfigError(f"{path.name}: tokenizer {tokenizer} has {size} tokens but vocab_size is "
                          f"{spec.vocab_size}: token ids would index past the embedding")
    n_positions = arch(spec.to_hf()).n_positions
    if train is not None and train.seq_len > n_positions:
        raise ConfigError(f"{path.name}: train seq_len {train.seq_len} exceeds n_positions {n_positions}")
    if train is not None and train.seq_len < n_positions:  # learned positions past seq_len stay random
        raise ConfigError(f"{path.name}: train seq_len {train.seq_len} is shorter than n_positions "
                          f"{n_positions}: the position embeddings past it would never be trained")
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


def load_model_config(name_or_path: str | Path, **overrides) -> GPTBigCodeConfig | Starcoder2Config:
    return load_spec(name_or_path, **overrides).to_hf()


def check_tp(config, tp_size: int) -> None:
    """The one tensor-parallel check: every rank holds whole query heads, and KV heads are either
    split evenly over the ranks or replicated on groups of ranks."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    n_head = arch(config).n_head
    if n_head % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide n_head {n_head}: "
                          "each rank must hold a whole number of query heads")
    groups = kv_heads(config)
    if n_head % groups:
        raise ConfigError(f"{groups} KV heads do not divide n_head {n_head}")
    if groups % tp_size and tp_size % groups:
        raise ConfigError(f"tp_size {tp_size} and {groups} KV heads: one must divide the other")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_hf_config(config, where: str = "config") -> None:
    """A loaded config of either family (from any file) describes a model this project can build:
    one ConfigError naming the field (in the family's own names), before any tensor is allocated."""
    names = NAMES[family(config)]
    for field in ("n_layer", "hidden", "n_head", "vocab_size", "n_positions"):
        value = getattr(config, names[field], None)
        if not _positive_int(value):
            raise ConfigError(f"{where}: {names[field]} must be a positive integer, got {value!r}")
    hidden, n_head = getattr(config, names["hidden"]), getattr(config, names["n_head"])
    if hidden % n_head:
        raise ConfigError(f"{where}: {names['hidden']} ({hidden}) is not divisible by {names['n_head']} ({n_head})")
    inner = getattr(config, names["inner"], None)
    if inner is not None and not _positive_int(inner):
        raise ConfigError(f"{where}: {names['inner']} must be null or a positive integer, got {inner!r}")
    eps = getattr(config, names["eps"], None)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ConfigError(f"{where}: {names['eps']} must be a number in (0, 1), got {eps!r}")
    act = getattr(config, names["activation"], None)
    if not isinstance(act, str):
        raise ConfigError(f"{where}: {names['activation']} must be a name, got {act!r}")
    groups = kv_heads(config)
    if not _positive_int(groups) or n_head % groups:
        raise ConfigError(f"{where}: {groups!r} KV heads do not divide {names['n_head']} {n_head}")
    if family(config) == "starcoder2":
        _check_starcoder2(config, where, hidden // n_head)


def _check_starcoder2(config, where: str, head_size: int) -> None:
    """What only StarCoder2 configs carry: RoPE, the window, biases, the head size."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta")
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_type {rope.get('rope_type')!r}: only default RoPE is served here")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    window = getattr(config, "sliding_window", None)
    if window is not None and not _positive_int(window):
        raise ConfigError(f"{where}: sliding_window must be null or a positive integer, got {window!r}")
    if getattr(config, "use_bias", True) is not True:
        raise ConfigError(f"{where}: use_bias false: only StarCoder2's biased linears are served here")
    own = getattr(config, "head_dim", None)
    if own is not None and own != head_size:
        raise ConfigError(f"{where}: head_dim {own} is not hidden_size / num_attention_heads ({head_size})")


_BYTE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def byte_size(text: str) -> int:
    """'512MB', '2GiB', '1.5G' or a plain number of bytes (binary units); an argparse type."""
    import argparse

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])
