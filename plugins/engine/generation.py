"""The generation loop every backend shares: prefill, then one token per step.

A backend supplies a `Decoder` (prefill / decode on its own KV cache); the loop owns sampling,
positions, the attention mask and timing, so all engines sample identically from the same logits
and are timed the same way. Buffers for tokens and mask are allocated once, before the loop.
"""

from __future__ import annotations

import time

import torch

from plugins.core.tensors import position_ids
from plugins.engine.contract import Decoder, GenerationResult
from plugins.engine.sampling import Sampler


@torch.inference_mode()
def generate(decoder: Decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
             sampler: Sampler) -> GenerationResult:
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    device = input_ids.device
    tokens = torch.empty((batch, total), dtype=torch.long, device=device)
    tokens[:, :prompt_len] = input_ids
    mask = torch.ones((batch, total), dtype=attention_mask.dtype, device=device)
    mask[:, :prompt_len] = attention_mask
    if max_new_tokens == 0:
        return GenerationResult(tokens=tokens, prefill_s=0.0)

    start = time.perf_counter()
    pos = position_ids(attention_mask)
    logits = decoder.prefill(input_ids, attention_mask, pos)
    tokens[:, prompt_len] = sampler(logits)
    prefill_s = time.perf_counter() - start

    next_pos = pos[:, -1:] + 1
    step_s = []
    for i in range(prompt_len + 1, total):
        start = time.perf_counter()
        logits = decoder.decode(tokens[:, i - 1:i], mask[:, :i], next_pos)
        tokens[:, i] = sampler(logits)
        next_pos += 1
        step_s.append(time.perf_counter() - start)
    return GenerationResult(tokens=tokens, prefill_s=prefill_s, step_s=step_s,
                            kv_cache_bytes=decoder.kv_cache_bytes())
