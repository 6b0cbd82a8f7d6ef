"""The Hugging Face baseline: `GPTBigCodeForCausalLM` as transformers ships it (SDPA, DynamicCache)."""

from __future__ import annotations

from pathlib import Path

from plugins.core.checkpoint import load_hf_model, read_hf_config
from plugins.core.tensors import check_load, default_device, resolve_dtype
from plugins.engine.hf_model import HFModelBackend


class HFBackend(HFModelBackend):
    name = "hf"

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, device: str | None = None):
        device = device or default_device()
        dtype = resolve_dtype(dtype, device)
        config = read_hf_config(hf_dir)
        check_load(config, tp_size, max_tp=1)
        return cls(load_hf_model(hf_dir, dtype, config=config).to(device), dtype, device)
