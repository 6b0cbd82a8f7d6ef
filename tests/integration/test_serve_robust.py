"""What no client can do to the server (live on 127.0.0.1): take it down, hold it, or see its insides.

Every bad request gets its status and one OpenAI error body while a stream started before it runs on
intact; a request whose own sampling raises ends alone; slow clients are cut by the read deadline;
a client that leaves frees its slot; a burst fills every free slot before anyone waits; a dead
tensor-parallel rank turns /health to 503 at once and ends the server with a non-zero code; requests
cut at the graceful timeout end with an error body.
"""

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
import torch
from live_server import SLOTS, Server, descendants

from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend

KV_BUDGET = str(SLOTS * 2 * 2 * 16 * 4 * 256)  # tiny, fp32: SLOTS slots of 256 tokens


def greedy_alone(engine, tokenizer, text: str, max_tokens: int) -> str:
    ids = tokenizer.encode(text).ids
    t = torch.tensor([ids])
    new = engine.generate(t, torch.ones_like(t), max_tokens).tokens[0, len(ids):].tolist()
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos in new:
        new = new[:new.index(eos)]
    return tokenizer.decode(new, skip_special_tokens=True)


def stream_text(url: str, body: dict) -> tuple[str, list[dict]]:
    with httpx2.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [e for e in "".join(r.iter_text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert "Traceback" not in error["message"]
    return error


def read_response(sock) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def raw(model: str, tail: str) -> bytes:
    return ('{"model": %s, %s}' % (json.dumps(model), tail)).encode()


# (name, body maker (model id -> bytes), status, param, text in the message, or for 200: the greedy text?)
NUMBERS = [("seed", "2**64", 2 ** 64), ("seed", "-2**63-1", -2 ** 63 - 1), ("seed", "1e30 as an integer", 10 ** 30)]
TINY = [("temperature", 1e-300), ("temperature", 5e-324), ("top_p", 1e-300), ("top_p", 5e-324)]
CASES = (
    [(f"{name} {label}", lambda m, n=name, v=value: raw(m, f'"prompt": "def f(x):", "max_tokens": 8, "{n}": {v}'),
      200, None, None) for name, label, value in NUMBERS]
    + [(f"{name} {value!r}", lambda m, n=name, v=value: raw(
        m, f'"prompt": "def f(x):", "max_tokens": 8, "{n}": {v!r}'
        + ("" if n == "temperature" else ', "temperature": 1')),
        200, None, "greedy") for name, value in TINY]
    + [
        ("lone surrogate in prompt", lambda m: raw(m, '"prompt": "ab\\ud800cd"'), 400, "prompt", "lone surrogate"),
        ("lone surrogate in suffix", lambda m: raw(m, '"prompt": "ab", "suffix": "\\udfff"'), 400, "suffix",
         "lone surrogate"),
        ("lone surrogate in stop", lambda m: raw(m, '"prompt": "ab", "stop": ["\\ud83d"]'), 400, "stop",
         "lone surrogate"),
        ("JSON 3k deep", lambda m: raw(m, '"prompt": ' + "[" * 3000 + "]" * 3000), 400, None, "nests deeper"),
        ("JSON 100k deep", lambda m: b"[" * 100000 + b"]" * 100000, 400, None, "nests deeper"),
        ("max_tokens of 5000 digits", lambda m: raw(m, '"prompt": "x", "max_tokens": ' + "9" * 5000), 400, None,
         "4300 digits"),
        ("seed of 5000 digits", lambda m: raw(m, '"prompt": "x", "seed": ' + "7" * 5000), 400, None, "4300 digits"),
        ("max_tokens past the context", lambda m: raw(m, '"prompt": "x", "max_tokens": ' + str(2 ** 70)), 400,
         "max_tokens", "context of 256"),
        ("a 3 MiB text prompt", lambda m: raw(m, '"prompt": "%s"' % ("a" * (3 << 20))), 400, "prompt",
         "bytes: more than 255 tokens"),
        ("NaN temperature", lambda m: raw(m, '"prompt": "x", "temperature": NaN'), 400, "temperature", None),
        ("negative max_tokens", lambda m: raw(m, '"prompt": "x", "max_tokens": -1'), 400, "max_tokens", None),
        ("not JSON", lambda m: b"{nope", 400, None, "not valid JSON"),
    ]
)


@pytest.mark.parametrize("backend", ["hf", "deepspeed"])
def test_no_bad_request_hurts_the_server_or_a_running_stream(ckpt, tokenizer, backend):
    server = Server(ckpt, "--backend", backend, "--kv-budget", KV_BUDGET)
    engine = load_backend(backend, ckpt, dtype="float32")
    model = Path(ckpt).name
    prompt = tokenizer.decode(prompt_token_ids(tokenizer, 9, 4))
    try:
        streamed = {}
        stream = threading.Thread(target=lambda: streamed.update(
            zip(("text", "chunks"), stream_text(server.url, {"model": model, "prompt": prompt, "max_tokens": 200,
                                                             "temperature": 0}))))
        stream.start()
        while server.metric("mqa_requests_running") == 0 and stream.is_alive():
            time.sleep(0.01)
        greedy8 = greedy_alone(engine, tokenizer, "def f(x):", 8)
        for name, body, status, param, text in CASES:
            r = httpx2.post(server.url + "/v1/completions", content=body(model),
                            headers={"Content-Type": "application/json"}, timeout=60)
            if status == 200:
                assert r.status_code == 200, (name, r.text[:300])
                if text == "greedy":  # a vanishing temperature or top_p samples the most likely token
                    assert r.json()["choices"][0]["text"] == greedy8, name
                continue
            error = openai_error(r, status)
            assert error["param"] == param, (name, error)
            assert text is None or text in error["message"], (name, error)
        # a body over the limit is refused from its Content-Length, before it is read
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n{" % (5 << 20))
            status, body = read_response(s)
            assert status == 413 and "--max-body-bytes" in json.loads(body)["error"]["message"], (status, body)
        for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405),
                                     ("POST", "/v1/chat/x", 404)):
            openai_error(httpx2.request(method, server.url + path, timeout=10), status)
        stream.join(120)
        assert streamed["text"] == greedy_alone(engine, tokenizer, prompt, 200)
        assert streamed["chunks"][-1]["choices"][0]["finish_reason"] in ("length", "stop")
        after = server.client.completions.create(model=model, prompt="def g(y):", max_tokens=12, temperature=0)
        assert after.choices[0].text == greedy_alone(engine, tokenizer, "def g(y):", 12)
        assert httpx2.get(server.url + "/health").status_code == 200
        assert "Traceback" not in server.output()
    finally:
        assert server.stop() == 0, server.output()


def test_an_error_in_one_requests_sampling_ends_that_request_only(ckpt, tokenizer, monkeypatch):
    """In-process server (uvicorn on a thread, the real app and scheduler) so the sampler can fail on purpose."""
    import uvicorn

    from plugins.launch.launcher import free_port
    from plugins.engine import sampling
    from plugins.http.app import Served, create_app
    from plugins.http.http_limits import Limits, limited_protocol
    from plugins.serving.engine import ServingEngine

    call = sampling.Sampler.__call__

    def failing(self, logits):
        if self.temperature == 1.25:  # this request's sampling raises, as a sampler bug would
            raise FloatingPointError("injected: probabilities are NaN")
        return call(self, logits)

    monkeypatch.setattr(sampling.Sampler, "__call__", failing)
    backend = load_backend("hf", ckpt, dtype="float32")
    engine = ServingEngine(backend, SLOTS, 256)
    served = Served(engine, tokenizer, "tiny", backend.config.vocab_size)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="warning",
                                           http=limited_protocol(Limits())))
    threads = [threading.Thread(target=engine.run), threading.Thread(target=server.run)]
    [t.start() for t in threads]
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        prompt = tokenizer.decode(prompt_token_ids(tokenizer, 7, 2))
        with ThreadPoolExecutor(3) as pool:
            good = pool.submit(stream_text, url,
                               {"model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0})
            time.sleep(0.1)
            bad = pool.submit(httpx2.post, url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "x = 1", "max_tokens": 20, "temperature": 1.25})
            bad_stream = pool.submit(stream_text, url, {"model": "tiny", "prompt": "y", "max_tokens": 20,
                                                        "temperature": 1.25})
            error = openai_error(bad.result(), 500)
            assert "this request failed: FloatingPointError: injected" in error["message"]
            _, chunks = bad_stream.result()
            assert "this request failed" in chunks[-1]["error"]["message"]
            assert good.result()[0] == greedy_alone(backend, tokenizer, prompt, 60)
        assert httpx2.get(url + "/health").json()["status"] == "ok"
        assert engine.state()["running"] == 0
        again = httpx2.post(url + "/v1/completions", json={"model": "tiny", "prompt": "z", "max_tokens": 5,
                                                           "temperature": 0.7, "seed": 1}, timeout=60)
        assert again.status_code == 200
    finally:
        server.should_exit = True
        threads[1].join(30)
        engine.close(timeout=5)
        threads[0].join(30)


def test_slow_clients_are_cut_and_normal_requests_are_served_meanwhile(ckpt, tokenizer):
    server = Server(ckpt, "--backend", "hf", "--kv-budget", KV_BUDGET, "--read-timeout", "2")
    model = Path(ckpt).name
    try:
        slow = []
        for i in range(50):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:  # the body trickles
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 4000\r\n\r\n{")
            else:  # the headers trickle
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        started = time.monotonic()
        for _ in range(3):  # served while the slow ones hold their connections (or are being cut)
            for s in slow:
                try:
                    s.sendall(b" ")
                except OSError:  # already cut: on a busy machine three requests may outlast the deadline
                    pass
            r = server.client.completions.create(model=model, prompt="def f():", max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
        for s in slow:  # cut by the read deadline: the server closed them
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - started < 15
        r = server.client.completions.create(model=model, prompt="def f():", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        log = server.output()
        assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
    finally:
        assert server.stop() == 0, server.output()


def test_a_non_streaming_client_that_leaves_frees_its_slot_and_bursts_fill_free_slots(ckpt, tokenizer):
    server = Server(ckpt, "--backend", "hf", "--kv-budget", KV_BUDGET, max_waiting=0)
    model = Path(ckpt).name
    try:
        body = json.dumps({"model": model, "prompt": tokenizer.decode(prompt_token_ids(tokenizer, 8, 1)),
                           "max_tokens": 240, "temperature": 0}).encode()
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while server.metric("mqa_requests_running") == 0:
            time.sleep(0.01)
        s.close()  # gone while its completion decodes
        deadline = time.monotonic() + 5
        while server.metric("mqa_requests_running") != 0:
            assert time.monotonic() < deadline, "the slot of a non-streaming client that left was not freed"
            time.sleep(0.02)
        assert server.metric('mqa_requests_finished_total{reason="cancelled"}') == 1

        # --max-waiting 0: a burst of as many requests as slots all fit (none waits for a slot)
        barrier = threading.Barrier(SLOTS)

        def ask(_):
            barrier.wait()
            return httpx2.post(server.url + "/v1/completions", timeout=120,
                               json={"model": model, "prompt": "def f():", "max_tokens": 30, "temperature": 0})

        with ThreadPoolExecutor(SLOTS) as pool:
            assert [r.status_code for r in pool.map(ask, range(SLOTS))] == [200] * SLOTS
        barrier = threading.Barrier(3 * SLOTS)
        with ThreadPoolExecutor(3 * SLOTS) as pool:
            codes = [r.status_code for r in pool.map(ask, range(3 * SLOTS))]
        assert codes.count(200) >= SLOTS and set(codes) <= {200, 503}
    finally:
        assert server.stop() == 0, server.output()


def test_a_killed_tp_rank_fails_health_at_once_clients_get_a_short_error_and_the_exit_is_nonzero(ckpt_factory,
                                                                                                 tokenizer):
    ckpt = ckpt_factory("tiny-mha")
    server = Server(ckpt, "--backend", "deepspeed", "--tp", "2", "--kv-budget", "1MB")
    model = Path(ckpt).name
    result = {}

    def stream():
        result["stream"] = stream_text(server.url, {"model": model, "prompt": "def f(x):", "max_tokens": 200,
                                                    "temperature": 0})

    try:
        ranks = {}
        for pid in descendants(server.proc.pid):
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
                cmd = Path(f"/proc/{pid}/cmdline").read_text()
            except OSError:
                continue
            if "plugins.launch.worker" in cmd and "RANK" in env and "torch.distributed.run" not in cmd:
                ranks[int(env["RANK"])] = pid
        assert set(ranks) == {0, 1}, ranks
        thread = threading.Thread(target=stream)
        thread.start()
        while server.metric("mqa_requests_running") == 0:
            time.sleep(0.01)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                if httpx2.get(server.url + "/health", timeout=2).status_code == 503:
                    break
            except httpx2.HTTPError:
                pytest.fail("the server went away before /health said 503")
            # the watcher polls every 0.2 s; without it /health would stay 200 until the next request
            assert time.monotonic() - killed < 5.0, "/health still 200 5 s after a rank died"
            time.sleep(0.02)
        thread.join(60)
        message = result["stream"][1][-1]["error"]["message"]
        assert "rank 1" in message and len(message) < 300 and "log" not in message, message
        assert server.proc.wait(60) != 0
        assert "rank 1" in server.output()
    finally:
        server.stop()


def test_requests_cut_at_the_graceful_timeout_end_with_an_error_body(ckpt_factory, tokenizer):
    ckpt = ckpt_factory("small")  # steps slow enough that 900 tokens outlast a 1 s graceful timeout
    server = Server(ckpt, "--backend", "hf", "--kv-budget", "64MB", graceful_timeout=1)
    model = Path(ckpt).name
    got = {}
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 900, "temperature": 0}

    def plain():
        got["plain"] = httpx2.post(server.url + "/v1/completions", json=body, timeout=120)

    def streamed():
        got["stream"] = stream_text(server.url, body)

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    [t.start() for t in threads]
    while server.metric("mqa_requests_running") < 2:
        time.sleep(0.02)
    assert server.stop() == 0, server.output()
    [t.join(60) for t in threads]
    error = openai_error(got["plain"], 503)
    assert "graceful timeout" in error["message"]
    assert "graceful timeout" in got["stream"][1][-1]["error"]["message"]
    assert "2 unfinished request(s) failed" in server.output()


def test_json_depth_scan_skips_strings():
    from plugins.http.api import json_depth

    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, [2, {"c": "]]]"}]]}') <= 32
    nested = b'{"p": ' + b"[" * 40 + b'"\\"[["' + b"]" * 40 + b"}"
    assert json_depth(nested) == 33  # stops counting just past the limit
    assert json_depth(b'["' + b"[" * 100 + b'"]') == 1


def test_max_token_bytes_bounds_every_token(tokenizer):
    from plugins.http.served import max_token_bytes

    bound = max_token_bytes(tokenizer)
    longest = max(len(tokenizer.decode([i], skip_special_tokens=False).encode())
                  for i in range(tokenizer.get_vocab_size()))
    assert longest <= bound


def test_while_nothing_runs_a_step_waits_for_the_requests_on_their_way(ckpt, tokenizer, monkeypatch):
    """A burst's first step waits for its requests still being read or tokenized, so they share it."""
    import asyncio

    from plugins.serving import scheduler
    from plugins.serving.engine import ResultQueue, ServingEngine
    from plugins.serving.request import Request

    monkeypatch.setattr(scheduler, "GATHER_MAX_S", 60.0)  # here the wait ends with the arrival, not the clock
    engine = ServingEngine(load_backend("hf", ckpt, dtype="float32"), SLOTS, 256)
    thread = threading.Thread(target=engine.run)
    thread.start()

    async def finish(q) -> list[int]:
        tokens = []
        while True:
            item = await q.queue.get()
            assert item[0] == "tokens", item
            tokens += item[1]
            if item[3] is not None:
                return tokens

    async def burst():
        loop = asyncio.get_running_loop()
        on_its_way = engine.arrival()  # the second request, being tokenized
        first = ResultQueue(Request(id=engine.new_id(), prompt=prompt_token_ids(tokenizer, 9, 1), max_tokens=3), loop)
        engine.submit(first, arrival=engine.arrival())
        await asyncio.sleep(0.5)
        assert first.first_token is None  # not computed alone: the step waits for the one on its way
        second = ResultQueue(Request(id=engine.new_id(), prompt=prompt_token_ids(tokenizer, 12, 2), max_tokens=3),
                             loop)
        engine.submit(second, arrival=on_its_way)
        assert await finish(first) and await finish(second)
        assert first.first_token == second.first_token  # delivered by one step
        alone = ResultQueue(Request(id=engine.new_id(), prompt=prompt_token_ids(tokenizer, 5, 3), max_tokens=2), loop)
        engine.submit(alone, arrival=engine.arrival())  # nothing else on its way: no wait
        assert len(await asyncio.wait_for(finish(alone), 30)) == 2

    try:
        asyncio.run(burst())
    finally:
        engine.close(timeout=5)
        thread.join(30)
