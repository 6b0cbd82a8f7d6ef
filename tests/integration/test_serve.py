"""The completions server, live on 127.0.0.1: the real `openai` client and raw HTTP for the streams.

Every greedy completion served under concurrency must be, token for token, what `generate` gives
for that request alone on the same engine (fp32).
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import openai
import pytest
import torch
from live_server import SLOTS, Server, descendants

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.http.text import StreamText, encode_prompt


@pytest.fixture(scope="module")
def engine(ckpt):
    return load_backend("deepspeed", ckpt, dtype="float32")


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--backend", "deepspeed", "--kv-budget", str(SLOTS * 2 * 2 * 16 * 4 * 256))
    yield s
    s.stop()


def expected_text(engine, tokenizer, ids, max_tokens, **sampling):
    """What `generate` alone gives, cut after EOS as the server stops there: (text, tokens, finish reason)."""
    t = torch.tensor([ids])
    new = engine.generate(t, torch.ones_like(t), max_tokens, **sampling).tokens[0, len(ids):].tolist()
    eos = tokenizer.token_to_id("<|endoftext|>")
    reason = "length"
    if eos in new:
        new, reason = new[:new.index(eos) + 1], "stop"
    return tokenizer.decode(new, skip_special_tokens=True), len(new), reason  # vLLM's default text


PROMPTS = [(5 + 3 * i, 4 + 5 * i) for i in range(9)]  # (prompt tokens, max_tokens), all different


def prompt_text(tokenizer, i, length):
    return tokenizer.decode(prompt_token_ids(tokenizer, length, i))


def test_models_and_health(server, ckpt):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [Path(ckpt).name]
    health = httpx2.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == SLOTS and health["capacity"] == 256


def test_concurrent_greedy_completions_match_generate_alone(server, engine, tokenizer, ckpt):
    model = Path(ckpt).name

    def ask(i):
        time.sleep(0.05 * i)  # arrivals spread over the running batch's steps
        length, max_tokens = PROMPTS[i]
        return server.client.completions.create(model=model, prompt=prompt_text(tokenizer, i, length),
                                                max_tokens=max_tokens, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    for i, answer in enumerate(answers):
        length, max_tokens = PROMPTS[i]
        ids = tokenizer.encode(prompt_text(tokenizer, i, length)).ids
        text, n, reason = expected_text(engine, tokenizer, ids, max_tokens)
        assert answer.choices[0].text == text, f"request {i}"
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == n
        assert answer.choices[0].finish_reason == reason
    assert server.metric("mqa_requests_running") == 0
    # the default budget is measured (auto): prompts arriving while rows decode were chunked by it
    assert 8 <= server.metric("mqa_step_token_budget") <= 2048


def test_stream_over_raw_http_is_sse_and_equals_the_plain_answer(server, tokenizer, ckpt):
    body = {"model": Path(ckpt).name, "prompt": prompt_text(tokenizer, 3, 12), "max_tokens": 40, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert len(chunks) > 3  # text arrived as it was made, not in one piece
    plain = server.client.completions.create(model=body["model"], prompt=body["prompt"], max_tokens=40, temperature=0)
    assert text == plain.choices[0].text and usage == plain.usage.model_dump(exclude_none=True)


def test_openai_client_stream_stop_strings_and_seeded_sampling(server, engine, tokenizer, ckpt):
    model = Path(ckpt).name
    for i in range(20):  # a completion with a 3-character stop string that first occurs after its start
        prompt = prompt_text(tokenizer, i, 9)
        full = server.client.completions.create(model=model, prompt=prompt, max_tokens=30,
                                                temperature=0).choices[0].text
        at = next((j for j in range(2, len(full) - 3) if full.find(full[j:j + 3]) == j), None)
        if at is not None:
            break
    stop = full[at:at + 3]
    pieces = list(server.client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0,
                                                   stop=[stop, "\x00never"], stream=True))
    assert "".join(p.choices[0].text for p in pieces) == full[:at]
    assert pieces[-1].choices[0].finish_reason == "stop"

    ids = tokenizer.encode(prompt).ids
    sampled = [server.client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0.9,
                                                top_p=0.95, seed=42).choices[0].text for _ in range(2)]
    text = expected_text(engine, tokenizer, ids, 20, do_sample=True, temperature=0.9, top_p=0.95, seed=42)[0]
    assert sampled == [text, text]


def test_suffix_is_fill_in_the_middle_with_the_tokenizers_own_tokens(server, engine, tokenizer, ckpt):
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    answer = server.client.completions.create(model=Path(ckpt).name, prompt=prefix, suffix=suffix, max_tokens=12,
                                              temperature=0)
    ids = encode_prompt(tokenizer, prefix, suffix)
    assert ids[0] == tokenizer.token_to_id("<fim-prefix>") and ids[-1] == tokenizer.token_to_id("<fim-middle>")
    assert tokenizer.token_to_id("<fim-suffix>") in ids
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].text == expected_text(engine, tokenizer, ids, 12)[0]


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(server, tokenizer, ckpt):
    """vLLM's `skip_special_tokens` (default true; vllm-router sends it): a logit bias makes every new
    token <fim-prefix>; logprobs name the tokens either way."""
    fim = tokenizer.token_to_id("<fim-prefix>")
    body = {"model": Path(ckpt).name, "prompt": [fim] + tokenizer.encode("x = 1").ids, "max_tokens": 3,
            "temperature": 0, "logit_bias": {str(fim): 100}, "echo": True, "logprobs": 0}

    def answer(**fields):
        return httpx2.post(server.url + "/v1/completions", json=body | fields, timeout=60).json()["choices"][0]

    skipped, kept = answer(), answer(skip_special_tokens=False)
    assert skipped["text"] == "x = 1"
    assert kept["text"] == "<fim-prefix>x = 1" + "<fim-prefix>" * 3
    assert skipped["logprobs"]["tokens"][-3:] == kept["logprobs"]["tokens"][-3:] == ["<fim-prefix>"] * 3


def test_render_is_the_request_checked_and_tokenized_as_served(server, tokenizer, ckpt):
    """vLLM's /v1/completions/render, which vllm-router asks before routing: one GenerateRequest
    per prompt, the token ids the completion would run on; nothing is generated."""
    model, prompts = Path(ckpt).name, ["def f(x):", "class A:\n"]
    generated = server.metric("mqa_generation_tokens_total")
    r = httpx2.post(server.url + "/v1/completions/render",
                    json={"model": model, "prompt": prompts, "max_tokens": 7, "temperature": 0, "stop": ["\n"]})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert [g["token_ids"] for g in rendered] == [tokenizer.encode(p).ids for p in prompts]
    assert [(g["model"], g["stream"]) for g in rendered] == [(model, False)] * 2
    params = rendered[0]["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["stop"], params["skip_special_tokens"]) == \
        (7, 0.0, ["\n"], True)
    assert len({g["request_id"] for g in rendered}) == 2
    fim = httpx2.post(server.url + "/v1/completions/render",
                      json={"model": model, "prompt": "def f(", "suffix": "):\n    pass", "max_tokens": 4}).json()
    assert fim[0]["token_ids"] == encode_prompt(tokenizer, "def f(", "):\n    pass")
    assert server.metric("mqa_generation_tokens_total") == generated


def test_stream_text_never_splits_a_character(tokenizer):
    text = "naïve 漢字 🙂 ok"
    ids = tokenizer.encode(text).ids
    stream = StreamText(tokenizer)
    pieces = [stream.add([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.encode()) // 4  # multi-byte characters really span several tokens


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"model": "M", "prompt": "x", "logprobs": 21}).encode(), 400, "logprobs", "less than or equal to 20"),
    (json.dumps({"model": "M", "prompt": "x", "echo": True, "suffix": "y"}).encode(), 400, "echo", "suffix"),
    (json.dumps({"model": "M", "prompt": "x", "n": 2, "best_of": 3}).encode(), 400, "best_of", "not supported"),
    (json.dumps({"model": "M", "prompt": "x", "stop": ["s"] * 65}).encode(), 400, "stop", "at most 64"),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": 4, "min_tokens": 5}).encode(), 400, "min_tokens",
     "above max_tokens"),
    (json.dumps({"model": "M", "prompt": "x", "logit_bias": {"a": 1}}).encode(), 400, "logit_bias", "token ids"),
    (json.dumps({"model": "M", "prompt": "x", "logit_bias": {"99999999": 1}}).encode(), 400, "logit_bias",
     "outside the vocabulary"),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens", "echo"),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": 300}).encode(), 400, "max_tokens", "context of 256"),
    (json.dumps({"model": "M", "prompt": "x", "temperature": 3}).encode(), 400, "temperature", "less than or equal"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "model", "does not exist"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions/render"])
@pytest.mark.parametrize("body,status,param,message", BAD)
def test_bad_requests_get_one_openai_error(server, ckpt, body, status, param, message, path):
    body = body.replace(b'"M"', json.dumps(Path(ckpt).name).encode())
    r = httpx2.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"]


def test_a_repeated_prompt_reuses_its_cached_prefix(server, tokenizer, ckpt):
    before = server.metric("mqa_prefix_cache_reused_tokens_total")
    hits = server.metric("mqa_prefix_cache_hits_total")
    prompt = prompt_token_ids(tokenizer, 40, 60)  # token ids: exactly these 40 tokens
    answers = [server.client.completions.create(model=Path(ckpt).name, prompt=prompt, max_tokens=5,
                                                temperature=0).choices[0].text for _ in range(2)]
    assert answers[0] == answers[1]
    assert server.metric("mqa_prefix_cache_hits_total") == hits + 1
    assert server.metric("mqa_prefix_cache_reused_tokens_total") == before + 32  # 2 whole blocks; 1 token left
    assert server.metric("mqa_prefix_cache_bytes") > 0


def test_openai_client_sees_bad_request_errors(server, ckpt):
    with pytest.raises(openai.BadRequestError, match="context of 256"):
        server.client.completions.create(model=Path(ckpt).name, prompt="x", max_tokens=1000)


def test_client_gone_mid_stream_frees_its_slot(server, tokenizer, ckpt):
    cancelled = server.metric('mqa_requests_finished_total{reason="cancelled"}') if "cancelled" in \
        httpx2.get(server.url + "/metrics").text else 0
    body = {"model": Path(ckpt).name, "prompt": prompt_text(tokenizer, 1, 8), "max_tokens": 240, "temperature": 0,
            "stream": True}
    with httpx2.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("mqa_requests_running") == 1
    deadline = time.monotonic() + 10
    while server.metric("mqa_requests_running") != 0:
        assert time.monotonic() < deadline, "the slot of a disconnected client was not freed"
        time.sleep(0.05)
    assert server.metric('mqa_requests_finished_total{reason="cancelled"}') == cancelled + 1
    assert server.metric("mqa_kv_pool_slots_used") == 0


def test_sigterm_finishes_in_flight_requests_and_exits(ckpt, tokenizer):
    server = Server(ckpt, "--backend", "hf", "--kv-budget", "1MB")
    result = {}

    def ask():
        result["answer"] = server.client.completions.create(model=Path(ckpt).name, prompt=prompt_text(tokenizer, 0, 6),
                                                            max_tokens=200, temperature=0)

    thread = threading.Thread(target=ask)
    thread.start()
    while server.metric("mqa_requests_running") == 0:
        time.sleep(0.02)
    assert server.stop() == 0, server.output()  # open requests finished, backend closed, a clean exit
    assert "shut down" in server.output()
    thread.join()
    assert result["answer"].usage.completion_tokens >= 1
    assert result["answer"].choices[0].finish_reason in ("length", "stop")


def test_tp2_server_with_chunked_prefill_matches_generate_alone_and_leaves_no_worker(ckpt_factory, tokenizer):
    ckpt = ckpt_factory("tiny-mha")
    # prompts of 5-29 tokens in chunks of <= 8, on both ranks
    server = Server(ckpt, "--backend", "deepspeed", "--tp", "2", "--kv-budget", "1MB", "--max-num-batched-tokens", "8")
    try:
        workers = descendants(server.proc.pid)
        assert len(workers) >= 2
        engine = load_backend("deepspeed", ckpt, dtype="float32")

        def ask(i):
            time.sleep(0.05 * i)
            length, max_tokens = PROMPTS[i]
            return server.client.completions.create(model=Path(ckpt).name, prompt=prompt_text(tokenizer, i, length),
                                                    max_tokens=max_tokens, temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(ask, range(8)))
        for i, text in enumerate(texts):
            length, max_tokens = PROMPTS[i]
            assert text == expected_text(engine, tokenizer, tokenizer.encode(prompt_text(tokenizer, i, length)).ids,
                                         max_tokens)[0]
        # no step computed more than 8 prompt tokens, and the prompts' 8 x ~17 tokens took many steps
        assert server.metric('mqa_step_prefill_tokens_bucket{le="16.0"}') == \
            server.metric("mqa_step_prefill_tokens_count")
        assert server.metric("mqa_step_prefill_tokens_count") - \
            server.metric('mqa_step_prefill_tokens_bucket{le="0.0"}') >= 10
    finally:
        assert server.stop() == 0, server.output()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in workers):
        assert time.monotonic() < deadline, "TP workers outlived the server"
        time.sleep(0.1)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "ctranslate2"], "backend 'ctranslate2' has no continuous batching"),
    (["--backend", "vllm"], "unknown backend 'vllm'"),
    (["--kv-budget", "1KB"], "holds no slot"),
    (["--backend", "hf", "--quantize", "int8"], "unknown option(s) quantize for backend 'hf'"),
    (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens must be >= 0"),
    (["--speculative", "/nonexistent/draft"], "/nonexistent/draft"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
    (["--speculative", "int8", "--num-speculative-tokens", "0"], "speculative k must be a positive integer"),
    (["--speculative", "int8", "--tp", "2"], "options of tp_size 1"),
])
def test_a_server_that_cannot_serve_is_refused_before_loading(argv, message, ckpt, capsys):
    """mqa-serve's own checks: exit 2 with one line naming the problem, no engine loaded."""
    from plugins.http.cli import main

    loaded = []
    with pytest.MonkeyPatch.context() as mp:
        import plugins.engine.registry as registry

        mp.setattr(registry, "load_backend", lambda *a, **k: loaded.append(a))
        with pytest.raises(SystemExit) as exit_:
            main([str(ckpt), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err and not loaded
