"""Prefix caching (plugins.serving.kv_manager decides, the model runner holds the K and V) in continuous
batching: with it on, every engine answers exactly as with it off, whether prompts share nothing, part
or all of a prefix; eviction under a tiny budget keeps answers right."""

import pytest
import torch
from batch_driver import run_with_prefix_cache, shared_requests

from plugins.core.config import ConfigError
from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.kv_manager import KVManager
from plugins.serving.step import RunnerInfo

BLOCK = 16
PER_TOKEN = 64  # bytes of one token's K and V (per rank)


def manager(prefix_tokens: int, capacity: int = 16, fuses_chunks: bool = False) -> KVManager:
    info = RunnerInfo(pool_bytes=0, draft_bytes=0, token_bytes=PER_TOKEN, speculative=False, fuses_chunks=fuses_chunks)
    return KVManager(info, capacity, prefix_tokens * PER_TOKEN, block=BLOCK)


def test_lookup_finds_the_longest_cached_block_prefix_and_leaves_a_token_to_compute():
    kv = manager(1 << 14)
    a = list(range(100, 150))                       # 50 tokens: 3 whole blocks kept
    entry, tokens = kv.keep(a)
    assert tokens == 48 and kv.prefix_stats()["entries"] == 1 and kv.prefix_bytes == 48 * PER_TOKEN
    assert kv.lookup(a[:40] + [7, 8, 9]) == (entry, 32)  # shares 40 tokens: 2 whole blocks
    assert kv.lookup(a[:48]) == (entry, 32)        # all 48 cached, but the last token must be computed
    assert kv.lookup(a[:49]) == (entry, 48)
    assert kv.lookup([1] + a[1:]) == (None, 0)     # differs in the first block
    assert kv.keep(a[:40]) is None                 # held already (inside the longer entry)
    assert kv.prefix_stats() == {"lookups": 4, "hits": 3, "reused_tokens": 112, "evictions": 0,
                                 "cached_bytes": 48 * PER_TOKEN, "entries": 1}


def test_a_longer_prompt_replaces_the_entry_it_extends_and_lru_evicts_under_the_budget():
    kv = manager(64)
    grow = list(range(1000, 1032))
    first, _ = kv.keep(grow)
    kv.keep(grow + [5] * 16)                        # the file grew: one entry, 48 tokens
    assert kv.prefix_stats()["entries"] == 1 and kv.prefix_bytes == 48 * PER_TOKEN
    assert kv.take_evicted() == [first]             # the runner drops the replaced entry's K and V
    other = list(range(2000, 2032))
    kv.keep(other)                                  # 48 + 32 > 64 tokens: the older entry goes
    assert kv.prefix_stats()["entries"] == 1 and kv.evictions == 1 and kv.lookup(grow + [1]) == (None, 0)
    assert kv.lookup(other + [1])[1] == 32
    huge = list(range(3000, 3080))                  # larger than the whole budget: not kept
    assert kv.keep(huge) is None
    assert kv.lookup(other + [1])[1] == 32 and kv.prefix_bytes <= 64 * PER_TOKEN


def test_prompts_being_prefilled_take_room_from_the_prefix_cache_and_wait_when_there_is_none():
    kv = manager(64)
    cached, _ = kv.keep(list(range(48)))
    assert kv.reserve(1, 10)                        # 48 + 10 <= 64: nothing evicted
    assert kv.reserve(2, 20, pinned={cached}) is False  # would need the pinned entry's room: waits
    assert kv.reserve(2, 20) and kv.take_evicted() == [cached]  # the entry goes to make room
    assert kv.reserve(3, 40) is False and 3 not in kv.reserved  # 10 + 20 + 40 > 64, nothing to evict
    kv.prefilled(1, 6)
    assert kv.usage()["prefill"] == 6 * PER_TOKEN   # what the fills hold now, not what they reserved
    kv.placed(1)
    kv.placed(2)
    assert kv.reserve(3, 40) and kv.usage()["prefill"] == 0


