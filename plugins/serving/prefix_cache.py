"""Automatic prefix caching: the KV of prompt prefixes already seen, reused for new prompts that start
with them, least recently used first out under a byte budget.

Prefixes are whole blocks of `block` tokens, found by a chained hash per block (the hash of block k
covers blocks 0..k), so a lookup walks the prompt once and a match is confirmed token by token.
Hashed blocks rather than a radix tree: a dict lookup per block is all a prompt of a few thousand
tokens needs, and entries stay independent (one tensor per layer, evicted whole).

A hit is copied into the new request's scratch cache, not shared: the running batch keeps its rows
dense (plugins.serving.batching), and with one KV head (MQA) the copy is small (SantaCoder-1B: 12 KB per
token in bf16). So a running request never holds an entry, and evicting one never touches a request.
An entry that a longer one extends (an editor's file that grew) is dropped when the longer one is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from plugins.core.tensors import tensor_bytes


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    kv: list[torch.Tensor]  # every layer's K and V, len(tokens) columns each
    hashes: list[int]
    nbytes: int


class PrefixCache:
    def __init__(self, budget_bytes: int, time_dim: int, block: int = 16):
        self.budget, self.time_dim, self.block = budget_bytes, time_dim, block
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._index: dict[int, list[_Entry]] = {}
        self.bytes = 0
        self.lookups = self.hits = self.reused_tokens = self.evictions = 0

    def _hashes(self, tokens) -> list[int]:
        out, h = [], 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, tuple(tokens[start:start + self.block])))
            out.append(h)
        return out

    def _find(self, tokens: tuple, hashes: list[int]) -> tuple[int, _Entry | None]:
        """Longest block-aligned prefix of `tokens` held by an entry: (length, entry)."""
        for k in range(len(hashes), 0, -1):
            n = k * self.block
            for entry in self._index.get(hashes[k - 1], ()):
                if entry.tokens[:n] == tokens[:n]:
                    return n, entry
        return 0, None

    def lookup(self, prompt: list[int]) -> tuple[int, list[torch.Tensor] | None]:
        """(tokens reused, their K/V views) for the longest cached prefix that leaves at least one prompt
        token to compute (its logits are the first new token's)."""
        self.lookups += 1
        usable = tuple(prompt[:(len(prompt) - 1) // self.block * self.block])
        n, entry = self._find(usable, self._hashes(usable))
        if entry is None:
            return 0, None
        self._lru.move_to_end(entry)
        self.hits += 1
        self.reused_tokens += n
        return n, [t.narrow(self.time_dim, 0, n) for t in entry.kv]

    def insert(self, prompt: list[int], kv: list[torch.Tensor]) -> None:
        """Keep the KV of `prompt`'s whole blocks (`kv`: every layer's K and V over the prompt's columns)."""
        tokens = tuple(prompt[:len(prompt) // self.block * self.block])
        if not tokens:
            return
        hashes = self._hashes(tokens)
        n, held = self._find(tokens, hashes)
        if n == len(tokens):  # already held, maybe inside a longer entry
            self._lru.move_to_end(held)
            return
        parts = [t.narrow(self.time_dim, 0, len(tokens)) for t in kv]
        nbytes = tensor_bytes(parts)
        if nbytes > self.budget:
            return
        if held is not None and len(held.tokens) == n:
            self._drop(held)  # this entry extends it
        entry = _Entry(tokens, [t.clone(memory_format=torch.contiguous_format) for t in parts], hashes, nbytes)
        self._lru[entry] = None
        for h in hashes:
            self._index.setdefault(h, []).append(entry)
        self.bytes += nbytes
        while self.bytes > self.budget:
            self._drop(next(iter(self._lru)))
            self.evictions += 1

    def _drop(self, entry: _Entry) -> None:
        del self._lru[entry]
        for h in entry.hashes:
            bucket = self._index[h]
            bucket.remove(entry)
            if not bucket:
                del self._index[h]
        self.bytes -= entry.nbytes

    def stats(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "evictions": self.evictions, "cached_bytes": self.bytes, "entries": len(self._lru),
                "budget_bytes": self.budget}
