"""Bench configs (`configs/bench/*.yaml`): the schema, checked whole before any work.

Unknown keys are errors; model configs and overrides, backend names, TP sizes against head
counts, prompt + new tokens against n_positions and hardware names are all checked here, so a
run never fails late on something its config already said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from plugins.bench import roofline
from plugins.core.config import CONFIGS_DIR, ConfigError, arch, check_tp, load_model_config, model_names, read_yaml
from plugins.core.tensors import resolve_dtype
from plugins.core.tokenizer import WORKLOADS
from plugins.engine.registry import BACKENDS, backend_class

BENCH_DIR = CONFIGS_DIR / "bench"
REFERENCE = "hf"  # the backend (at tp_size 1) every other one is checked against


@dataclass(frozen=True)
class ModelEntry:
    label: str
    config: str                      # a name in configs/models/ (or a YAML path)
    overrides: dict = field(default_factory=dict)   # single keys replaced, e.g. {multi_query: false}

    def hf_config(self):
        return load_model_config(self.config, **self.overrides)


@dataclass(frozen=True)
class BackendEntry:
    label: str
    name: str                        # a key of plugins.backend.BACKENDS
    tp_size: int = 1
    options: dict = field(default_factory=dict)     # passed to load_backend as keyword arguments
    dtype: str | None = None         # this row's dtype; None: the config's


@dataclass(frozen=True)
class BenchConfig:
    models: tuple
    backends: tuple
    batch_sizes: tuple
    prompt_lengths: tuple
    new_tokens: int
    dtype: str = "float32"
    warmup: int = 1
    cycles: int = 3
    seed: int = 0
    logit_batch: int = 4             # sequences per row whose full logits are compared with HF
    workload: str = "code"           # prompts: "code" windows, or "edit" (plugins.core.tokenizer.edit_prompt_ids)
    checkpoint_dir: str = "checkpoints"
    project: tuple = ()              # hardware names: an analytical projection appended to results.md
    project_models: tuple = ("starcoder-15b",)
    project_context: int = 2048
    project_batches: tuple = (1, 64)
    perplexity: dict | None = None   # {windows, length}: held-out perplexity per backend (plugins.train)
    name: str = ""


_MODEL_KEYS = {"config", "label", "overrides"}
_BACKEND_KEYS = {"name", "tp_size", "label", "options", "dtype"}
_PERPLEXITY_KEYS = {"windows", "length"}
_BENCH_KEYS = {f.name for f in fields(BenchConfig)} - {"name"}


def _positive_ints(key, value, allow_zero=False) -> tuple:
    values = value if isinstance(value, list) else [value]
    lo = 0 if allow_zero else 1
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < lo for v in values):
        raise ConfigError(f"{key} must be {'a non-negative' if allow_zero else 'a positive'} integer "
                          f"or a list of them, got {value!r}")
    return tuple(values)


def _positive_int(key, value, allow_zero=False) -> int:
    if isinstance(value, list):
        raise ConfigError(f"{key} must be one integer, got the list {value!r}")
    return _positive_ints(key, value, allow_zero)[0]


# Labels name files and directories (checkpoints/<model label>-seed<seed>, profile traces): plain names only.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_BACKEND_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+ -]*")


def _label(kind: str, value, pattern) -> str:
    label = str(value)
    if not pattern.fullmatch(label) or ".." in label:
        raise ConfigError(f"{kind} label {label!r} is not a plain name (letters, digits, '.', '_', '+', '-'"
                          f"{', spaces' if pattern is _BACKEND_LABEL else ''}; no path separators)")
    return label


def _names(key, value) -> tuple:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{key} must be a name or a list of names, got {value!r}")
    return tuple(values)


def _choice(key: str, value, allowed: tuple) -> str:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _check_keys(raw: dict, allowed: set, where: str, hint: str = "") -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}{hint}")


def _model_entry(raw) -> ModelEntry:
    if isinstance(raw, str):
        return ModelEntry(label=_label("model", Path(raw).stem, _LABEL), config=raw)
    if not isinstance(raw, dict) or "config" not in raw:
        raise ConfigError(f"a models entry is a config name or a mapping with 'config', got {raw!r}")
    _check_keys(raw, _MODEL_KEYS, "models entry")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"models entry {raw['config']!r}: overrides must be a mapping")
    return ModelEntry(label=_label("model", raw.get("label") or Path(raw["config"]).stem, _LABEL),
                      config=raw["config"], overrides=dict(overrides))


def _backend_entry(raw) -> BackendEntry:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError(f"a backends entry is a backend name or a mapping with 'name', got {raw!r}")
    _check_keys(raw, _BACKEND_KEYS, f"backends entry {raw['name']!r}", " (backend options go under 'options')")
    name = raw["name"]
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    tp = _positive_ints("tp_size", raw.get("tp_size", 1))
    if len(tp) != 1:
        raise ConfigError(f"backends entry {name!r}: tp_size is one integer")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"backends entry {name!r}: options must be a mapping")
    label = raw.get("label") or (name if tp[0] == 1 else f"{name} tp{tp[0]}")
    dtype = raw.get("dtype")
    if dtype is not None:
        resolve_dtype(str(dtype))
    return BackendEntry(label=_label("backend", label, _BACKEND_LABEL), name=name, tp_size=tp[0],
                        options=dict(options), dtype=None if dtype is None else str(dtype))


def draft_model(options: dict) -> str | None:
    """The model config a `speculative.draft` option names (resolved to its checkpoint by the grid),
    or None when it is "int8" / "int4" or a path the backend reads itself."""
    spec = options.get("speculative")
    draft = spec.get("draft") if isinstance(spec, dict) else None
    if not isinstance(draft, str) or draft in ("int8", "int4") or Path(draft).is_dir():
        return None
    return draft if draft in model_names() or Path(draft).suffix in (".yaml", ".yml") else None


def _perplexity(raw) -> dict | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"perplexity must be a mapping {{windows: N, length: T}}, got {raw!r}")
    _check_keys(raw, _PERPLEXITY_KEYS, "perplexity")
    out = {"windows": _positive_int("perplexity windows", raw.get("windows", 8)),
           "length": _positive_int("perplexity length", raw.get("length", 256))}
    if out["length"] < 2:
        raise ConfigError("perplexity length must be >= 2 (one predicted token at least)")
    return out


def parse_bench_config(raw: dict, name: str = "") -> BenchConfig:
    """Validate everything a run needs before any work: unknown keys, shapes, backends, TP sizes."""
    if not isinstance(raw, dict):
        raise ConfigError("a bench config is a mapping of keys to values")
    _check_keys(raw, _BENCH_KEYS, f"bench config {name}")
    missing = sorted({"models", "backends", "batch_sizes", "prompt_lengths", "new_tokens"} - set(raw))
    if missing:
        raise ConfigError(f"bench config {name}: missing key(s) {', '.join(missing)}")
    models = tuple(_model_entry(m) for m in (raw["models"] if isinstance(raw["models"], list) else [raw["models"]]))
    backends = tuple(_backend_entry(b) for b in (raw["backends"] if isinstance(raw["backends"], list)
                                                 else [raw["backends"]]))
    for kind, labels in (("model", [m.label for m in models]), ("backend", [b.label for b in backends])):
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ConfigError(f"duplicate {kind} label(s) {', '.join(dup)}: give each entry its own 'label'")
    if not any(b.name == REFERENCE and b.tp_size == 1 for b in backends):
        raise ConfigError(f"backends must include {REFERENCE!r} (tp_size 1): it is the reference for correctness")
    if not models:
        raise ConfigError("models is empty")
    cfg = BenchConfig(
        models=models, backends=backends,
        batch_sizes=_positive_ints("batch_sizes", raw["batch_sizes"]),
        prompt_lengths=_positive_ints("prompt_lengths", raw["prompt_lengths"]),
        new_tokens=_positive_int("new_tokens", raw["new_tokens"]),
        dtype=str(raw.get("dtype", "float32")),
        warmup=_positive_int("warmup", raw.get("warmup", 1), allow_zero=True),
        cycles=_positive_int("cycles", raw.get("cycles", 3)),
        seed=_positive_int("seed", raw.get("seed", 0), allow_zero=True),
        logit_batch=_positive_int("logit_batch", raw.get("logit_batch", 4)),
        workload=_choice("workload", raw.get("workload", "code"), WORKLOADS),
        checkpoint_dir=str(raw.get("checkpoint_dir", "checkpoints")),
        project=_names("project", raw.get("project", [])),
        project_models=_names("project_models", raw.get("project_models", ["starcoder-15b"])),
        project_context=_positive_int("project_context", raw.get("project_context", 2048)),
        project_batches=_positive_ints("project_batches", raw.get("project_batches", [1, 64])),
        perplexity=_perplexity(raw.get("perplexity")),
        name=name,
    )
    if cfg.new_tokens < 2:
        raise ConfigError("new_tokens must be >= 2 (one prefill token, then timed decode steps)")
    resolve_dtype(cfg.dtype)
    longest = max(cfg.prompt_lengths)
    for m in cfg.models:
        config = m.hf_config()  # ConfigError for an unknown config or override
        n_positions = arch(config).n_positions
        if longest + cfg.new_tokens > n_positions:
            raise ConfigError(f"model {m.label}: prompt length {longest} + new_tokens {cfg.new_tokens} "
                              f"exceeds n_positions {n_positions}")
        if cfg.perplexity and cfg.perplexity["length"] > n_positions:
            raise ConfigError(f"model {m.label}: perplexity length {cfg.perplexity['length']} exceeds "
                              f"n_positions {n_positions}")
        for b in cfg.backends:
            check_tp(config, b.tp_size)
            try:
                cls = backend_class(b.name)
            except Exception:  # a backend whose library does not import: the run records it as skipped
                continue
            options = b.options
            draft = draft_model(options)
            if draft is not None:  # its checkpoint is made by the grid: check the config, not a directory
                if load_model_config(draft).vocab_size != config.vocab_size:
                    raise ConfigError(f"model {m.label}, backend {b.label}: draft {draft} has another vocab_size")
                options = {**options, "speculative": {**options["speculative"], "draft": "int8"}}
            try:
                cls.check_options(config, b.tp_size, **options)
            except ConfigError as e:
                raise ConfigError(f"model {m.label}, backend {b.label}: {e}") from None
    for hw in cfg.project:
        roofline.read_hardware_spec(hw)
    for m in cfg.project_models:
        load_model_config(m)
    return cfg


def load_bench_config(name_or_path: str | Path) -> BenchConfig:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"bench config file {str(path)!r} not found")
    else:
        path = BENCH_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in BENCH_DIR.glob("*.yaml")))
            raise ConfigError(f"unknown bench config {str(name_or_path)!r}; known: {known}")
    return parse_bench_config(read_yaml(path), name=path.stem)


