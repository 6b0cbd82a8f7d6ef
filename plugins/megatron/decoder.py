"""A `plugins.generation` decoder on megatron-core's `StaticInferenceContext`.

megatron-core's inference engines are CUDA-only; its model and KV cache are not. The context
preallocates, per layer, K and V of shape [max_seq, max_batch, kv_heads_per_rank, head_dim]
(one KV head for MQA) on the first forward; we advance `sequence_len_offset` ourselves.
Left padding is handled by an explicit boolean mask (True = masked) on every call and by the
position ids the generation loop hands us. A sliding window (StarCoder2) is part of that mask: a query
sees the keys less than `window` positions before it; RoPE is told each column's position
(plugins/megatron/rope.py).
"""

from __future__ import annotations

import torch

from plugins.core.config import ConfigError, arch, head_dim, kv_heads_per_rank
from plugins.core.tensors import beyond_window as too_far
from plugins.core.tensors import position_ids, tensor_bytes
from plugins.megatron.rope import PositionedRotary


def causal_padding_mask(attention_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, T] (1 = token) -> bool [B, 1, T, T], True where a query must not look.

    Every position may see itself, so padding rows are never fully masked (their softmax would
    be NaN, and NaN values leak through zero attention weights into real rows).
    """
    t = attention_mask.shape[1]
    future = torch.ones((t, t), dtype=torch.bool, device=attention_mask.device).triu(1)
    masked = future[None, None] | ~attention_mask.bool()[:, None, None, :]
    far = too_far(attention_mask, t, window)
    if far is not None:
        masked = masked | far
    return masked & ~torch.eye(t, dtype=torch.bool, device=attention_mask.device)


def decode_mask(attention_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, S] -> bool [B, 1, 1, S] for one new token per row at the last column: padding (and keys past
    the window) masked."""
    masked = ~attention_mask.bool()[:, None, None, :]
    far = too_far(attention_mask, 1, window)
    return masked if far is None else masked | far


def place_rows(model, attention_mask: torch.Tensor) -> None:
    """Tell a RoPE model the positions of every column of the next forward (plugins/megatron/rope.py)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if isinstance(rotary, PositionedRotary):
        rotary.set_columns(attention_mask)


class MegatronDecoder:
    def __init__(self, model, batch_size: int, max_len: int, vocab_size: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.vocab_size = vocab_size  # the model's vocabulary is padded; padding columns are dropped
        self.window = getattr(model, "window", None)
        self.ctx = StaticInferenceContext(batch_size, max_len)

    def _forward(self, tokens, mask, position_ids, columns):
        """`columns`: the [B, S] 0/1 mask of every column the forward reads (cache and new tokens)."""
        place_rows(self.model, columns)
        logits = self.model(tokens, position_ids, mask, inference_context=self.ctx, runtime_gather_output=True)
        self.ctx.sequence_len_offset += tokens.shape[1]
        return logits[:, -1, : self.vocab_size]

    def prefill(self, input_ids, attention_mask, position_ids):
        self.ctx.reset()
        logits = self._forward(input_ids, causal_padding_mask(attention_mask, self.window), position_ids,
                               attention_mask)
        self.ctx.enable_decode_mode()
        return logits

    def decode(self, tokens, attention_mask, position_ids):
        # One query per row: only the padding columns of the cache (and those past the window) are masked.
        return self._forward(tokens, decode_mask(attention_mask, self.window), position_ids, attention_mask)

    def kv_cache_bytes(self) -> int:
        return tensor_bytes(t for kv in self.ctx.key_value_memory_dict.values() for t in kv)


class MegatronPoolDecoder:
    """A `plugins.serving.batching.BatchDecoder` on one `StaticInferenceContext` of `slots` rows: megatron
    writes and reads rows [batch_size_offset, + batch) of its [seq, batch, groups, dim] buffers, so the
    active rows [0, n) decode as a batch of n; the pool is allocated here, before any forward."""

    batch_dim, time_dim = 1, 0
    fuses_chunks = False  # a chunk is a forward of its own

    def __init__(self, backend, slots: int, capacity: int):
        self.backend = backend
        self.step = MegatronDecoder(backend.model, slots, capacity, backend.config.vocab_size)
        ctx, config = self.step.ctx, backend.config
        shape = (capacity, slots, kv_heads_per_rank(config, backend.tp_size), head_dim(config))
        for layer in range(1, arch(config).n_layer + 1):  # megatron numbers layers from 1
            ctx.key_value_memory_dict[layer] = tuple(torch.zeros(shape, dtype=backend.dtype, device=backend.device)
                                                     for _ in range(2))
        ctx.enable_decode_mode()

    def pool_tensors(self):
        return [t for layer in sorted(self.step.ctx.key_value_memory_dict)
                for t in self.step.ctx.key_value_memory_dict[layer]]

    def prefill_alone(self, input_ids, prefix=None):
        p = input_ids.shape[1]
        scratch = self.backend.decoder(1, p)
        mask = torch.ones_like(input_ids)
        pos = position_ids(mask)
        if prefix is None:
            logits = scratch.prefill(input_ids, mask, pos)
        else:  # the context starts with the reused prefix; the rest of the prompt attends to it
            n = prefix[0].shape[0]
            kv = scratch.ctx.key_value_memory_dict
            for layer, keys, values in zip(range(1, len(prefix) // 2 + 1), prefix[0::2], prefix[1::2]):
                kv[layer] = tuple(torch.zeros((p, *t.shape[1:]), dtype=t.dtype, device=t.device)
                                  for t in (keys, values))
                kv[layer][0][:n].copy_(keys)
                kv[layer][1][:n].copy_(values)
            scratch.ctx.sequence_len_offset = n
            masked = torch.ones((p, p), dtype=torch.bool, device=input_ids.device).triu(1)[None, None, n:]
            far = too_far(mask, p - n, scratch.window)
            logits = scratch._forward(input_ids[:, n:], masked if far is None else masked | far, pos[:, n:], mask)
        kv = scratch.ctx.key_value_memory_dict
        return logits, [t[:p] for layer in sorted(kv) for t in kv[layer]]

    def decode(self, tokens, attention_mask, position_ids):
        self.step.ctx.sequence_len_offset = attention_mask.shape[1] - 1
        return self.step.decode(tokens, attention_mask, position_ids)

    def verify(self, tokens, attention_mask, position_ids):
        raise ConfigError("speculative decoding runs on the deepspeed backend only")

    def mixed(self, tokens, attention_mask, position_ids, chunks):
        raise ConfigError("megatron runs each prompt chunk as a forward of its own (fuses_chunks is False)")
