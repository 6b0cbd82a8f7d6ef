"""The Hugging Face baseline engine: `GPTBigCodeForCausalLM` as transformers ships it, behind the
Backend protocol; `HFDecoder`, which drives any HF causal LM on a transformers `Cache`; and
`PoolDecoder`, continuous batching on a `SingleHeadCache` pool."""

from .backend import HFBackend, HFDecoder, PoolDecoder

__all__ = ["HFBackend", "HFDecoder", "PoolDecoder"]
