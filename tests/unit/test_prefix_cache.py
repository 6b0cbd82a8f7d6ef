"""Prefix caching (plugins.serving.prefix_cache) in continuous batching: with it on, every engine answers
exactly as with it off, whether prompts share nothing, part or all of a prefix; eviction under a
tiny budget keeps answers right."""

import pytest
import torch
from batch_driver import run_with_prefix_cache, shared_requests

from plugins.core.config import ConfigError
from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.batching import open_batch
from plugins.serving.prefix_cache import PrefixCache

BLOCK = 16


def kv_for(tokens, layers=2):
    """Fake K/V whose column j encodes token j, in the HF layout [batch, heads, columns, dim]."""
    col = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    return [col.expand(1, 1, len(tokens), 4) * (i + 1) for i in range(2 * layers)]


def test_lookup_finds_the_longest_cached_block_prefix_and_leaves_a_token_to_compute():
    cache = PrefixCache(1 << 20, time_dim=2, block=BLOCK)
    a = list(range(100, 150))                       # 50 tokens: 3 whole blocks kept
    cache.insert(a, kv_for(a))
    assert cache.stats()["entries"] == 1 and cache.stats()["cached_bytes"] == 4 * 48 * 4 * 4
    n, kv = cache.lookup(a[:40] + [7, 8, 9])        # shares 40 tokens: 2 whole blocks
    assert n == 32 and torch.equal(kv[0][0, 0, :, 0], torch.tensor(a[:32], dtype=torch.float32))
    n, _ = cache.lookup(a[:48])                     # all 48 cached, but the last token must be computed
    assert n == 32
    n, _ = cache.lookup(a[:49])
    assert n == 48
    assert cache.lookup([1] + a[1:])[0] == 0        # differs in the first block
    assert cache.stats() == {"lookups": 4, "hits": 3, "reused_tokens": 112, "evictions": 0, "cached_bytes": 3072,
                             "entries": 1, "budget_bytes": 1 << 20}


def test_a_longer_prompt_replaces_the_entry_it_extends_and_lru_evicts_under_the_budget():
    per_token = 4 * 4 * 4  # 4 tensors x 4 dims x fp32
    cache = PrefixCache(64 * per_token, time_dim=2, block=BLOCK)
    grow = list(range(1000, 1032))
    cache.insert(grow, kv_for(grow))
    cache.insert(grow + [5] * 16, kv_for(grow + [5] * 16))  # the file grew: one entry, 48 tokens
    assert cache.stats()["entries"] == 1 and cache.stats()["cached_bytes"] == 48 * per_token
    other = list(range(2000, 2032))
    cache.insert(other, kv_for(other))                       # 48 + 32 > 64 tokens: the older entry goes
    assert cache.stats()["entries"] == 1 and cache.stats()["evictions"] == 1 and cache.lookup(grow + [1])[0] == 0
    assert cache.lookup(other + [1])[0] == 32
    huge = list(range(3000, 3080))                            # larger than the whole budget: not kept
    cache.insert(huge, kv_for(huge))
    assert cache.lookup(other + [1])[0] == 32 and cache.stats()["cached_bytes"] <= 64 * per_token


@pytest.mark.parametrize("name", ["hf", "deepspeed", "megatron"])
def test_outputs_with_the_cache_on_are_those_with_it_off(tiny_dir, tokenizer, name):
    backend = load_backend(name, tiny_dir, dtype="float32")
    for fim in (False, True):
        schedule = shared_requests(tokenizer, fim)
        off, none = run_with_prefix_cache(backend, schedule, 0)
        on, stats = run_with_prefix_cache(backend, schedule, 1 << 20)
        assert none is None and on == off
        assert stats["hits"] >= 4 and stats["reused_tokens"] >= 4 * BLOCK


@pytest.mark.parametrize("name", ["hf", "deepspeed", "megatron"])
def test_first_token_logits_after_a_hit_are_within_1e_5(ckpt_factory, tokenizer, name):
    backend = load_backend(name, ckpt_factory("tiny-mha"), dtype="float32")
    prompt = prompt_token_ids(tokenizer, 57, 4)
    decoder = backend.batch_decoder(1, 64)
    ids = torch.tensor([prompt])
    full, kv = decoder.prefill_alone(ids)
    time_dim = decoder.time_dim
    for n in (16, 48):
        reused, kv_after = decoder.prefill_alone(ids, [t.narrow(time_dim, 0, n) for t in kv])
        torch.testing.assert_close(reused, full, rtol=0, atol=1e-5)
        for a, b in zip(kv_after, kv):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_eviction_under_a_tiny_budget_keeps_every_answer_right(ckpt_factory, tokenizer):
    backend = load_backend("deepspeed", ckpt_factory("tiny"), dtype="float32")
    schedule = shared_requests(tokenizer)
    off, _ = run_with_prefix_cache(backend, schedule, 0)
    per_token = backend.config.n_layer * 2 * (backend.config.n_embd // backend.config.n_head) * 4
    on, stats = run_with_prefix_cache(backend, schedule, 80 * per_token)  # at most one 64-token entry at a time
    assert on == off
    assert stats["cached_bytes"] <= 80 * per_token and stats["evictions"] >= 2 and stats["hits"] >= 1


def test_a_negative_budget_is_refused(ckpt_factory):
    backend = load_backend("hf", ckpt_factory("tiny"), dtype="float32")
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        open_batch(backend, 2, 32, -1)