@pytest.mark.parametrize("name", ["hf", "deepspeed", "megatron"])
def test_outputs_with_the_cache_on_are_those_with_it_off(tiny_dir, tokenizer, name):
    backend = load_backend(name, tiny_dir, dtype="float32")
    for fim in (False, True):
        schedule = shared_requests(tokenizer, fim)
        off, none = run_with_prefix_cache(backend, schedule, 0)
        on, stats = run_with_prefix_cache(backend, schedule, 1 << 20)
        assert none["lookups"] == 0 and on == off
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
    off, _ = run_with_prefix_cache(backend, schedule, 0, slots=2)
    per_token = backend.config.n_layer * 2 * (backend.config.n_embd // backend.config.n_head) * 4
    # the transient budget is half the pool of 2 slots, one context (160 tokens): prefilling prompts and
    # entries share it
    on, stats = run_with_prefix_cache(backend, schedule, 80 * per_token, slots=2)
    assert on == off
    assert stats["cached_bytes"] <= 160 * per_token and stats["evictions"] >= 2 and stats["hits"] >= 1


def test_a_negative_budget_is_refused():
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        manager(-1)


def test_a_prompt_sharing_its_prefix_with_one_being_prefilled_waits_to_find_it_cached():
    from plugins.serving.request import Request
    from plugins.serving.scheduler import Scheduler
    from plugins.serving.step import StepResult

    shared = list(range(500, 564))                  # 4 blocks
    first, second = Request(1, shared + [1] * 8, 4), Request(2, shared + [2] * 8, 4)
    other = Request(3, list(range(900, 972)), 4)    # shares nothing: not held back
    third = Request(4, shared + [4] * 8, 4)
    scheduler = Scheduler(5, 128, manager(1 << 13, capacity=128))
    for request in (first, second, other, third):
        scheduler.add(request)
    step = scheduler.schedule()
    assert step.chunks == {1: 72, 3: 72} and not step.reuse  # the second would compute the 64 shared tokens again
    scheduler.update(step, StepResult())
    step = scheduler.schedule()
    # the first's prompt is cached now: both join in one step, each from the cached prefix
    assert step.chunks == {2: 72, 4: 72} and step.reuse[2][1] == step.reuse[4][1] == 64
    info = RunnerInfo(pool_bytes=1 << 20, draft_bytes=0, token_bytes=PER_TOKEN, speculative=False)
    off = Scheduler(4, 128, KVManager(info, 128, 0, block=BLOCK))  # no prefix cache: nothing to wait for
    off.add(Request(1, first.prompt, 4))
    off.add(Request(2, second.prompt, 4))
    assert off.schedule().chunks == {1: 72, 2: 72}


def test_where_one_forward_runs_every_chunk_a_prompt_starts_from_the_shared_columns_of_the_one_ahead():
    from plugins.serving.request import Request
    from plugins.serving.scheduler import Scheduler

    shared = list(range(500, 564))
    first, second = Request(1, shared + [1] * 8, 4), Request(2, shared + [2] * 8, 4)
    other, third = Request(3, list(range(900, 972)), 4), Request(4, shared + [4] * 8, 4)
    scheduler = Scheduler(5, 128, manager(1 << 13, capacity=128, fuses_chunks=True))
    for request in (first, second, other, third):
        scheduler.add(request)
    step = scheduler.schedule()
    # one step: the 64 shared columns computed once, by the first; the second and the third take them
    assert step.chunks == {1: 72, 2: 72, 3: 72, 4: 72} and not step.reuse
    assert step.share == {2: (1, 64), 4: (1, 64)}


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_a_chunk_starting_from_another_chunks_columns_matches_its_prompt_computed_alone(ckpt_factory, tokenizer, name):
    from plugins.engine.kv_cache import SharedPrefix

    backend = load_backend("deepspeed", ckpt_factory(name), dtype="float32")
    decoder = backend.batch_decoder(2, 96)
    base = prompt_token_ids(tokenizer, 50, 7)
    first, second = base + prompt_token_ids(tokenizer, 9, 8), base + prompt_token_ids(tokenizer, 13, 9)
    alone, kv_alone = decoder.prefill_alone(torch.tensor([second]))
    no_rows = torch.zeros(0, 1, dtype=torch.long)
    _, chunked = decoder.mixed(no_rows, torch.zeros(0, 1, dtype=torch.long), no_rows,
                               [(torch.tensor([first]), None), (torch.tensor([second]), SharedPrefix(0, 50))])
    logits, kv = chunked[1]
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)
    assert len(kv) == len(kv_alone) and kv[0].shape[decoder.time_dim] == len(second)
    for a, b in zip(kv, kv_alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_first_step_of_a_burst_waits_for_its_requests_on_their_way_while_nothing_runs():
    import time

    from plugins.serving.request import Request
    from plugins.serving.scheduler import GATHER_MAX_S, Scheduler
    from plugins.serving.step import StepResult

    scheduler = Scheduler(4, 128, manager(1 << 13, capacity=128, fuses_chunks=True))
    assert scheduler.gather(time.monotonic(), 3) == 0  # nothing waits
    scheduler.add(Request(1, list(range(500, 564)), 4, arrival=1.0))  # arrived long before it was queued
    queued = scheduler.queued[1]
    assert scheduler.gather(queued + 0.01, 0) == 0  # a lone request: no wait
    assert scheduler.gather(queued + 0.01, 2) == pytest.approx(GATHER_MAX_S - 0.01)  # two on their way
    assert scheduler.gather(queued + GATHER_MAX_S, 2) == 0  # at most GATHER_MAX_S after the first was queued
    for k in range(1, 4):
        scheduler.add(Request(1 + k, list(range(600 + k, 640 + k)), 4))
    step = scheduler.schedule()
    assert sorted(step.chunks) == [1, 2, 3, 4] and not scheduler.queued  # every slot's prompt in the first step
    scheduler.update(step, StepResult())
    scheduler.add(Request(5, list(range(700, 740)), 4))
    assert scheduler.gather(time.monotonic(), 1) == 0  # rows run: it joins the next step
