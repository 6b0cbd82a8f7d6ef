"""Requests built to hurt the server (live on 127.0.0.1), each answered alone: the status and one error
body, and afterwards /health and a greedy probe are what they were. Bad Unicode on the chat routes,
work out of proportion to a request's size (echoed log-probabilities, /tokenize, /detokenize), a
request that could never be queued, a smuggled second request, endless unknown field names, and
clients that leave while their requests are queued."""

import json
import socket
import time
from pathlib import Path

import httpx2
import pytest
from live_server import SLOTS, Server, with_chat_template
from test_serve_robust import KV_BUDGET, greedy_alone, openai_error, read_response

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend

MAX_WAITING = 8
PROBE = "def probe(x):"


@pytest.fixture(scope="module")
def chat_ckpt(ckpt, tmp_path_factory):
    return with_chat_template(ckpt, tmp_path_factory.mktemp("attacks") / "tiny-chat")


@pytest.fixture(scope="module")
def server(chat_ckpt):
    s = Server(chat_ckpt, "--backend", "hf", "--kv-budget", KV_BUDGET, max_waiting=MAX_WAITING)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def probe(ckpt, tokenizer):
    return greedy_alone(load_backend("hf", ckpt, dtype="float32"), tokenizer, PROBE, 12)


def unchanged(server, probe) -> None:
    """The server is as it was: healthy, nothing held, and a greedy request answers what it always did."""
    health = httpx2.get(server.url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0, health
    r = httpx2.post(server.url + "/v1/completions", timeout=60,
                    json={"prompt": PROBE, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == probe, r.text[:300]
    assert "Traceback" not in server.output()


def post(server, path: str, body: bytes | dict) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)


CHAT_UNICODE = [  # (route, raw body, param named)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\udc80cd"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages"),
    ("/v1/chat/completions/render", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\xff\xfecd"}]}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', None),  # UTF-8 of U+D800
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}', None),
]


@pytest.mark.parametrize("path,body,param", CHAT_UNICODE)
def test_bad_unicode_in_a_chat_request_is_a_400(server, probe, path, body, param):
    error = openai_error(post(server, path, body), 400)
    assert error["param"] == param
    assert "lone surrogate" in error["message"] or "not valid UTF-8" in error["message"], error
    unchanged(server, probe)


def test_echoed_logprobs_are_bounded_before_any_work(server, probe, tokenizer):
    prompts = [prompt_token_ids(tokenizer, 200, i) for i in range(64)]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 20}
    error = openai_error(post(server, "/v1/completions", body), 400)
    assert error["param"] == "logprobs" and "at most 262144" in error["message"], error
    # what lm-eval sends (one prompt, logprobs 1) stays allowed
    r = post(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 200
    unchanged(server, probe)


def test_tokenizer_routes_take_the_prompt_limits(server, probe):
    error = openai_error(post(server, "/tokenize", {"prompt": "a" * (3 << 20)}), 400)
    assert error["param"] == "prompt" and "bytes: more than 255 tokens" in error["message"], error
    error = openai_error(post(server, "/detokenize", {"tokens": [17] * 300_000}), 400)
    assert error["param"] == "tokens" and "context of 256" in error["message"], error
    assert post(server, "/tokenize", {"prompt": PROBE}).json()["count"] > 0
    unchanged(server, probe)


def test_a_request_that_can_never_be_queued_is_a_400_not_a_retry_later(server, probe):
    too_many = SLOTS + MAX_WAITING + 1
    error = openai_error(post(server, "/v1/completions", {"prompt": ["x"] * too_many, "max_tokens": 1}), 400)
    assert "--max-waiting" in error["message"] and f"{too_many} generations" in error["message"], error
    error = openai_error(post(server, "/v1/completions", {"prompt": ["x"] * 64, "n": 64, "max_tokens": 1}), 400)
    assert "4096 generations" in error["message"], error
    fits = post(server, "/v1/completions", {"prompt": ["x"] * (SLOTS + MAX_WAITING), "max_tokens": 2,
                                            "temperature": 0})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == SLOTS + MAX_WAITING
    unchanged(server, probe)


def test_a_smuggled_second_request_is_never_served(server, probe):
    """Content-Length and chunked Transfer-Encoding together: a proxy reading the length would pass the
    chunked terminator and a second request as this one's body."""
    smuggled = b'{"prompt": "smuggled", "max_tokens": 1}'
    second = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
    body = b"0\r\n\r\n" + second
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body) + body)
        status, answer = read_response(s)
        assert status == 400 and "Transfer-Encoding" in json.loads(answer)["error"]["message"], answer
        rest = b""
        while chunk := s.recv(65536):  # the server closed the connection: no second answer
            rest += chunk
        assert rest == b""
    unchanged(server, probe)


def test_endless_unknown_field_names_cost_one_short_log_line_per_request(server, probe):
    before = server.output().count("ignoring request field")
    for i in range(5):
        body = {"prompt": PROBE, "max_tokens": 1, **{f"x{i}_{k}": 0 for k in range(100_000)}}
        assert post(server, "/v1/completions", body).status_code == 200
    lines = [line for line in server.output().splitlines() if "ignoring request field" in line]
    assert len(lines) - before == 5 and all(len(line) < 400 for line in lines[-5:]), lines[-5:]
    assert "and 99995 more" in lines[-1]
    unchanged(server, probe)


def test_clients_that_leave_while_queued_end_their_handlers_and_503_is_for_a_full_queue(ckpt_factory, tokenizer):
    """One slot held by a long request (the small model: ~1000 steps, seconds), a queue of two filled,
    then a third is refused; the queued clients leave; an idle SIGTERM then ends at once, with no
    handler left waiting (before, each left a handler that never ended, and SIGTERM waited the whole
    graceful timeout)."""
    ckpt = ckpt_factory("small")
    server = Server(ckpt, "--backend", "hf", "--max-batch", "1", "--kv-budget", "64MB", max_waiting=2,
                    graceful_timeout=60)
    model = Path(ckpt).name
    long = {"model": model, "prompt": "def f(x):", "max_tokens": 1000, "min_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    queued_body = json.dumps({"model": model, "prompt": "x = 1", "max_tokens": 8}).encode()
    try:
        with httpx2.stream("POST", server.url + "/v1/completions", json=long, timeout=120) as stream:
            lines = stream.iter_lines()
            next(lines)  # its first token: it holds the one slot
            queued = []
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", server.port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(queued_body) + queued_body)
                queued.append(s)
            while server.metric("mqa_requests_waiting") < 2:
                time.sleep(0.02)
            full = httpx2.post(server.url + "/v1/completions", json={"model": model, "prompt": "y", "max_tokens": 1},
                               timeout=60)
            error = openai_error(full, 503)
            assert "server busy" in error["message"] and full.headers["retry-after"] == "1"
            assert server.metric("mqa_requests_running") == 1  # the long request still held the slot
            for s in queued:
                s.close()
            deadline = time.monotonic() + 30
            while server.metric("mqa_requests_waiting") != 0:
                assert time.monotonic() < deadline, "requests of clients that left stayed queued"
                time.sleep(0.02)
        while server.metric("mqa_requests_running") != 0:  # the long stream's client left too
            time.sleep(0.02)
        assert server.metric('mqa_requests_finished_total{reason="cancelled"}') == 3
        started = time.monotonic()
        assert server.stop() == 0, server.output()
        assert time.monotonic() - started < 30, "SIGTERM waited for handlers of requests that had ended"
        assert "CancelledError" not in server.output() and "Traceback" not in server.output()
    finally:
        server.stop()
