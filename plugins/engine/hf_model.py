"""What engines whose model is an HF causal LM share (the HF baseline, DeepSpeed's injected module):
`HFDecoder` drives the model on a transformers `Cache`, `PoolDecoder` serves a continuous batch on
a `SingleHeadCache` pool, and `HFModelBackend` is the engine around them."""

from __future__ import annotations

import torch
from transformers import DynamicCache, GPTBigCodeForCausalLM

from plugins.core.arch import arch
from plugins.core.tensors import position_ids, tensor_bytes
from plugins.engine.backend import LocalBackend
from plugins.engine.kv_cache import SharedPrefix, SingleHeadCache


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

    def verify(self, tokens, attention_mask, position_ids):
        """The server's speculative verify: `forward_tokens` (an engine may batch it otherwise)."""
        return self.forward_tokens(tokens, attention_mask, position_ids)

    def rollback(self, n: int) -> None:
        if n:
            self.cache.crop(-n)

    def kv_cache_bytes(self) -> int:
        layers = getattr(self.cache, "layers", [])
        return tensor_bytes(t for layer in layers for t in (layer.keys, layer.values) if t is not None)


class PoolDecoder:
    """A `BatchDecoder` (plugins.engine.contract) on a `SingleHeadCache` of `slots` rows ([rows, kv heads,
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
        self.fuses_chunks = hasattr(self.step, "mixed")  # decode + prompt chunks in one forward

    def _cache(self, batch: int, length: int) -> SingleHeadCache:
        b = self.backend
        return SingleHeadCache(b.config, length, batch=batch, dtype=b.dtype, device=b.device, tp_size=b.tp_size)

    def pool_tensors(self):
        return [t for kv in self.full for t in kv]

    def prefill_alone(self, input_ids, prefix=None):
        p = input_ids.shape[1]
        mask = torch.ones_like(input_ids)
        pos = position_ids(mask)
        # HF's own cache of a sliding-window model keeps only the window's columns; the pool needs them all
        if prefix is None and arch(self.backend.config).sliding_window is None:
            scratch = self.backend.decoder(1, p)
            logits = scratch.prefill(input_ids, mask, pos)
        else:
            n = 0 if prefix is None else prefix[0].shape[2]
            scratch = self.make_step(self._chunk_cache(p, prefix))
            logits = scratch.prefill(input_ids[:, n:], mask, pos[:, n:])
        return logits, [t[:, :, :p] for layer in scratch.cache.layers for t in (layer.keys, layer.values)]

    def _chunk_cache(self, end: int, prefix):
        """A one-row cache of `end` columns holding `prefix` (the K and V of the first columns)."""
        cache = self._cache(1, end)
        if prefix is not None:
            n = prefix[0].shape[2]
            for layer, keys, values in zip(cache.layers, prefix[0::2], prefix[1::2]):
                layer.keys[:, :, :n].copy_(keys)
                layer.values[:, :, :n].copy_(values)
                layer.length = n
        return cache

    def _rows(self, n: int, t: int) -> None:
        for layer, (keys, values) in zip(self.cache.layers, self.full):
            layer.keys, layer.values, layer.length = keys[:n], values[:n], t

    def decode(self, tokens, attention_mask, position_ids):
        self._rows(tokens.shape[0], attention_mask.shape[1] - 1)
        return self.step.decode(tokens, attention_mask, position_ids)

    def verify(self, tokens, attention_mask, position_ids):
        """Rows [0, n) with several new tokens each [n, w] written at columns t .. t + w - 1 (t = mask
        width - w; masked columns are padding): logits of every token [n, w, V] (speculative decoding)."""
        self._rows(tokens.shape[0], attention_mask.shape[1] - tokens.shape[1])
        return self.step.verify(tokens, attention_mask, position_ids)

    def mixed(self, tokens, attention_mask, position_ids, chunks):
        """`decode` and prompt chunks in one forward (where `fuses_chunks`): `chunks` a list of (prompt
        ids [1, end], K and V of its first columns, a `SharedPrefix` or None) as `prefill_alone` takes
        them; returns (decode logits [n, V], per chunk (logits of its last token [1, V], its K and V:
        `end` columns))."""
        self._rows(tokens.shape[0], attention_mask.shape[1] - 1)
        parts, shared = [], {}
        for i, (ids, prefix) in enumerate(chunks):
            if isinstance(prefix, SharedPrefix):
                shared[i], done, prefix = prefix, prefix.columns, None
            else:
                done = 0 if prefix is None else prefix[0].shape[2]
            positions = torch.arange(done, ids.shape[1], device=ids.device)[None]
            parts.append((self._chunk_cache(ids.shape[1], prefix), ids[:, done:], positions))
        logits, last = self.step.mixed(tokens, attention_mask, position_ids, parts, shared)
        return logits, [(chunk_logits, [t[:, :, :ids.shape[1]] for layer in cache.layers
                                        for t in (layer.keys, layer.values)])
                        for chunk_logits, (cache, _, _), (ids, _) in zip(last, parts, chunks)]


class HFModelBackend(LocalBackend):
    """An engine whose model is an HF causal LM (HF itself; DeepSpeed's injected module): logits,
    the shared generate loop on `HFDecoder`, and continuous batching on `PoolDecoder`."""

    def __init__(self, model: GPTBigCodeForCausalLM, dtype: torch.dtype, device: str = "cpu", tp_size: int = 1):
        self.model = model
        self.config = model.config
        self.dtype = dtype
        self.device = device
        self.tp_size = tp_size

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
