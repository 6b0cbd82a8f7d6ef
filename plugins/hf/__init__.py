"""The Hugging Face baseline engine: `GPTBigCodeForCausalLM` as transformers ships it, behind the
Backend protocol, and `HFDecoder`, which drives any HF causal LM on a transformers `Cache`."""

from .backend import HFBackend, HFDecoder

__all__ = ["HFBackend", "HFDecoder"]
