"""Greedy speculative decoding: a draft proposes k tokens, the target checks them in one forward.

The output is exactly the target's greedy output: a drafted token is kept only if it is the
target's own argmax, and every round adds the target's next token after the accepted prefix.
In a batch every row keeps the same number of tokens (the smallest acceptance in the batch), so
caches stay rectangular; a row's extra accepted tokens are simply re-drafted next round.

Decoders used here need two things beyond `plugins.generation.Decoder`:
`forward_tokens(tokens [B, n], mask, position_ids [B, n]) -> logits [B, n, V]` and
`rollback(n)`, which forgets the last n cached positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .backend import GenerationResult, position_ids


@dataclass
class SpeculativeStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         max_new_tokens: int, k: int = 4) -> tuple[GenerationResult, SpeculativeStats]:
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    tokens = torch.empty((batch, total + k + 1), dtype=torch.long, device=input_ids.device)
    tokens[:, :prompt_len] = input_ids
    mask = torch.ones((batch, total + k + 1), dtype=attention_mask.dtype, device=input_ids.device)
    mask[:, :prompt_len] = attention_mask
    start_pos = position_ids(attention_mask)
    pos0 = start_pos[:, -1:] + 1 - prompt_len  # position of absolute column c is pos0 + c
    stats = SpeculativeStats()

    start = time.perf_counter()
    tokens[:, prompt_len] = target.prefill(input_ids, attention_mask, start_pos).argmax(-1)
    draft.prefill(input_ids, attention_mask, start_pos)
    prefill_s = time.perf_counter() - start

    n = prompt_len + 1           # columns filled; column n-1 is not yet in either cache
    draft_len = prompt_len       # columns held by the draft's cache
    step_s = []
    arange = torch.arange(k + 1, device=input_ids.device)
    while n < total:
        t = time.perf_counter()
        # Draft: catch up on columns it has not seen, then propose k tokens one by one.
        for _ in range(k):
            cols = slice(draft_len, n)
            logits = draft.forward_tokens(tokens[:, cols], mask[:, :n], pos0 + arange[:n - draft_len] + draft_len)
            tokens[:, n] = logits[:, -1].argmax(-1)
            draft_len, n = n, n + 1
        # Target: one forward over the last accepted token and the k drafted ones.
        base = n - k - 1
        logits = target.forward_tokens(tokens[:, base:n], mask[:, :n], pos0 + arange + base)
        verified = logits.argmax(-1)                                   # [B, k + 1]
        match = (verified[:, :k] == tokens[:, base + 1:n]).long().cumprod(-1).sum(-1)
        accepted = int(match.min())
        keep = base + 1 + accepted                                     # columns now final
        tokens[:, keep] = verified[:, accepted]                        # target's own next token
        target.rollback(n - keep)
        draft.rollback(max(0, draft_len - keep))
        draft_len = min(draft_len, keep)
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += accepted
        produced = min(accepted + 1, total - (n - k))
        n = keep + 1
        step_s.extend([(time.perf_counter() - t) / (accepted + 1)] * produced)
    result = GenerationResult(tokens=tokens[:, :total].clone(), prefill_s=prefill_s, step_s=step_s[:max_new_tokens - 1],
                              kv_cache_bytes=target.kv_cache_bytes())
    return result, stats
