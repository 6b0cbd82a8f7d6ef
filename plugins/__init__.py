"""Engines, kernels and tools for multi-query-attention code models (HF gpt_bigcode: SantaCoder,
StarCoder) on DeepSpeed-Inference and megatron-core.

  plugins.core       the Backend protocol and its checks, dtypes, model configs, HF checkpoint I/O,
                     tokenizer and prompts, generation loop and sampler, speculative loop, launcher
  plugins.kernels    the CPU linear ladder (ISA probe, compiled kernels) and int8 quantization
  plugins.hf         the Hugging Face baseline engine
  plugins.deepspeed  DeepSpeed kernel injection (our policy: injection/) and AutoTP
  plugins.megatron   megatron-core GPTModel
  plugins.bench      bench configs, machine probes, the comparison grid, reports, roofline

The everyday entry points are importable from here, e.g. `from plugins import load_backend`.
"""

import importlib

_API = {
    "load_backend": "plugins.core.backend",
    "Backend": "plugins.core.backend",
    "GenerationResult": "plugins.core.backend",
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
