"""The Hugging Face baseline: `GPTBigCodeForCausalLM` as transformers ships it (SDPA, DynamicCache)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache, GPTBigCodeForCausalLM

from injection import SingleHeadCache

from plugins.core.backend import GenerationResult, LocalBackend, check_load, position_ids, resolve_dtype, tensor_bytes
from plugins.core.checkpoint import load_hf_model, read_hf_config
from plugins.core.generation import Sampler, generate


class HFDecoder:
    """Drives any HF causal LM whose forward takes (input_ids, attention_mask, position_ids, cache)."""

    def __init__(self, model, cache=None):
        self.model = model
        self.cache = cache if cache is not None else DynamicCache(config=model.config)

    def _forward(self, input_ids, attention_mask, position_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def prefill(self, input_ids, attention_mask, position_ids):
        return self._forward(input_ids, attention_mask, position_ids)

    def decode(self, tokens, attention_mask, position_ids):
        return self._forward(tokens, attention_mask, position_ids)

    def forward_tokens(self, tokens, attention_mask, position_ids):
        """Logits for every given token [B, n, V] (speculative verification)."""
        return self.model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                          cache=self.cache, use_cache=True).logits

    def rollback(self, n: int) -> None:
        if n:
            self.cache.crop(-n)

    def kv_cache_bytes(self) -> int:
        layers = getattr(self.cache, "layers", [])
        return tensor_bytes(t for layer in layers for t in (layer.keys, layer.values) if t is not None)


class PoolDecoder:
    """A `plugins.core.batching.BatchDecoder` on a `SingleHeadCache` of `slots` rows ([rows, kv heads,
    columns, head dim] per layer): before each step the cache layers are pointed at the active rows
    [0, n) and the shared length t (views, no copies). `make_step(cache)` is the backend's decoder on a
    cache. A prompt is prefilled by the backend's own batch-1 decoder, or, after a prefix-cache hit,
    by `make_step` on a one-row cache that starts with the reused prefix."""

    batch_dim, time_dim = 0, 2

    def __init__(self, backend, slots: int, capacity: int, make_step):
        self.backend, self.make_step = backend, make_step
        self.cache = self._cache(slots, capacity)
        self.step = make_step(self.cache)
        self.full = [(layer.keys, layer.values) for layer in self.cache.layers]

    def _cache(self, batch: int, length: int) -> SingleHeadCache:
        b = self.backend
        return SingleHeadCache(b.config, length, batch=batch, dtype=b.dtype, device=b.device, tp_size=b.tp_size)

    def pool_tensors(self):
        return [t for kv in self.full for t in kv]

    def prefill_alone(self, input_ids, prefix=None):
        p = input_ids.shape[1]
        mask = torch.ones_like(input_ids)
        pos = position_ids(mask)
        if prefix is None:
            scratch = self.backend.decoder(1, p)
            logits = scratch.prefill(input_ids, mask, pos)
        else:
            n = prefix[0].shape[2]
            cache = self._cache(1, p)
            for layer, keys, values in zip(cache.layers, prefix[0::2], prefix[1::2]):
                layer.keys[:, :, :n].copy_(keys)
                layer.values[:, :, :n].copy_(values)
                layer.length = n
            scratch = self.make_step(cache)
            logits = scratch.prefill(input_ids[:, n:], mask, pos[:, n:])
        return logits, [t[:, :, :p] for layer in scratch.cache.layers for t in (layer.keys, layer.values)]

    def decode(self, tokens, attention_mask, position_ids):
        n, t = tokens.shape[0], attention_mask.shape[1] - 1
        for layer, (keys, values) in zip(self.cache.layers, self.full):
            layer.keys, layer.values, layer.length = keys[:n], values[:n], t
        return self.step.decode(tokens, attention_mask, position_ids)


class HFBackend(LocalBackend):
    name = "hf"

    def __init__(self, model: GPTBigCodeForCausalLM, dtype: torch.dtype, device: str = "cpu", tp_size: int = 1):
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.device = device
        self.tp_size = tp_size

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, device: str | None = None):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(dtype, device)
        config = read_hf_config(hf_dir)
        check_load(config, tp_size, max_tp=1)
        return cls(load_hf_model(hf_dir, dtype, config=config).to(device), dtype, device)

    @torch.inference_mode()
    def logits(self, input_ids, attention_mask):
        input_ids, attention_mask = self._prepare(input_ids, attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask), use_cache=False)
        return out.logits.float().cpu()

    def decoder(self, batch: int, max_length: int) -> HFDecoder:
        """A decoder for `batch` sequences of up to `max_length` cached tokens (HF's cache grows as needed)."""
        return HFDecoder(self.model)

    def batch_decoder(self, slots: int, capacity: int) -> PoolDecoder:
        return PoolDecoder(self, slots, capacity, lambda cache: HFDecoder(self.model, cache))

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0) -> GenerationResult:
        input_ids, attention_mask = self._prepare(input_ids, attention_mask, max_new_tokens)
        sampler = Sampler(do_sample, temperature, top_k, top_p, seed)
        # the last new token is sampled, never fed back: T + N - 1 tokens are ever cached
        decoder = self.decoder(input_ids.shape[0], input_ids.shape[1] + max(max_new_tokens - 1, 0))
        result = generate(decoder, input_ids, attention_mask, max_new_tokens, sampler)
        result.tokens = result.tokens.cpu()
        return result

    def close(self) -> None:
        pass
