"""Continuous batching (the engine core: plugins.serving.scheduler, runner, kv_manager) on every engine:
requests that join and leave a running batch at different steps produce, token for token, what
`generate` produces for each alone (fp32)."""

import pytest
import torch
from batch_driver import CAPACITY, SLOTS, alone, requests, run

from plugins.core.config import ConfigError
from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.engine import EngineCore
from plugins.serving.request import Request, RequestRefused
from plugins.serving.runner import open_runner

BACKENDS = [("hf", {}), ("deepspeed", {}), ("megatron", {})]


@pytest.mark.parametrize("name,options", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_overlapping_requests_match_generate_alone(tiny_dir, tokenizer, name, options):
    backend = load_backend(name, tiny_dir, dtype="float32", **options)
    schedule = requests(tokenizer)
    state, out, finished = run(backend, schedule)
    for _, request in schedule:
        assert out[request.id] == alone(backend, request), f"request {request.id} differs from generate alone"
        assert finished[request.id] == "length"
    # the pool is allocated once, for SLOTS x CAPACITY tokens of one KV head (MQA) or n_head heads (MHA)
    config = backend.config
    kv_heads = 1 if config.multi_query else config.n_head
    assert state["kv_pool_bytes"] == \
        config.n_layer * 2 * SLOTS * CAPACITY * kv_heads * (config.n_embd // config.n_head) * 4


@pytest.mark.parametrize("name", ["hf", "deepspeed", "megatron"])
def test_chunked_prefill_matches_generate_alone(tiny_dir, tokenizer, name):
    """A token budget of 12 per step: prompts of up to 40 tokens spread over several steps while the
    running rows decode, short ones share a step; a prefix-cache hit (a prompt that starts with an
    earlier one) ends inside a chunk. Every request's tokens equal `generate` alone."""
    backend = load_backend(name, tiny_dir, dtype="float32")
    schedule = requests(tokenizer)
    head = schedule[6][1].prompt  # 40 tokens: the next prompt reuses its first 32 (two cache blocks)
    schedule.append((13, Request(id=200, prompt=head[:35] + prompt_token_ids(tokenizer, 5, 50), max_tokens=7)))
    steps = []
    _, out, finished = run(backend, schedule, budget=12, prefix_cache_bytes=1 << 20, steps=steps)
    for _, request in schedule:
        assert out[request.id] == alone(backend, request), f"request {request.id} differs from generate alone"
    # the budget holds: decode rows + prompt tokens <= 12 (a step with more running rows still computes one)
    assert all(chunk <= max(12 - rows, 1) for rows, chunk, _, _ in steps), steps
    assert sum(chunk for _, chunk, _, _ in steps) == sum(len(r.prompt) for _, r in schedule) - 32  # the hit's 32 reused
    # the 40-token prompt took several steps, during which the running rows kept decoding: in the same
    # forward on DeepSpeed's injected layers, in a forward of their own on the others
    both = [phases for rows, chunk, phases, _ in steps if chunk and rows]
    assert len(both) >= 4
    assert all(phases == ({"mixed"} if name == "deepspeed" else {"prefill", "decode"}) for phases in both), both


@pytest.mark.parametrize("name", ["hf", "deepspeed"])
def test_a_chunk_size_per_step_matches_generate_alone(tiny_dir, tokenizer, name):
    """The prompt tokens of each step handed with the step (the server's adaptive budget), changing
    every step: chunks end anywhere in a prompt, and every request still equals `generate` alone."""
    backend = load_backend(name, tiny_dir, dtype="float32")
    schedule = requests(tokenizer)
    sizes = (5, 1, 0, 23, 2, 9)  # 0: a step that decodes while prompts wait
    steps = []
    _, out, _ = run(backend, schedule, chunk=lambda step: sizes[step % len(sizes)], steps=steps)
    for _, request in schedule:
        assert out[request.id] == alone(backend, request), f"request {request.id} differs from generate alone"
    assert all(chunk <= sizes[i % len(sizes)] for i, (_, chunk, _, _) in enumerate(steps)), steps
    assert {chunk for _, chunk, _, _ in steps} >= {0, 1, 2, 5, 9}


def test_prompt_lookup_speculation_in_the_batch_matches_generate_alone(ckpt_factory, tokenizer, monkeypatch):
    """Greedy rows propose by prompt lookup and keep what the model confirms; sampled rows and a row
    with a penalty decode one token a step beside them; the 64-column pool packs the rejected
    columns away. Every request equals plain `generate` alone, and proposals were accepted."""
    monkeypatch.setenv("PLUGINS_SPECULATION", "always")  # whatever this machine would measure
    ckpt = ckpt_factory("tiny")
    plain = load_backend("deepspeed", ckpt, dtype="float32")
    spec = load_backend("deepspeed", ckpt, dtype="float32", speculative={"draft": "prompt-lookup", "k": 4})
    schedule = requests(tokenizer)
    snippet = prompt_token_ids(tokenizer, 10, 60)
    schedule.append((4, Request(id=300, prompt=snippet * 3 + snippet[:4], max_tokens=20)))  # an edit
    schedule.append((4, Request(id=301, prompt=snippet * 2, max_tokens=12, repetition_penalty=1.3)))
    steps = []
    _, out, _ = run(spec, schedule, steps=steps)
    _, without, _ = run(plain, schedule)  # the same batch, no speculation: the penalty row's reference
    for _, request in schedule:
        expected = without[request.id] if request.id == 301 else alone(plain, request)
        assert out[request.id] == expected, f"request {request.id} differs"
    stats = steps[-1][3]
    assert stats["steps"] > 0 and stats["accepted"] > 0, stats
    assert max(rows for rows, *_ in steps) == SLOTS


def draft_follows_the_pool(core) -> None:
    """Every row's token columns hold its prompt and output, and the draft's K and V in the columns it
    has computed equal the draft's own prefill of the row's tokens up there (rows placed since the
    draft last ran excepted: it computes their prompt when it next proposes)."""
    runner = core.runner
    pool, draft = runner.pool, runner.decoder.draft
    for r, row in enumerate(runner.rows):
        cols = pool.mask[r, :pool.t].nonzero().squeeze(-1)
        assert pool.ids[r, cols].tolist() == (row.request.prompt + row.output)[:-1]
        cols = cols[cols < pool.drafted]
        if not len(cols) or pool.undrafted[r]:
            continue
        _, alone = draft.prefill_alone(pool.ids[r, cols][None])
        for pooled, expected in zip(draft.pool_tensors(), alone):
            torch.testing.assert_close(pooled[r].index_select(1, cols), expected[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", ["int8", "other weights"])
def test_draft_model_speculation_in_the_batch_matches_generate_alone(tiny_dir, ckpt_factory, tokenizer, draft,
                                                                      monkeypatch):
    """A draft model proposes for every greedy row, its K and V in the pool beside the target's: it
    computes each new row's prompt (chunked at a budget of 12, a prefix-cache hit: the target's alone),
    catches up on the columns of plain steps, and moves with every compaction and pack (checked after
    every step). Every request equals plain
    `generate` alone, and the target accepted proposals."""
    monkeypatch.setenv("PLUGINS_SPECULATION", "always")
    other = "tiny" if "mha" in str(tiny_dir) else "tiny-mha"  # an MHA draft for MQA, and the other way
    path = "int8" if draft == "int8" else str(ckpt_factory(other, seed=9))
    plain = load_backend("deepspeed", tiny_dir, dtype="float32")
    spec = load_backend("deepspeed", tiny_dir, dtype="float32", speculative={"draft": path, "k": 3})
    schedule = requests(tokenizer)
    head = schedule[6][1].prompt
    schedule.append((13, Request(id=200, prompt=head[:35] + prompt_token_ids(tokenizer, 5, 50), max_tokens=7)))
    steps = []
    state, out, _ = run(spec, schedule, budget=12, prefix_cache_bytes=1 << 20, steps=steps,
                        check=draft_follows_the_pool)
    for _, request in schedule:
        assert out[request.id] == alone(plain, request), f"request {request.id} differs from generate alone"
    stats = steps[-1][3]
    assert stats["steps"] > 0 and stats["accepted"] > 0, stats
    # the pool holds both models' K and V
    per_row = sum(c.n_layer * 2 * (1 if c.multi_query else c.n_head) * (c.n_embd // c.n_head) * 4
                  for c in (spec.config, spec.draft.config))
    assert state["kv_pool_bytes"] == per_row * SLOTS * CAPACITY


def test_speculation_stays_on_only_where_it_measured_faster():
    from plugins.serving.speculation import PROBE_EVERY, SpeculationPolicy
    from plugins.serving.step import DecodeReading

    spec = SpeculationPolicy(always=False)

    def step(rows, verified, tokens, seconds):
        spec.observe(DecodeReading(rows, verified, tokens, seconds))

    assert spec.wanted(3)                      # nothing measured at 3-4 rows: verify first
    step(3, True, tokens=4, seconds=1.0)
    assert not spec.wanted(4)                  # then a plain step
    step(4, False, tokens=4, seconds=0.5)
    assert not spec.wanted(3)                  # 4 tok/s verifying against 8 plain: plain
    for _ in range(PROBE_EVERY - 1):
        step(4, False, tokens=4, seconds=0.5)
    assert spec.wanted(4)                      # measured again after PROBE_EVERY plain steps
    step(4, True, tokens=5, seconds=1.0)
    assert spec.rates[4].verify == 5.0         # a kind's second step replaces its first (shapes run once)
    for _ in range(PROBE_EVERY):
        step(4, False, tokens=4, seconds=0.5)
    assert not spec.wanted(4)                  # it lost again: the next try waits twice as long
    for _ in range(PROBE_EVERY):
        step(4, False, tokens=4, seconds=0.5)
    assert spec.wanted(4)
    step(4, True, tokens=80, seconds=1.0)
    assert spec.wanted(4) and spec.wanted(1)   # faster now at 4 rows; 1 row never measured


def test_released_and_eos_requests_leave_the_others_exact(ckpt_factory, tokenizer):
    backend = load_backend("deepspeed", ckpt_factory("tiny"), dtype="float32")
    schedule = requests(tokenizer)
    # request 102 is dropped after 7 tokens (client gone); 105 stops at the token it produces 4th
    expected = {r.id: alone(backend, r) for _, r in schedule}
    eos = expected[105][3]
    for _, r in schedule:
        if r.id == 105:
            r.eos_token_id = eos
    _, out, finished = run(backend, schedule, cancel=lambda rid, n: rid == 102 and n >= 7)
    assert out[102] == expected[102][:len(out[102])] and 7 <= len(out[102]) < len(expected[102])
    stop_at = expected[105].index(eos) + 1
    assert out[105] == expected[105][:stop_at] and finished[105] == "stop"
    for rid in expected.keys() - {102, 105}:
        assert out[rid] == expected[rid]


def test_requests_the_pool_cannot_hold_are_refused_before_any_work(ckpt_factory, tokenizer):
    backend = load_backend("hf", ckpt_factory("tiny"), dtype="float32")
    core = EngineCore(backend, 2, 32)
    too_long = Request(id=1, prompt=prompt_token_ids(tokenizer, 30, 0), max_tokens=3)
    with pytest.raises(RequestRefused, match="exceeds this model's context of 32") as refused:
        core.add(too_long)
    assert refused.value.field == "max_tokens" and not core.scheduler.has_work()
    with pytest.raises(RequestRefused, match="min_tokens"):
        core.add(Request(id=2, prompt=[1, 2], max_tokens=2, min_tokens=3))
    for i in range(3):  # one more than the slots: it waits for one
        core.add(Request(id=10 + i, prompt=[1, 2], max_tokens=10))
    core.step()
    assert core.scheduler.held == 2 and len(core.scheduler.waiting) == 1
    with pytest.raises(ConfigError, match="n_positions"):
        open_runner(backend, 2, backend.config.n_positions + 1)


def test_a_draft_shorter_than_the_pool_is_refused(ckpt_factory):
    short = ckpt_factory("tiny", n_positions=32)
    spec = load_backend("deepspeed", ckpt_factory("tiny"), speculative={"draft": str(short)})
    with pytest.raises(ConfigError, match="exceeds the draft model's n_positions 32"):
        open_runner(spec, 2, 48)
