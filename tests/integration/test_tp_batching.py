"""Continuous batching and prefix caching across TP ranks (two torchrun ranks over gloo): requests that
join and leave a running batch equal `generate` alone, in chunks or not, and each rank reuses its
share of a cached prefix. One world per engine, shared by the tests of this file."""

import pytest
import torch
from batch_driver import alone, requests, run, run_with_prefix_cache, shared_requests
from transformers import RepetitionPenaltyLogitsProcessor

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.engine import EngineCore
from plugins.serving.request import Request


@pytest.fixture(scope="module", params=["deepspeed", "megatron"])
def tp2(request, ckpt_factory):
    """tiny-mha at TP 2 (MHA: each rank holds half the heads), fp32."""
    with load_backend(request.param, ckpt_factory("tiny-mha"), dtype="float32", tp_size=2) as backend:
        yield backend


def test_tp2_overlapping_requests_match_generate_alone(tp2, tokenizer):
    backend, schedule = tp2, requests(tokenizer)[:6]
    _, out, _ = run(backend, schedule)
    _, chunked, _ = run(backend, schedule, budget=16)  # prompts in chunks of <= 16 tokens on every rank
    _, varied, _ = run(backend, schedule, chunk=lambda step: (3, 17, 1, 8)[step % 4])  # per step, as the front says
    for _, request in schedule:
        assert out[request.id] == chunked[request.id] == varied[request.id] == alone(backend, request)
    # a row with its own rules and log-probabilities, across the ranks: the same as by full forwards
    prompt = prompt_token_ids(tokenizer, 11, 30)
    core = EngineCore(backend, 2, 64)
    core.add(Request(id=1, prompt=prompt, max_tokens=6, repetition_penalty=1.5, logprobs=3, prompt_logprobs=1))
    result = core.step()
    tokens, logprobs, scored = list(result.tokens[1]), list(result.logprobs[1]), result.prompt_logprobs[1]
    while core.scheduler.has_work():
        result = core.step()
        tokens += result.tokens.get(1, [])
        logprobs += result.logprobs.get(1, [])
    ids = list(prompt)
    for token, (value, top) in zip(tokens, logprobs):
        t = torch.tensor([ids])
        logits = backend.logits(t, torch.ones_like(t))[:, -1]
        logp = torch.log_softmax(logits[0].float(), -1)
        assert abs(value - float(logp[token])) < 1e-5 and len(top) == 3
        assert token == int(RepetitionPenaltyLogitsProcessor(1.5)(t, logits.clone()).argmax(-1))
        ids.append(token)
    assert len(tokens) == 6 and len(scored) == len(prompt) - 1


def test_tp2_each_rank_reuses_its_share(tp2, tokenizer):
    backend, schedule = tp2, shared_requests(tokenizer)[:5]
    off, _ = run_with_prefix_cache(backend, schedule, 0)
    on, stats = run_with_prefix_cache(backend, schedule, 1 << 20)
    assert on == off and stats["hits"] >= 2
    # rank 0's share of MHA: half the heads
    config = backend.config
    assert stats["cached_bytes"] % (config.n_layer * 2 * (config.n_head // 2)
                                    * (config.n_embd // config.n_head) * 4) == 0
