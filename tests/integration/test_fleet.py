"""`mqa-fleet`, live on 127.0.0.1: two mqa-serve replicas behind the real vllm-router. Answers through
the router equal `generate` alone; an editor's trace (one file growing, a second interleaved) hits the
replicas' prefix caches with the cache-aware policy more than with round robin; a replica killed with
SIGKILL ends its own streams with an error, the router sends the next requests to the other, and
stopping the fleet leaves no process behind."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
import torch
from live_server import REPO, descendants

from plugins.core.tokenizer import PROMPTS_FILE, prompt_token_ids
from plugins.launch.launcher import free_port
from plugins.engine.registry import load_backend

FILE_TOKENS = 1024


class FleetProcess:
    def __init__(self, log_path: Path, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        cmd = [sys.executable, "-m", "plugins.fleet", *args, "--port", str(self.port), "--health-check-interval", "1"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while "serving on" not in self.output():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.5)
        self.workers = re.search(r"over (.*) \(Ctrl-C", self.output())[1].split(", ")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def counters(urls: list[str]) -> dict[str, float]:
    """Prefix-cache and prompt counters summed over the replicas' /metrics."""
    names = ("mqa_prefix_cache_lookups_total", "mqa_prefix_cache_hits_total", "mqa_prefix_cache_reused_tokens_total",
             "mqa_prompt_tokens_total", "mqa_prefill_tokens_total")
    total = dict.fromkeys(names, 0.0)
    for url in urls:
        text = httpx2.get(url + "/metrics").text
        for name in names:
            total[name] += float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
    return total


@pytest.fixture(scope="module")
def long_ckpt(ckpt_factory):
    return ckpt_factory("tiny", n_positions=2048)


@pytest.fixture(scope="module")
def fleet(long_ckpt):
    f = FleetProcess(Path(long_ckpt).parent / "fleet.log", str(long_ckpt), "--replicas", "2", "--dtype", "float32",
                     "--log-dir", str(Path(long_ckpt).parent / "fleet-logs"))
    yield f
    assert f.stop() == 0, f.output()
    assert not descendants(f.proc.pid), "processes left behind"


def complete(url, model, prompt, n, **extra):
    r = httpx2.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_requests_through_the_router_equal_generate_alone(fleet, long_ckpt, tokenizer):
    model = Path(long_ckpt).name
    ids = [prompt_token_ids(tokenizer, 5 + 7 * i, i) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete(fleet.url, model, p, 6, logprobs=0), ids))
    engine = load_backend("deepspeed", long_ckpt, dtype="float32")
    for i, answer in enumerate(answers):
        t = torch.tensor([ids[i]])
        new = engine.generate(t, torch.ones_like(t), 6).tokens[0, len(ids[i]):].tolist()
        assert answer["logprobs"]["tokens"] == [tokenizer.decode([x], skip_special_tokens=False) for x in new], i
    served = counters(fleet.workers)["mqa_prompt_tokens_total"]
    assert served >= sum(map(len, ids))  # every request reached a replica (and both replicas answer /metrics)


def editor_trace(tokenizer, first: int) -> list[str]:
    """16 versions of one file growing by 4 tokens per request, and 8 of a second file, interleaved
    A A B A A B ...: text prompts, as an IDE plugin sends them."""
    ids = tokenizer.encode(PROMPTS_FILE.read_text()).ids
    a, b = ids[first:first + FILE_TOKENS + 64], ids[first + 2000:first + 2000 + FILE_TOKENS + 64]
    texts, ai, bi = [], 0, 0
    for k in range(24):
        if k % 3 == 2:
            texts.append(tokenizer.decode(b[:FILE_TOKENS + 4 * bi]))
            bi += 1
        else:
            texts.append(tokenizer.decode(a[:FILE_TOKENS + 4 * ai]))
            ai += 1
    return texts


def run_trace(url, model, texts) -> None:
    for text in texts:  # one editor: each request after the previous answer
        complete(url, model, text, 2)


def hit_rates(before, after) -> tuple[float, float, float]:
    d = {k: after[k] - before[k] for k in after}
    return (d["mqa_prefix_cache_hits_total"] / d["mqa_prefix_cache_lookups_total"],
            d["mqa_prefix_cache_reused_tokens_total"] / d["mqa_prompt_tokens_total"], d["mqa_prefill_tokens_total"])


