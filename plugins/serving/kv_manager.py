"""Every byte of KV the serving engine holds, accounted in one place, per rank: the pool (slots x
capacity, a draft model's K and V included: fixed at start), prefix-cache entries, and the prompts
being prefilled (each fill holds its prompt's K and V until its rows are placed in the pool).

Pool and draft are allocated once. The rest shares one budget, `transient_bytes` (the prefix cache's
bytes, at least half the pool's so a batch of new prompts is prefilled together, and at least one
whole context so one prompt always can be): a new prompt reserves its
whole prompt's bytes when admitted, evicting least recently used prefix entries where needed, and
waits when even that cannot make room; a prefix entry is kept only within what is left. The runner
holds the tensors; this object holds the numbers and decides (the scheduler asks it), so the same
decisions drive every tensor-parallel rank.

Automatic prefix caching: prefixes are whole blocks of `block` tokens, found by a chained hash per
block (the hash of block k covers blocks 0..k), so a lookup walks the prompt once and a match is
confirmed token by token. Hashed blocks rather than a radix tree: a dict lookup per block is all a
prompt of a few thousand tokens needs, and entries stay independent (evicted whole). A hit is copied
into the new prompt's fill, not shared: the running batch keeps its rows dense (plugins.serving.kv_pool),
and with one KV head (MQA) the copy is small (SantaCoder-1B: 12 KB per token in bf16). An entry that
a longer one extends (an editor's file that grew) is dropped when the longer one is kept.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from plugins.core.config import ConfigError
from plugins.serving.step import RunnerInfo


@dataclass(eq=False)
class _Entry:
    id: int
    tokens: tuple[int, ...]
    hashes: list[int]
    nbytes: int


class KVManager:
    def __init__(self, info: RunnerInfo, capacity: int, prefix_cache_bytes: int = 0, block: int = 16):
        if isinstance(prefix_cache_bytes, bool) or not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0, got {prefix_cache_bytes!r}")
        self.info, self.block = info, block
        self.prefix_enabled = prefix_cache_bytes > 0
        self.transient_bytes = max(prefix_cache_bytes, info.pool_bytes // 2, capacity * info.token_bytes)
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, list[_Entry]] = {}
        self._ids = itertools.count(1)
        self.prefix_bytes = 0
        self.reserved: dict[int, int] = {}  # fill -> bytes of its whole prompt (from admission to placement)
        self.held: dict[int, int] = {}      # fill -> bytes of the prompt columns it holds now
        self.evicted: list[int] = []        # entries dropped since the last `take_evicted`
        self.lookups = self.hits = self.reused_tokens = self.evictions = 0

    # ---- bytes
    def usage(self) -> dict[str, int]:
        """Bytes per holder, per rank: what the tensors alive take."""
        return {"pool": self.info.pool_bytes, "draft": self.info.draft_bytes, "prefix": self.prefix_bytes,
                "prefill": sum(self.held.values())}

    def bytes_in_use(self) -> int:
        return sum(self.usage().values())

    def budget_bytes(self) -> int:
        return self.info.pool_bytes + self.info.draft_bytes + self.transient_bytes

    def _free(self) -> int:
        return self.transient_bytes - self.prefix_bytes - sum(self.reserved.values())

    # ---- prompts being prefilled
    def reserve(self, fill: int, prompt_tokens: int, pinned=()) -> bool:
        """Room for a new prompt's K and V until its rows are placed: evicts prefix entries (not `pinned`:
        those this step reuses) least recently used first; False, changing nothing, when it cannot."""
        need = prompt_tokens * self.info.token_bytes
        evictable = sum(e.nbytes for i, e in self._lru.items() if i not in pinned)
        if need > self._free() + evictable:
            return False
        for entry_id in [i for i in self._lru if i not in pinned]:
            if need <= self._free():
                break
            self._drop(self._lru[entry_id])
            self.evictions += 1
        self.reserved[fill] = need
        self.held[fill] = 0
        return True

    def prefilled(self, fill: int, columns: int) -> None:
        self.held[fill] = columns * self.info.token_bytes

    def placed(self, fill: int) -> None:
        """Its rows are in the pool (or it failed, or every request of it left): its bytes are free."""
        self.reserved.pop(fill, None)
        self.held.pop(fill, None)

    # ---- prefix cache
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

    def _longest(self, prompt: list[int]) -> tuple[int, _Entry | None]:
        """The longest cached prefix that leaves at least one prompt token to compute (its logits are the
        first new token's)."""
        usable = tuple(prompt[:(len(prompt) - 1) // self.block * self.block])
        return self._find(usable, self._hashes(usable))

    def cached(self, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens `lookup` would give now (no statistics counted)."""
        return self._longest(prompt)[0] if self.prefix_enabled else 0

    def lookup(self, prompt: list[int]) -> tuple[int | None, int]:
        """(entry, tokens it gives) for the longest cached prefix that leaves at least one prompt token to
        compute (its logits are the first new token's); (None, 0) on a miss."""
        if not self.prefix_enabled:
            return None, 0
        self.lookups += 1
        n, entry = self._longest(prompt)
        if entry is None:
            return None, 0
        self._lru.move_to_end(entry.id)
        self.hits += 1
        self.reused_tokens += n
        return entry.id, n

    def keep(self, prompt: list[int], pinned=()) -> tuple[int, int] | None:
        """A new entry for `prompt`'s whole blocks, (its id, its tokens), within the room left (older
        entries, not `pinned`, evicted first); None when it is held already or does not fit."""
        if not self.prefix_enabled:
            return None
        tokens = tuple(prompt[:len(prompt) // self.block * self.block])
        if not tokens:
            return None
        hashes = self._hashes(tokens)
        n, held = self._find(tokens, hashes)
        if held is not None and n == len(tokens):  # already held, maybe inside a longer entry
            self._lru.move_to_end(held.id)
            return None
        nbytes = len(tokens) * self.info.token_bytes
        if nbytes > self._free() + sum(e.nbytes for i, e in self._lru.items() if i not in pinned):
            return None  # not even with every other entry gone
        if held is not None and len(held.tokens) == n and held.id not in pinned:
            self._drop(held)  # this entry extends it
        for entry_id in [i for i in self._lru if i not in pinned]:
            if nbytes <= self._free():
                break
            self._drop(self._lru[entry_id])
            self.evictions += 1
        entry = _Entry(next(self._ids), tokens, hashes, nbytes)
        self._lru[entry.id] = entry
        for h in hashes:
            self._index.setdefault(h, []).append(entry)
        self.prefix_bytes += nbytes
        return entry.id, len(tokens)

    def discard(self, entry_id: int) -> None:
        """An entry planned but never made (its prompt's prefill failed)."""
        if entry_id in self._lru:
            self._drop(self._lru[entry_id])

    def _drop(self, entry: _Entry) -> None:
        del self._lru[entry.id]
        for h in entry.hashes:
            bucket = self._index[h]
            bucket.remove(entry)
            if not bucket:
                del self._index[h]
        self.prefix_bytes -= entry.nbytes
        self.evicted.append(entry.id)

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def prefix_stats(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "evictions": self.evictions, "cached_bytes": self.prefix_bytes, "entries": len(self._lru)}
