"""Benchmark chunked prefill: long prompts arriving while streams decode, at several token budgets.
Run as `python -m plugins.bench.chunked`.

  python -m plugins.bench.chunked /tmp/mqa/santacoder-1b                  # deepspeed bf16, budgets 0 64 128 256 512
  python -m plugins.bench.chunked /tmp/tiny --dtype float32 --budgets 0 16 --streams 2 --stream-tokens 16 \\
      --long 2 --long-prompt 64 --out /tmp/chunked-tiny

Workload, once per --budgets value (one server each, `--max-num-batched-tokens BUDGET`; 0 = whole
prompts; prefix cache off): --streams greedy streams of --stream-prompt + --stream-tokens tokens start
together; once they all have their first token, --long requests of --long-prompt tokens arrive
--long-gap seconds apart. Reported: the streams' inter-token latency (p50, p99, max: how long a
prompt stalls them), TTFT of the long requests, output tokens/s over the run, and the server's step
time by phase (/metrics: prefill alone, decode alone, or both in one forward).
Prints a table and writes results/chunked-<timestamp>/{chunked.json, server-*.log}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx2

from plugins.bench.load import (Req, ServerProcess, http_client, make_requests, open_connections, percentile,
                                results_dir, served_model, stream_one)
from plugins.serving.args import add_engine_args, token_budget


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "server KV pool per rank (default 1GB)")
    ap.add_argument("--budgets", type=token_budget, nargs="+", default=[0, 64, 128, 256, 512],
                    help="--max-num-batched-tokens values (0: no chunking; auto: from measured step times)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=128)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=3, help="long requests")
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--long-gap", type=float, default=3.0, help="seconds between long arrivals")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("streams", "stream_prompt", "stream_tokens", "long", "long_prompt", "long_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min((b for b in args.budgets if b != "auto"), default=0) < 0:
        ap.error("--budgets must be >= 0")
    return args


async def workload(url: str, model: str, streams: list[Req], longs: list[Req], gap: float) -> tuple[list, list, float]:
    async with http_client(len(streams) + len(longs)) as client:
        await open_connections(client, url, len(streams) + len(longs))
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream_one(client, url, model, r, t0)) for r in streams]
        # the long prompts come once every stream decodes: wait for their first tokens (server metric)
        while not all(t.done() for t in tasks):
            page = await client.get(url + "/metrics")
            if metric(page, "mqa_requests_running") >= len(streams) and metric(page, "mqa_requests_waiting") == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)

        async def late(i, req):
            await asyncio.sleep(i * gap)
            return await stream_one(client, url, model, req, t0)

        long_records = await asyncio.gather(*(late(i, r) for i, r in enumerate(longs)))
        stream_records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return stream_records, long_records, wall


def metric(response, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", response.text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def step_times(url: str) -> dict:
    text = httpx2.get(url + "/metrics", timeout=30).text
    out = {}
    for phase in ("prefill", "decode", "mixed"):
        found = {k: float(v) for k, v in re.findall(rf'^mqa_step_seconds_(sum|count){{phase="{phase}"}} (\S+)$',
                                                     text, re.MULTILINE)}
        out[f"{phase}_steps"], out[f"{phase}_s"] = found.get("count", 0.0), found.get("sum", 0.0)
    chunks = dict(re.findall(r"^mqa_step_prefill_tokens_(sum|count) (\S+)$", text, re.MULTILINE))
    zero = re.search(r'^mqa_step_prefill_tokens_bucket{le="0.0"} (\S+)$', text, re.MULTILINE)
    out["chunk_tokens"] = float(chunks.get("sum", 0))
    out["chunk_steps"] = float(chunks.get("count", 0)) - (float(zero.group(1)) if zero else 0.0)
    return out


def run_budget(args, budget: int, streams: list[Req], longs: list[Req], out: Path) -> dict:
    from plugins.core.console import announce

    longest = max(args.stream_prompt + args.stream_tokens, args.long_prompt + args.long_tokens) + 8
    ns = argparse.Namespace(**{**vars(args), "max_num_batched_tokens": budget, "requests": len(streams) + len(longs),
                               "streams": len(streams) + len(longs), "max_batch": len(streams) + len(longs)})
    server = ServerProcess(ns, longest, out / f"server-{budget}.log", prefix_cache=0)
    try:
        server.wait_ready()
        model = served_model(server.url)
        warm = Req(-1, streams[0].prompt, streams[0].prompt_ids, 2)
        asyncio.run(workload(server.url, model, [warm], [], 0))
        announce(f"budget {budget or 'off'}: {len(streams)} streams, {len(longs)} x {args.long_prompt}-token prompts")
        before = step_times(server.url)
        srecs, lrecs, wall = asyncio.run(workload(server.url, model, streams, longs, args.long_gap))
        after = step_times(server.url)
    finally:
        server.stop()
    errors = [r["error"] for r in srecs + lrecs if r["error"]]
    itl = [x for r in srecs for x in r["itl_s"]]
    tokens = sum(r["tokens"] for r in srecs + lrecs)
    res = {"budget": budget, "errors": errors, "wall_s": wall, "output_tok_s": tokens / wall,
           "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl, default=None),
           "itl_longest_s": sorted(itl)[-16:],
           "stream_ttft_p50_s": percentile([r["ttft_s"] for r in srecs], 50),
           "stream_ttft_max_s": max(r["ttft_s"] or 0 for r in srecs),
           "long_ttft_p50_s": percentile([r["ttft_s"] for r in lrecs], 50),
           "long_ttft_max_s": max(r["ttft_s"] or 0 for r in lrecs)}
    for phase in ("prefill", "decode", "mixed"):
        steps = after[f"{phase}_steps"] - before[f"{phase}_steps"]
        res[f"{phase}_steps"] = steps
        res[f"{phase}_mean_s"] = (after[f"{phase}_s"] - before[f"{phase}_s"]) / steps if steps else None
    res["itl_p99_over_p50"] = res["itl_p99_s"] / res["itl_p50_s"] if res["itl_p50_s"] else None
    chunk_steps = after["chunk_steps"] - before["chunk_steps"]
    res["chunk_tokens_per_step"] = ((after["chunk_tokens"] - before["chunk_tokens"]) / chunk_steps
                                    if chunk_steps else None)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.tokenizer import checkpoint_tokenizer

    tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    out = results_dir(args.out, "chunked")
    streams = make_requests(tok, args.stream_prompt, [args.stream_tokens] * args.streams)
    longs = [Req(100 + r.index, r.prompt, r.prompt_ids, r.max_tokens)
             for r in make_requests(tok, args.long_prompt,
                                    [args.long_tokens] * (args.streams + args.long))[args.streams:]]
    results = [run_budget(args, b, streams, longs, out) for b in args.budgets]
    (out / "chunked.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                  "results": results}, indent=2))
    print("| budget | ITL p50 ms | ITL p99 ms | p99/p50 | ITL max ms | long TTFT p50 s | long TTFT max s | "
          "stream TTFT p50 / max s | out tok/s | prefill / decode / mixed step ms (steps) | "
          "prompt tokens per chunked step | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"  # noqa: E731
        print(f"| {r['budget'] or 'off'} | {ms(r['itl_p50_s'])} | {ms(r['itl_p99_s'])} | {r['itl_p99_over_p50']:.1f} | "
              f"{ms(r['itl_max_s'])} | {r['long_ttft_p50_s']:.2f} | {r['long_ttft_max_s']:.2f} | "
              f"{r['stream_ttft_p50_s']:.2f} / {r['stream_ttft_max_s']:.2f} | {r['output_tok_s']:.1f} | "
              + " / ".join(f"{ms(r[p + '_mean_s'])} ({r[p + '_steps']:.0f})" for p in ("prefill", "decode", "mixed"))
              + f" | {r['chunk_tokens_per_step'] or 0:.0f} | {len(r['errors'])} |")
    print(f"wrote {out / 'chunked.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
