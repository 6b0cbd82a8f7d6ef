"""The load side of the serving benchmarks: the server as a child process, and streaming HTTP clients
(closed loop, open loop with Poisson arrivals) that time every request's chunks."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from plugins.launch.launcher import free_port
from plugins.serving.args import serve_flags

READY_TIMEOUT_S = 900.0  # a first start may build the CPU kernels (minutes)
STOP_TIMEOUT_S = 60.0
# Longest silence tolerated inside one response: a request queued behind a full KV pool on 2 CPU cores
# can wait minutes for its first token.
READ_TIMEOUT_S = 1800.0


def results_dir(out: Path | None, name: str) -> Path:
    """`out`, or results/<name>-<timestamp>; made now."""
    out = out or Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def percentile(values, q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Req:
    index: int
    prompt: str            # what is sent
    prompt_ids: list[int]  # what the server encodes it to (the static phase feeds these)
    max_tokens: int


def make_requests(tok, prompt_len: int, max_tokens: list[int]) -> list[Req]:
    """Real-code windows of `prompt_len` tokens, decoded to text. Decoding and re-encoding a window cut
    from the middle of a file may not give back the same ids, so each prompt is re-encoded here, as the
    server will: both engines then see the very same tokens."""
    from plugins.core.tokenizer import prompt_token_ids

    reqs = []
    for i, n in enumerate(max_tokens):
        text = tok.decode(prompt_token_ids(tok, prompt_len, i))
        reqs.append(Req(i, text, tok.encode(text).ids, n))
    return reqs


# --- the server, as a subprocess -----------------------------------------------------------------

class ServerProcess:
    """`python -m plugins.http` in its own session (process group), so stopping it also stops its TP workers."""

    def __init__(self, args, max_model_len: int, log_path: Path, prefix_cache: int = 0):
        from plugins.core.config import REPO_ROOT

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "plugins.http", str(args.checkpoint_dir), "--backend", args.backend,
               "--dtype", args.dtype, "--tp", str(args.tp), "--kv-budget", str(args.kv_budget),
               "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
               # the mixed phase sends every request at once: none may be refused for a full queue
               "--max-waiting", str(max(256, args.requests)),
               # continuous vs static batching at the same batch size, unless asked otherwise
               "--max-batch", str(args.max_batch or args.streams),
               # off by default: phases repeat prompts, and reuse would flatter the server (bench_prefix
               # measures reuse)
               "--prefix-cache", str(prefix_cache), *serve_flags(args)]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            try:
                r = httpx2.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx2.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> int | None:
        """SIGTERM (graceful: uvicorn drains, the backend closes), then SIGKILL to the group after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def server_counters(url: str) -> dict:
    """Engine steps and generated tokens so far (/metrics): their ratio over a phase is the mean batch."""
    try:
        text = httpx2.get(url + "/metrics", timeout=30).text
    except httpx2.HTTPError:
        text = ""  # the phase's own numbers stand without it
    found = {}
    for name in ("mqa_decode_steps_total", "mqa_generation_tokens_total"):
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        found[name] = float(m.group(1)) if m else None
    return found


def server_health(url: str) -> dict:
    try:
        r = httpx2.get(url + "/health", timeout=30)
    except httpx2.HTTPError as e:
        raise RuntimeError(f"no server at {url}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{url}/health answered {r.status_code}: {r.text[:300]}")
    return r.json()


def served_model(url: str) -> str:
    return httpx2.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# --- clients --------------------------------------------------------------------------------------

def http_client(connections: int):
    # Idle connections are dropped after 3 s, before uvicorn closes them (5 s): reusing one the server is
    # closing would fail a request that did nothing wrong.
    return httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=READ_TIMEOUT_S, pool=None),
                              limits=httpx2.Limits(max_connections=connections + 4, keepalive_expiry=3.0))


async def open_connections(client, url: str, n: int) -> None:
    """Connect before the clock starts: `n` concurrent GETs leave `n` kept-alive connections in the pool,
    so TTFT does not include the TCP handshake (a long-lived client's connections are already open)."""
    await asyncio.gather(*(client.get(url + "/health") for _ in range(n)))


async def stream_one(client, url: str, model: str, req: Req, t0: float) -> dict:
    """One streamed completion; every time is taken when its SSE line arrives."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    rec = {"index": req.index, "max_tokens": req.max_tokens, "prompt_tokens": None, "tokens": 0, "status": None,
           "error": None, "finish_reason": None, "sent_s": None, "ttft_s": None, "itl_s": [], "latency_s": None}
    text_at, first_event, done = [], None, False
    start = time.perf_counter()
    rec["sent_s"] = start - t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["error"] = f"error event: {event['error'].get('message')}"
                        break
                    if event.get("usage"):
                        rec["tokens"] = event["usage"]["completion_tokens"]
                        rec["prompt_tokens"] = event["usage"]["prompt_tokens"]
                    for choice in event.get("choices", []):
                        first_event = first_event or now
                        if choice.get("text"):
                            text_at.append(now)
                        rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
    except (httpx2.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_s"] = time.perf_counter() - start
    if rec["error"] is None and not (done and rec["prompt_tokens"] is not None):
        rec["error"] = "the stream ended without a usage chunk and [DONE]"
    # The first token may be EOS (no text at all): then the first chunk marks it.
    first = text_at[0] if text_at else first_event
    rec["ttft_s"] = first - start if first is not None else None
    rec["itl_s"] = [b - a for a, b in zip(text_at, text_at[1:])]
    return rec


async def closed_loop(url: str, model: str, reqs: list[Req], streams: int) -> tuple[list[dict], float]:
    """`streams` clients share one queue of requests; each sends the next as soon as its last one is done."""
    queue = iter(reqs)  # one event loop: next() on a shared iterator needs no lock
    records = []
    async with http_client(streams) as client:
        await open_connections(client, url, min(streams, len(reqs)))
        t0 = time.perf_counter()

        async def stream():
            for req in queue:
                records.append(await stream_one(client, url, model, req, t0))

        await asyncio.gather(*(stream() for _ in range(min(streams, len(reqs)))))
        wall = time.perf_counter() - t0
    return sorted(records, key=lambda r: r["index"]), wall


async def open_loop(url: str, model: str, reqs: list[Req], rate: float, seed: int) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` req/s: exponential gaps, drawn up front (seeded), first request at t=0.
    Requests are sent on schedule whatever the server's state, so queueing shows up in TTFT."""
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in reqs[1:]:
        offsets.append(offsets[-1] + rng.expovariate(rate))
    async with http_client(len(reqs)) as client:
        await open_connections(client, url, len(reqs))
        t0 = time.perf_counter()

        async def send(offset, req):
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await stream_one(client, url, model, req, t0)

        records = await asyncio.gather(*(send(o, r) for o, r in zip(offsets, reqs)))
        wall = time.perf_counter() - t0  # first send to last finish
    return list(records), wall
