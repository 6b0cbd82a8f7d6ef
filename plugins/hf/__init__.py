"""The Hugging Face baseline engine: `GPTBigCodeForCausalLM` as transformers ships it, behind the
Backend contract (its decoders are shared with DeepSpeed: plugins.engine.hf_model)."""

from plugins.hf.backend import HFBackend

__all__ = ["HFBackend"]
