"""Engines by name: the comparison and the server load one with `load_backend` and never import an
engine module; a missing optional library only affects its own backend."""

from __future__ import annotations

import importlib
from pathlib import Path

from plugins.core.config import ConfigError
from plugins.engine.contract import Backend

# name -> "module:class"; imported lazily so a missing optional library only affects its backend.
BACKENDS = {
    "hf": "plugins.hf:HFBackend",
    "deepspeed": "plugins.deepspeed:DeepSpeedBackend",
    "deepspeed-autotp": "plugins.deepspeed:AutoTPBackend",
    "megatron": "plugins.megatron:MegatronGPT",
    "ctranslate2": "plugins.peers.ctranslate2:CTranslate2Backend",
    "llama.cpp": "plugins.peers.llamacpp:LlamaCppBackend",
}


def backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_backend(name: str, hf_dir: str | Path, dtype="float32", tp_size: int = 1, **options) -> Backend:
    """Backend `name` (a key of BACKENDS) on the HF checkpoint `hf_dir`; options are the backend's own."""
    from plugins.core.checkpoint import read_hf_config

    cls = backend_class(name)
    cls.check_options(read_hf_config(hf_dir), tp_size, **options)
    return cls.from_hf(hf_dir, dtype=dtype, tp_size=tp_size, **options)
