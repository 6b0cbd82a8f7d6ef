"""Engines, kernels and tools for multi-query-attention code models (HF gpt_bigcode: SantaCoder,
StarCoder) on DeepSpeed-Inference and megatron-core.

  plugins.core       foundations: paths, model configs, HF checkpoint I/O, atomic writes, tokenizer
                     and prompts, tensors (dtypes, input checks, KV byte math)
  plugins.kernels    the CPU linear ladder (measured choice, compiled kernels) and quantization
  plugins.engine     the engine contract, the registry, sampling, generate loop, speculative decoding
  plugins.serving    KV pool, prefix cache, the continuous batch, the request scheduler
  plugins.launch       the launcher: an engine's ranks in worker processes (torchrun / deepspeed)
  plugins.hf         the Hugging Face baseline engine
  plugins.deepspeed  DeepSpeed kernel injection (our policy: injection/) and AutoTP
  plugins.megatron   megatron-core GPTModel
  plugins.peers      CTranslate2 and llama.cpp, each in a worker process of its own
  plugins.train      training, the checkpoint maker
  plugins.bench      bench configs, machine probes, the comparison grid, reports, roofline
  plugins.http      the OpenAI-compatible HTTP server

The everyday entry points are importable from here, e.g. `from plugins import load_backend`.
"""

import importlib

_API = {
    "load_backend": "plugins.engine.registry",
    "Backend": "plugins.engine.contract",
    "GenerationResult": "plugins.engine.contract",
    "ConfigError": "plugins.core.config",
    "load_model_config": "plugins.core.config",
    "create_checkpoint": "plugins.core.checkpoint",
    "load_hf_model": "plugins.core.checkpoint",
    "load_tokenizer": "plugins.core.tokenizer",
    "make_batch": "plugins.core.tokenizer",
}
__all__ = sorted(_API)


def __getattr__(name):  # lazy: `import plugins.kernels` does not pay for transformers
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'plugins' has no attribute {name!r}")
