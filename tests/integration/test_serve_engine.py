"""The server runs the engines' own options, live on 127.0.0.1: chunked prefill under a token budget,
weight-only int8 / int4 layers, speculation by prompt lookup and by draft models. Greedy answers under concurrency equal
`generate` alone on an engine loaded with the same options (fp32), and /metrics shows the prompt
chunks per step and the accepted proposals."""

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
import torch
from live_server import Server

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend

BUDGET = 16
# (prompt tokens, max_tokens): most prompts are longer than the budget; the last two start with the
# first prompt's 48 tokens (prefix-cache hits of 48 tokens, then chunks of the rest)
PROMPTS = [(60, 10), (7, 12), (33, 6), (21, 9), (45, 14), (3, 8)]


def prompts(tokenizer) -> list[list[int]]:
    out = [prompt_token_ids(tokenizer, n, i) for i, (n, _) in enumerate(PROMPTS)]
    head = out[0][:50]
    return out + [head + prompt_token_ids(tokenizer, 9, 40), head + prompt_token_ids(tokenizer, 20, 41)]


def max_tokens(i: int) -> int:
    return PROMPTS[i][1] if i < len(PROMPTS) else 7


def served(server, model: str, ids: list[list[int]], counts: list[int]) -> list[list[str]]:
    """Greedy completions of `counts` tokens, sent as token ids, arriving while earlier ones run; the
    tokens of each answer (logprobs=0 gives the text of every token)."""

    def ask(i):
        time.sleep(0.1 * i)
        r = httpx2.post(server.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": ids[i], "max_tokens": counts[i], "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    with ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(ask, range(len(ids))))


def alone(engine, tokenizer, ids: list[int], n: int) -> list[str]:  # token texts, as logprobs.tokens shows them
    t = torch.tensor([ids])
    new = engine.generate(t, torch.ones_like(t), n).tokens[0, len(ids):].tolist()
    return [tokenizer.decode([i], skip_special_tokens=False) for i in new]


def histogram(server, name: str) -> dict[str, float]:
    text = httpx2.get(server.url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}


LOOKUP = {"draft": "prompt-lookup", "k": 4}
ENGINES = [("megatron", [], {}),
           ("deepspeed", ["--quantize", "int8"], {"quantize": "int8"}),
           ("deepspeed", ["--quantize", "int4", "--speculative", "prompt-lookup", "--num-speculative-tokens", "4"],
            {"quantize": "int4", "speculative": LOOKUP}),
           ("deepspeed", ["--speculative", "prompt-lookup", "--num-speculative-tokens", "4"], {"speculative": LOOKUP}),
           ("deepspeed", ["--speculative", "int8"], {"speculative": {"draft": "int8"}}),  # k: the draft default
           ("deepspeed", ["--quantize", "int8", "--speculative", "DRAFT", "--num-speculative-tokens", "3"],
            {"quantize": "int8", "speculative": {"draft": "DRAFT", "k": 3}})]


@pytest.mark.parametrize("backend,flags,options", ENGINES,
                         ids=["megatron", "int8", "int4-lookup", "lookup", "int8-draft", "int8-with-draft-checkpoint"])
def test_chunked_prefill_and_engine_options_match_generate_alone(ckpt, ckpt_factory, tokenizer, backend, flags,
                                                                 options, monkeypatch):
    monkeypatch.setenv("PLUGINS_SPECULATION", "always")  # verify at every step, whatever this machine measures
    if "DRAFT" in flags:  # a draft model of other weights and shape (MHA) with the same vocabulary
        draft = str(ckpt_factory("tiny-mha", seed=9))
        flags = [draft if f == "DRAFT" else f for f in flags]
        options = {**options, "speculative": {**options["speculative"], "draft": draft}}
    server = Server(ckpt, "--backend", backend, "--max-num-batched-tokens", str(BUDGET), *flags)
    try:
        ids = prompts(tokenizer)
        counts = [max_tokens(i) for i in range(len(ids))]
        answers = served(server, Path(ckpt).name, ids, counts)
        engine = load_backend(backend, ckpt, dtype="float32", **options)
        for i, tokens in enumerate(answers):
            assert tokens == alone(engine, tokenizer, ids[i], max_tokens(i)), f"request {i}"
        # every step computed at most BUDGET prompt tokens, and the long prompts took several steps
        chunks = histogram(server, "mqa_step_prefill_tokens")
        assert chunks["16.0"] == chunks["+Inf"], chunks
        computed = server.metric("mqa_prefill_tokens_total")
        assert computed == sum(map(len, ids)) - 2 * 48  # the two prefix hits reuse 3 blocks of 16
        assert chunks["+Inf"] - chunks["0.0"] >= computed / BUDGET
        assert server.metric("mqa_step_seconds_count{phase=\"prefill\"}") > 0
        assert server.metric("mqa_step_seconds_count{phase=\"decode\"}") > 0
        if "speculative" in options:  # an edit alone (a repeated snippet): proposals, and the model confirms some
            snippet = prompt_token_ids(tokenizer, 12, 70)
            edit = snippet * 3 + snippet[:3]
            [tokens] = served(server, Path(ckpt).name, [edit], [24])
            assert tokens == alone(engine, tokenizer, edit, 24)
            assert server.metric("mqa_spec_decode_accepted_tokens_total") > 0
            assert server.metric("mqa_spec_decode_steps_total") > 0
    finally:
        assert server.stop() == 0, server.output()
