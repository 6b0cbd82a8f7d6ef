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
import random
import re
import statistics
import sys
import time
from pathlib import Path


from plugins.bench.serving_report import ratios, summary, write_markdown, write_plot
from plugins.serving.args import add_engine_args, engine_options
from plugins.bench.load import (Req, ServerProcess, closed_loop, make_requests, open_loop, percentile, server_counters,
                                server_health, served_model)

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
    from plugins.core.console import announce
    from plugins.core.tokenizer import left_pad
    from plugins.engine.registry import load_backend

    announce(f"static: loading {args.checkpoint_dir} in process on {args.backend} ({args.dtype}, tp {args.tp})")
    backend = load_backend(args.backend, args.checkpoint_dir, dtype=args.dtype, tp_size=args.tp,
                           **engine_options(args))
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

    from plugins.core.checkpoint import read_hf_config
    from plugins.core.config import ConfigError, check_tp
    from plugins.core.tensors import resolve_dtype
    from plugins.engine.registry import BACKENDS

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
    from plugins.core.console import announce, exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
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

    from plugins.bench import probes
    from plugins.core.tensors import resolve_dtype

    result["machine"] = probes.environment(resolve_dtype(args.dtype))
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
