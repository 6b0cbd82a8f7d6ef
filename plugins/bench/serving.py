"""Benchmark the completions server under load, over real HTTP, against static batching on the same engine.
Run as `python -m plugins.bench.serving` or `scripts/bench_serve.py`.

  python -m plugins.bench.serving checkpoints/santacoder-1b                  # deepspeed bf16, rates 0.25 0.5 1
  python -m plugins.bench.serving checkpoints/santacoder-1b --rates 0.1 0.2 --requests 32 --max-tokens 16 128
  python -m plugins.bench.serving /tmp/tiny --dtype float32 --requests 4 --streams 2 --max-tokens 4 12 \\
      --stream-tokens 8 --prompt-len 16 --out /tmp/serve-tiny
  python -m plugins.bench.serving checkpoints/santacoder-1b --url http://127.0.0.1:8000   # a server already up

Phases, in this order (one engine at a time: the server is stopped before the in-process one loads):
  concurrent   --streams closed-loop clients, each sending its next request as soon as its last one is
               done, --stream-tokens tokens each, --requests in all: the server's saturated throughput.
  open loop    per --rates value, --requests requests arriving as a Poisson process (seeded), max_tokens
               uniform in --max-tokens (seeded, the same set at every rate): TTFT, inter-token latency,
               end-to-end latency and throughput as the load grows.
  mixed        the open loop's request set, all sent at once: the server's throughput on it.
  static       the same set through `Backend.generate` in batches of --streams, each batch running to its
               longest request (what serving without continuous batching does), and one batch of
               --streams x --stream-tokens for the decode rate the concurrent phase competes with.

Requests are greedy (temperature 0) real-code prompts of --prompt-len tokens, sent as text (the server
re-encodes them; the token counts it reports are the ones used). TTFT runs from sending the request to
its first SSE chunk with text; inter-token latency is the gap between consecutive text chunks of one
request (a chunk holds the text of one or more tokens: text is released as it becomes final).

Writes results/serve-<timestamp>/{serve.json, serve.md, latency_vs_load.png, server.log} and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from plugins.core.console import add_engine_args
from plugins.core.launcher import free_port

from .serving_report import ratios, summary, write_markdown, write_plot

READY_TIMEOUT_S = 900.0  # a first start may build the CPU kernels (minutes)
STOP_TIMEOUT_S = 60.0
# Longest silence tolerated inside one response: a request queued behind a full KV pool on 2 CPU cores
# can wait minutes for its first token.
READ_TIMEOUT_S = 1800.0


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
    """`python -m plugins.serve` in its own session (process group), so stopping it also stops its TP workers."""

    def __init__(self, args, max_model_len: int, log_path: Path, prefix_cache: int = 0):
        from plugins.core.config import REPO_ROOT

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "plugins.serve", str(args.checkpoint_dir), "--backend", args.backend,
               "--dtype", args.dtype, "--tp", str(args.tp), "--kv-budget", str(args.kv_budget),
               "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
               # the mixed phase sends every request at once: none may be refused for a full queue
               "--max-waiting", str(max(256, args.requests)),
               # continuous vs static batching at the same batch size, unless asked otherwise
               "--max-batch", str(args.max_batch or args.streams),
               # off by default: phases repeat prompts, and reuse would flatter the server (bench_prefix
               # measures reuse)
               "--prefix-cache", str(prefix_cache)]
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


def summarize(records: list[dict], wall_s: float, before: dict | None = None, after: dict | None = None) -> dict:
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [x for r in ok for x in r["itl_s"]]
    latency = [r["latency_s"] for r in ok]
    out = {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok), "tokens": tokens,
           "tokens_requested": sum(r["max_tokens"] for r in records), "wall_s": wall_s,
           "throughput_tok_s": tokens / wall_s, "req_per_s": len(ok) / wall_s}
    for name, values in (("ttft", ttft), ("itl", itl), ("latency", latency)):
        out[f"{name}_p50_s"], out[f"{name}_p99_s"] = percentile(values, 50), percentile(values, 99)
    steps = tokens_per_step = None
    if before and after and None not in before.values() and None not in after.values():
        steps = after["mqa_decode_steps_total"] - before["mqa_decode_steps_total"]
        made = after["mqa_generation_tokens_total"] - before["mqa_generation_tokens_total"]
        tokens_per_step = made / steps if steps else None
    out["engine_steps"], out["tokens_per_step"] = steps, tokens_per_step
    return out


def run_phase(server, url: str, model: str, coro_fn, *args) -> dict:
    before = server_counters(url)
    records, wall = asyncio.run(coro_fn(url, model, *args))
    if server is not None and server.proc.poll() is not None:
        raise RuntimeError(f"the server exited ({server.proc.returncode}) during the phase:\n{server.tail()}")
    return {**summarize(records, wall, before, server_counters(url)), "records": records}


# --- static batching, in process -------------------------------------------------------------------

def run_static(args, mixed: list[Req], decode: list[Req]) -> dict:
    """The mixed set in batches of --streams (each to its longest request), then one decode batch."""
    from plugins.core.backend import load_backend
    from plugins.core.console import announce
    from plugins.core.tokenizer import left_pad

    announce(f"static: loading {args.checkpoint_dir} in process on {args.backend} ({args.dtype}, tp {args.tp})")
    backend = load_backend(args.backend, args.checkpoint_dir, dtype=args.dtype, tp_size=args.tp)
    try:
        ids, mask = left_pad([r.prompt_ids for r in decode[:2]])
        backend.generate(ids, mask, 2)  # warm-up: first-call allocations and kernel choices
        batches = []
        for start in range(0, len(mixed), args.streams):
            batch = mixed[start:start + args.streams]
            ids, mask = left_pad([r.prompt_ids for r in batch])
            longest = max(r.max_tokens for r in batch)
            t = time.perf_counter()
            res = backend.generate(ids, mask, longest)
            wall = time.perf_counter() - t
            batches.append({"size": len(batch), "max_new_tokens": longest, "wall_s": wall, "prefill_s": res.prefill_s,
                            "useful_tokens": sum(r.max_tokens for r in batch), "generated_tokens": len(batch) * longest,
                            "mean_step_s": statistics.fmean(res.step_s) if res.step_s else None})
        useful = sum(b["useful_tokens"] for b in batches)
        wall = sum(b["wall_s"] for b in batches)

        ids, mask = left_pad([r.prompt_ids for r in decode])
        t = time.perf_counter()
        res = backend.generate(ids, mask, args.stream_tokens)
        dwall = time.perf_counter() - t
        step = statistics.fmean(res.step_s)
        return {"batch_size": args.streams, "batches": batches, "useful_tokens": useful,
                "generated_tokens": sum(b["generated_tokens"] for b in batches), "wall_s": wall,
                "useful_tok_s": useful / wall,
                "decode": {"batch_size": len(decode), "new_tokens": args.stream_tokens, "wall_s": dwall,
                           "prefill_s": res.prefill_s, "mean_step_s": step, "decode_tok_s": len(decode) / step,
                           "end_to_end_tok_s": len(decode) * args.stream_tokens / dwall,
                           "kv_cache_bytes": res.kv_cache_bytes}}
    finally:
        backend.close()


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "server KV pool per rank")
    ap.add_argument("--max-batch", type=int, help="the server's most concurrent sequences (default --streams; "
                                                  "its KV budget may allow fewer)")
    ap.add_argument("--max-model-len", type=int,
                    help="server context per slot (default: the longest prompt + the most tokens asked for)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="open loop: requests/s")
    ap.add_argument("--requests", type=int, default=24, help="requests per phase (and per rate)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                    help="open loop and mixed: max_tokens uniform in MIN..MAX")
    ap.add_argument("--stream-tokens", type=int, default=64, help="concurrent phase: max_tokens of every request")
    ap.add_argument("--streams", type=int, default=16, help="concurrent clients, and the static batch size")
    ap.add_argument("--seed", type=int, default=0, help="seeds max_tokens and the arrival times")
    ap.add_argument("--no-static", action="store_true", help="skip the in-process static-batching phase")
    ap.add_argument("--url", help="benchmark this running server instead of starting one (e.g. "
                    "http://127.0.0.1:8000); it stays up, idle, during the static phase (--no-static skips that)")
    ap.add_argument("--out", type=Path, help="output dir (default results/serve-<timestamp>)")
    args = ap.parse_args(argv)

    from plugins.core.backend import BACKENDS, resolve_dtype
    from plugins.core.checkpoint import read_hf_config
    from plugins.core.config import ConfigError, check_tp

    try:
        config = read_hf_config(args.checkpoint_dir)
        if args.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {args.backend!r}; known: {', '.join(BACKENDS)}")
        resolve_dtype(args.dtype)
        check_tp(config, args.tp)
    except (ConfigError, OSError, ValueError) as e:
        ap.error(str(e))
    lo, hi = args.max_tokens
    for name, value in (("--requests", args.requests), ("--streams", args.streams), ("--prompt-len", args.prompt_len),
                        ("--max-tokens MIN", lo), ("--max-batch", 1 if args.max_batch is None else args.max_batch)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    if lo > hi:
        ap.error(f"--max-tokens MIN ({lo}) is larger than MAX ({hi})")
    if args.stream_tokens < 2:
        ap.error(f"--stream-tokens must be >= 2 (a decode step needs a token after the first), "
                 f"got {args.stream_tokens}")
    bad = [r for r in args.rates if not (r > 0 and math.isfinite(r))]
    if bad:
        ap.error(f"--rates must be positive request rates, got {bad[0]}")
    if args.url and not re.match(r"https?://[^/]+", args.url):
        ap.error(f"--url must be http(s)://host:port, got {args.url!r}")
    args.url = args.url.rstrip("/") if args.url else None
    need = args.prompt_len + max(hi, args.stream_tokens)
    if need > config.n_positions:
        ap.error(f"--prompt-len {args.prompt_len} + {max(hi, args.stream_tokens)} new tokens exceeds the model's "
                 f"context ({config.n_positions})")
    if args.max_model_len is not None and not 2 <= args.max_model_len <= config.n_positions:
        ap.error(f"--max-model-len must be in 2..{config.n_positions}, got {args.max_model_len}")
    return ap, args, config


def main(argv=None) -> int:
    ap, args, config = parse_args(argv)
    from plugins.core.console import announce, quiet_upstream

    quiet_upstream()
    from plugins.core.config import REPO_ROOT
    from plugins.core.tokenizer import checkpoint_tokenizer

    # Every request is made (and its length known) before anything starts: a bad length is an argument error.
    try:
        tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    except ValueError as e:  # its ids do not fit the model
        ap.error(str(e))
    lo, hi = args.max_tokens
    rng = random.Random(args.seed)
    try:
        mixed = make_requests(tok, args.prompt_len, [rng.randint(lo, hi) for _ in range(args.requests)])
        concurrent = make_requests(tok, args.prompt_len, [args.stream_tokens] * args.requests)
        decode = make_requests(tok, args.prompt_len, [args.stream_tokens] * args.streams)
    except ValueError as e:  # longer than the prompt corpus
        ap.error(str(e))
    lengths = [len(r.prompt_ids) for r in mixed + concurrent + decode]
    need = max(lengths) + max(hi, args.stream_tokens)
    max_model_len = args.max_model_len or need
    if need > max_model_len or need > config.n_positions:
        ap.error(f"prompts re-encode to up to {max(lengths)} tokens: with {max(hi, args.stream_tokens)} new tokens "
                 f"they need a context of {need} (--max-model-len {max_model_len}, n_positions {config.n_positions})")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO_ROOT / "results" / f"serve-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    result = {"timestamp": stamp, "model": None,
              "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "max_model_len": max_model_len},
              "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
              "server": {"url": args.url, "started": args.url is None}, "phases": {}}
    server = None
    try:
        if args.url is None:
            server = ServerProcess(args, max_model_len, out / "server.log")
            announce(f"starting the server on {server.url} (log: {out / 'server.log'})")
            result["server"]["url"] = server.url
        url = result["server"]["url"]
        health = server.wait_ready() if server else server_health(url)
        result["server"]["health"] = health
        model = result["model"] = served_model(url)
        announce(f"server ready: {health['slots']} slots x {health['capacity']} tokens; warm-up request")
        warm_up = Req(-1, mixed[0].prompt, mixed[0].prompt_ids, min(4, hi))
        warm = asyncio.run(closed_loop(url, model, [warm_up], 1))[0][0]
        if warm["error"]:
            raise RuntimeError(f"the warm-up request failed: {warm['error']}")

        ph = result["phases"]
        announce(f"concurrent: {args.streams} streams x {args.stream_tokens} tokens, {args.requests} requests")
        ph["concurrent"] = run_phase(server, url, model, closed_loop, concurrent, args.streams)
        ph["open_loop"] = []
        for i, rate in enumerate(args.rates):
            announce(f"open loop: {rate:g} req/s, {args.requests} requests (~{args.requests / rate:.0f} s of arrivals)")
            # the same requests at every rate; each rate its own arrival times
            phase = run_phase(server, url, model, open_loop, mixed, rate, args.seed + 1 + i)
            ph["open_loop"].append({"rate": rate, **phase})
        announce(f"mixed: {args.requests} requests at once")
        ph["mixed"] = run_phase(server, url, model, closed_loop, mixed, len(mixed))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            # before the static phase: two engines must never share the cores
            result["server"]["exit_code"] = server.stop()
            announce(f"server stopped (exit status {result['server']['exit_code']})")

    from . import probes

    result["machine"] = probes.environment()
    write_outputs(out, result)  # the server's numbers are kept even if the static phase fails
    if not args.no_static:
        result["phases"]["static"] = run_static(args, mixed, decode)
        write_outputs(out, result)
    print("\n".join(summary(result, out)))
    return 0


def write_outputs(out: Path, result: dict) -> None:
    result["ratios"] = ratios(result)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "serve.md", result)
    write_plot(out / "latency_vs_load.png", result)


if __name__ == "__main__":
    sys.exit(main())
