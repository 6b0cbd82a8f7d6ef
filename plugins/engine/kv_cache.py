"""The KV cache of the injected layers: preallocated, written by index, one KV head for MQA.

It is a transformers `Cache`, so HF `generate` and `GPTBigCodeModel.forward` read positions and
mask sizes from it as from their own. Each layer holds `keys` / `values` of shape
[batch, kv_heads, capacity, head_dim] (kv_heads = 1 for MQA) allocated once; `update` copies the
new tokens into the next free slots and returns views of the filled prefix. Nothing is
concatenated and K/V are never expanded to all query heads (attention broadcasts the one head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from plugins.core.config import arch, head_dim, kv_heads_per_rank


class SingleHeadLayer(CacheLayerMixin):
    """One layer's preallocated K/V. `capacity` tokens; allocated on first `update` (or `allocate`)."""

    is_sliding = False
    is_compileable = False
    keys: torch.Tensor      # allocated by `allocate` before any read
    values: torch.Tensor

    def __init__(self, capacity: int, **kwargs):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def allocate(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        shape = (batch, kv_heads, self.capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        self.allocate(batch, kv_heads, head_dim, key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [batch, kv_heads, new, head_dim] -> views of all cached [.., length, ..]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} tokens > capacity {self.capacity} "
                             f"(size it with max_out_tokens / SingleHeadCache(max_length=...))")
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0  # the buffers stay; stale slots are overwritten before they are read

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.device)))
            self.values.copy_(self.values.index_select(0, beam_idx.to(self.device)))

    def crop(self, max_length: int) -> None:
        self.length = max_length if max_length >= 0 else self.length + max_length


class SingleHeadCache(Cache):
    """A `Cache` of `SingleHeadLayer`s sized for `max_length` tokens (prompt + new tokens).

    Pass it to HF: `model(..., cache=SingleHeadCache(config, max_length))` or
    `model.generate(..., cache=SingleHeadCache(config, max_length))`. With `batch` and `dtype` given,
    the buffers are allocated here, before the first forward: per rank of `tp_size`, one KV head
    (MQA, replicated) or n_head / tp_size heads (MHA).
    """

    # only ours, built in __init__ (the base class types any layer)
    layers: list[SingleHeadLayer]  # type: ignore[assignment]

    def __init__(self, config, max_length: int, batch: int | None = None, dtype: torch.dtype | None = None,
                 device="cpu", tp_size: int = 1):
        shape = arch(config)
        if max_length > shape.n_positions:
            raise ValueError(f"max_length {max_length} exceeds n_positions {shape.n_positions}")
        super().__init__(layers=[SingleHeadLayer(max_length) for _ in range(shape.n_layer)])
        if batch is not None and dtype is not None:
            for layer in self.layers:
                layer.allocate(batch, kv_heads_per_rank(config, tp_size), head_dim(config), dtype, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))


@dataclass(frozen=True)
class SharedPrefix:
    """A prompt chunk's start in a forward of several (`BatchDecoder.mixed`): the first `columns` K and V
    of chunk `chunk` (an earlier one of the same forward), copied layer by layer as that chunk has
    computed them; so prompts sharing a prefix that no cache holds yet compute it once."""

    chunk: int
    columns: int


@dataclass
class SegmentLayer:
    """One layer's caches for a forward of several sequences packed on one token axis (`Segments`)."""

    pool: SingleHeadLayer
    rows: int
    chunks: list[tuple[SingleHeadLayer, int]]
    shared: dict[int, SharedPrefix]

    def start(self, i: int) -> None:
        """Before chunk i's attention: the columns it takes from an earlier chunk's layer, now computed."""
        prefix = self.shared.get(i)
        if prefix is not None:
            layer, source = self.chunks[i][0], self.chunks[prefix.chunk][0]
            layer.keys[:, :, :prefix.columns].copy_(source.keys[:, :, :prefix.columns])
            layer.values[:, :, :prefix.columns].copy_(source.values[:, :, :prefix.columns])
            layer.length = prefix.columns


@dataclass
class Segments:
    """The caches of one forward whose tokens [1, rows + chunk tokens] are one new token for each of
    the pool's first `rows` rows, then each prompt chunk's tokens (its one-row cache, its length).
    Layers run their linears over all tokens at once and attend per segment on its own cache; chunk i
    in `shared` starts from an earlier chunk's first columns (`SharedPrefix`)."""

    pool: SingleHeadCache
    rows: int
    chunks: list[tuple[SingleHeadCache, int]]
    shared: dict[int, SharedPrefix] = field(default_factory=dict)

    def layer(self, i: int) -> SegmentLayer:
        return SegmentLayer(self.pool.layers[i], self.rows, [(cache.layers[i], n) for cache, n in self.chunks],
                            self.shared)


def layer_cache(cache, layer_idx: int, capacity: int) -> SingleHeadLayer | SegmentLayer | None:
    """This layer's `SingleHeadLayer` in whatever `Cache` HF passed (None: no cache, a plain forward).

    HF `generate` creates its default `DynamicCache` before any layer runs. At prefill the injected
    layer swaps that cache's entry for a `SingleHeadLayer` of `capacity` tokens (DeepSpeed's
    `max_out_tokens`, its own KV-workspace size), so HF's default path also never concatenates.
    """
    if cache is None:
        return None
    if isinstance(cache, Segments):
        return cache.layer(layer_idx)
    if not isinstance(cache, Cache):
        raise TypeError(f"the injected gpt_bigcode layer needs a transformers Cache, got {type(cache).__name__}")
    layers = cache.layers
    while len(layers) <= layer_idx:  # caches built with layer_class_to_replicate grow lazily
        layers.append(SingleHeadLayer(capacity))
    layer = layers[layer_idx]
    if not isinstance(layer, SingleHeadLayer):
        if cache.get_seq_length(layer_idx) != 0:
            raise ValueError("cannot take over a cache that already holds tokens from another layer type")
        layer = layers[layer_idx] = SingleHeadLayer(capacity)
    return layer