def test_editor_trace_hits_the_prefix_cache_with_cache_aware_routing(fleet, long_ckpt, tokenizer):
    model = Path(long_ckpt).name
    before = counters(fleet.workers)
    run_trace(fleet.url, model, editor_trace(tokenizer, 0))
    aware = hit_rates(before, counters(fleet.workers))
    # the same replicas behind a second router, round robin (a fleet that starts no replica), other files
    rr = FleetProcess(Path(long_ckpt).parent / "fleet-rr.log", "--replicas", "0", "--workers", *fleet.workers,
                      "--policy", "round_robin")
    try:
        before = counters(fleet.workers)
        run_trace(rr.url, model, editor_trace(tokenizer, 6000))
        robin = hit_rates(before, counters(fleet.workers))
    finally:
        assert rr.stop() == 0, rr.output()
    print(f"\nprefix-cache hit rate (requests, tokens) / prompt tokens computed: cache_aware {aware}, "
          f"round_robin {robin}")
    assert aware[0] >= 0.9, aware  # only each file's first request misses
    assert aware[0] > robin[0] and aware[2] < robin[2], (aware, robin)  # round robin misses once per file and replica


def test_a_killed_replica_fails_its_streams_alone_and_the_router_routes_around_it(fleet, long_ckpt, tokenizer):
    model = Path(long_ckpt).name
    ends: dict[int, str] = {}
    started = threading.Barrier(5)

    def stream(i):
        try:
            with httpx2.stream("POST", fleet.url + "/v1/completions", timeout=120, json={
                    "model": model, "prompt": prompt_token_ids(tokenizer, 8, 50 + i), "max_tokens": 1800,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data:"):
                        break
                started.wait(60)
                for line in lines:
                    if '"error"' in line:
                        ends[i] = "error"
                        return
                    if line == "data: [DONE]":
                        ends[i] = "done"
                        return
                ends[i] = "cut"  # the connection ended without [DONE]
        except httpx2.HTTPError:
            ends[i] = "cut"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)
    running = [httpx2.get(u + "/health").json()["running"] for u in fleet.workers]
    # what a load-balancing router reads of each replica: the requests it holds
    assert [httpx2.get(u + "/get_load").json()["load"] for u in fleet.workers] == running
    assert sum(running) == 4
    victim = max(range(2), key=lambda i: running[i])
    port = fleet.workers[victim].rsplit(":", 1)[1]
    pid = next(p for p in descendants(fleet.proc.pid)
               if f"--port {port}" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " "))
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    assert list(ends.values()).count("done") == 4 - running[victim], (running, ends)
    survivor = fleet.workers[1 - victim]
    before = counters([survivor])["mqa_prompt_tokens_total"]
    # the router learns of the death from its health check (every second here): until then a request
    # may still be sent to the dead replica and fail; how soon depends on the machine's load, so wait
    # for the first answer instead of a fixed time
    deadline = time.monotonic() + 60
    while httpx2.post(fleet.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt_token_ids(tokenizer, 10, 70), "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}).status_code != 200:
        assert time.monotonic() < deadline, "the router kept routing to the dead replica"
        time.sleep(0.5)
    for i in range(1, 6):
        complete(fleet.url, model, prompt_token_ids(tokenizer, 10, 70 + i), 3)
    assert counters([survivor])["mqa_prompt_tokens_total"] == before + 60
    assert f"replica {victim} ({fleet.workers[victim]}) exited with code -9" in fleet.output()


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "0"], "nothing to route to"),
    (["--replicas", "2"], "--replicas needs the CHECKPOINT"),
    (["CKPT", "--tp", "3"], "mqa-serve: error: tp_size 3 does not divide n_head 4"),
    (["CKPT", "--port", "1", "--max-model-len", "99999"], "--max-model-len must be in"),
    (["CKPT", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--tp", "2"], "spread TP over machines"),
    (["--replicas", "0", "--workers", "127.0.0.1:1"], "takes URLs"),
])
def test_bad_fleet_flags_fail_before_any_replica_starts(long_ckpt, argv, message, capsys):
    from plugins.fleet.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([str(long_ckpt) if a == "CKPT" else a for a in argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
