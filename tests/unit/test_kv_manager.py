"""The KV manager (plugins.serving.kv_manager) accounts for every byte of KV the engine holds: after every
step of a run that fills the pool, keeps prefix entries, prefills prompts in chunks and drafts with a
second model, its count equals the storage behind every KV tensor alive in the model runner; and a
prompt whose K and V do not fit the budget waits, slots free or not, and is then served exactly."""

import pytest
from batch_driver import alone, requests, run

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.engine import EngineCore
from plugins.serving.request import Request

ENGINES = [("hf", {}), ("deepspeed", {}), ("megatron", {}),
           ("deepspeed", {"speculative": {"draft": "int8", "k": 3}})]


@pytest.mark.parametrize("name,options", ENGINES, ids=["hf", "deepspeed", "megatron", "deepspeed-int8-draft"])
@pytest.mark.parametrize("budget", [12, None], ids=["chunks", "whole"])
def test_the_count_is_every_kv_byte_alive(ckpt_factory, tokenizer, monkeypatch, name, options, budget):
    monkeypatch.setenv("PLUGINS_SPECULATION", "always")
    backend = load_backend(name, ckpt_factory("tiny"), dtype="float32", **options)
    schedule = requests(tokenizer)
    head = schedule[6][1].prompt
    schedule.append((13, Request(id=200, prompt=head[:35] + prompt_token_ids(tokenizer, 5, 50), max_tokens=7)))
    seen = set()

    def check(core):
        assert core.kv.bytes_in_use() == core.runner.kv_bytes(), (core.kv.usage(), core.runner.kv_bytes())
        assert core.kv.bytes_in_use() <= core.kv.budget_bytes()
        seen.update(holder for holder, nbytes in core.kv.usage().items() if nbytes)

    _, out, _ = run(backend, schedule, budget=budget, prefix_cache_bytes=1 << 20, check=check)
    assert seen >= {"pool", "prefix"} | ({"prefill"} if budget else set()) | ({"draft"} if options else set())
    if not options:
        for _, request in schedule:
            assert out[request.id] == alone(backend, request)


def test_a_prompt_whose_kv_does_not_fit_waits_with_slots_free(ckpt_factory, tokenizer):
    backend = load_backend("hf", ckpt_factory("tiny"), dtype="float32")
    core = EngineCore(backend, slots=4, capacity=64, prefix_cache_bytes=1)  # beside the pool: half the pool
    assert core.kv.transient_bytes == 128 * core.runner.info.token_bytes
    asked = [Request(id=i, prompt=prompt_token_ids(tokenizer, 45, i), max_tokens=6) for i in range(3)]
    for request in asked:
        core.add(request)
    out = {}
    result = core.step()
    assert core.scheduler.held == 2 and len(core.scheduler.waiting) == 1  # 3 x 45 tokens > 128
    while True:
        for rid, tokens in result.tokens.items():
            out.setdefault(rid, []).extend(tokens)
        # two prompts' K and V at a time beside the pool (rows in the pool are the pool's)
        assert core.kv.bytes_in_use() == core.runner.kv_bytes() and len(core.scheduler.fills) <= 2
        if not core.scheduler.has_work():
            break
        result = core.step()
    for request in asked:
        assert out[request.id] == alone(backend, request)
