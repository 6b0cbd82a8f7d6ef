"""Greedy speculative decoding: a draft proposes up to k tokens, the target checks them in one forward.

The output is exactly the target's greedy output: a drafted token is kept only if it is the
target's own argmax, and every round adds the target's next token after the accepted prefix.
(Exact means bit-exact only where the target computes k + 1 tokens with the arithmetic of one-token
steps: plugins.kernels.rows_alone.) In a batch every row keeps the same number of tokens (the
smallest acceptance in the batch), so caches stay rectangular; a row's extra accepted tokens are
simply drafted again next round.

Drafts: `ModelDraft` (a smaller or quantized model on its own cache) and `PromptLookupDraft` (no
model: the continuation of an n-gram match in the prompt and the text so far). Target decoders need
`forward_tokens(tokens [B, n], mask, position_ids [B, n]) -> logits [B, n, V]` and `rollback(n)`,
which forgets the last n cached positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plugins.core.tensors import position_ids
from plugins.engine.contract import GenerationResult


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


class ModelDraft:
    """A draft model: catches up on the columns it has not seen, then proposes k tokens one by one."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.length = 0  # columns held by its cache

    def prefill(self, input_ids, attention_mask, start_pos) -> None:
        self.decoder.prefill(input_ids, attention_mask, start_pos)
        self.length = input_ids.shape[1]

    def propose(self, tokens, mask, n: int, pos0, k: int) -> torch.Tensor:
        """Write tokens[:, n:n + k]; return how many of them each row proposes [B]."""
        for i in range(k):
            cols = torch.arange(self.length, n + i, device=tokens.device)
            logits = self.decoder.forward_tokens(tokens[:, cols], mask[:, :n + i], pos0 + cols)
            tokens[:, n + i] = logits[:, -1].argmax(-1)
            self.length = n + i
        return torch.full((tokens.shape[0],), k, device=tokens.device)

    def keep(self, columns: int) -> None:
        self.decoder.rollback(max(0, self.length - columns))
        self.length = min(self.length, columns)


class PromptLookupDraft:
    """Prompt-lookup decoding (transformers' `prompt_lookup_num_tokens`): per row, the first earlier
    occurrence of its last `ngram` tokens (then ngram - 1, ..., 1) and the up to k tokens that followed
    it. A row without a match proposes nothing; its columns are filled (and never accepted)."""

    def __init__(self, ngram: int = 2):
        self.ngram = ngram
        self.start: list[int] = []  # each row's left padding, set by `prefill`

    def prefill(self, input_ids, attention_mask, start_pos) -> None:
        self.start = (attention_mask.shape[1] - attention_mask.sum(-1)).tolist()  # left padding per row

    def propose(self, tokens, mask, n: int, pos0, k: int) -> torch.Tensor:
        lengths = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        for b, start in enumerate(self.start):
            found = self._lookup(tokens[b, start:n], k)
            tokens[b, n:n + k] = tokens[b, n - 1]
            if found is not None:
                tokens[b, n:n + len(found)] = found
                lengths[b] = len(found)
        return lengths

    def _lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor | None:
        return lookup_continuation(seq, k, self.ngram)

    def keep(self, columns: int) -> None:
        pass


def lookup_continuation(seq: torch.Tensor, k: int, ngram: int) -> torch.Tensor | None:
    """Up to k tokens that followed the first earlier occurrence of the last `ngram` tokens of `seq`
    (then ngram - 1, ..., 1); None without a match."""
    for size in range(min(ngram, len(seq) - 1), 0, -1):
        windows = seq[:-1].unfold(0, size, 1)  # every earlier window (not the tail itself)
        hits = (windows == seq[-size:]).all(-1).nonzero()
        if len(hits):
            first = int(hits[0]) + size
            return seq[first:first + k]
    return None


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

    n = prompt_len + 1  # columns filled; column n - 1 is not yet in the target's cache
    step_s = []
    while n < total:
        t = time.perf_counter()
        lengths = draft.propose(tokens, mask, n, pos0, k)   # tokens[:, n:n + k], [B] proposed per row
        drafted = int(lengths.max())
        # Target: one forward over the last accepted token and the drafted ones.
        cols = torch.arange(n - 1, n + drafted, device=tokens.device)
        verified = target.forward_tokens(tokens[:, cols], mask[:, :n + drafted], pos0 + cols).argmax(-1)
        match = (verified[:, :drafted] == tokens[:, n:n + drafted]).long().cumprod(-1).sum(-1)
        accepted = int(torch.minimum(match, lengths).min())
        keep = n + accepted                                            # columns now final
        tokens[:, keep] = verified[:, accepted]                        # target's own next token
        target.rollback(n + drafted - keep)
        draft.keep(keep)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        produced = min(accepted + 1, total - n)
        n = keep + 1
        step_s.extend([(time.perf_counter() - t) / (accepted + 1)] * produced)
    result = GenerationResult(tokens=tokens[:, :total].clone(), prefill_s=prefill_s, step_s=step_s[:max_new_tokens - 1],
                              kv_cache_bytes=target.kv_cache_bytes())
    return result, stats
