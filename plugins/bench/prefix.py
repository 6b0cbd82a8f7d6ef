"""Benchmark prefix caching on the completions server: the same requests with the cache on and off.
Run as `python -m plugins.bench.prefix` or `scripts/bench_prefix.py`.

  python -m plugins.bench.prefix checkpoints/santacoder-1b                 # deepspeed bf16, 1024 + 32 tokens
  python -m plugins.bench.prefix /tmp/tiny --dtype float32 --prefix-len 64 --tail-len 8 --requests 3 \\
      --editor-steps 4 --out /tmp/prefix-tiny

Two workloads, each run once with `--prefix-cache 0` and once with the cache on (one server at a time):
  shared prefix  a --prefix-len-token context (a repository, a file) in front of --requests different
                 --tail-len-token questions, one after the other: time to first token of each (the first
                 request, which fills the cache, is reported apart).
  editor         one file of --prefix-len tokens growing by --editor-growth tokens per request, a
                 completion of --max-tokens after every edit (--editor-steps requests, each sent when
                 the previous one is answered): the trace's requests/s and TTFT.
Prompts are token ids (real code windows), so both runs see the very same tokens.
Writes results/prefix-<timestamp>/{prefix.json, prefix.md, server-*.log} and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx2

from plugins.bench.load import Req, ServerProcess, http_client, percentile, served_model, stream_one
from plugins.core.config import byte_size
from plugins.serving.args import add_engine_args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "server KV pool per rank (default 1GB)")
    ap.add_argument("--prefix-len", type=int, default=1024, help="tokens of the shared context / the file")
    ap.add_argument("--tail-len", type=int, default=32, help="tokens of each new question")
    ap.add_argument("--requests", type=int, default=8, help="questions after the first (shared prefix)")
    ap.add_argument("--editor-steps", type=int, default=16, help="edits (requests) of the editor trace")
    ap.add_argument("--editor-growth", type=int, default=4, help="tokens the file grows by per edit")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--prefix-cache", type=byte_size, default=byte_size("512MB"), help="cache size when on")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("tp", "prefix_len", "tail_len", "requests", "editor_steps", "editor_growth", "max_tokens",
                 "prefix_cache", "kv_budget"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from plugins.core.checkpoint import read_hf_config
    from plugins.core.config import ConfigError

    try:
        config = read_hf_config(args.checkpoint_dir)
    except (ConfigError, OSError, ValueError) as e:
        ap.error(str(e))
    longest = max(args.prefix_len + args.tail_len, args.prefix_len + args.editor_steps * args.editor_growth)
    if longest + args.max_tokens > config.n_positions:
        ap.error(f"prompts of up to {longest} tokens + --max-tokens {args.max_tokens} exceed the model's context "
                 f"({config.n_positions})")
    args.max_model_len = longest + args.max_tokens
    return ap, args


def workloads(args, tok) -> dict[str, list[Req]]:
    from plugins.core.tokenizer import prompt_token_ids

    context = prompt_token_ids(tok, args.prefix_len, 1)
    shared = [Req(i, context + prompt_token_ids(tok, args.tail_len, 20 + i), None, args.max_tokens)
              for i in range(args.requests + 1)]
    file = prompt_token_ids(tok, args.prefix_len + args.editor_steps * args.editor_growth, 2)
    editor = [Req(i, file[:args.prefix_len + (i + 1) * args.editor_growth], None, args.max_tokens)
              for i in range(args.editor_steps)]
    return {"shared_prefix": shared, "editor": editor}


async def one_by_one(url: str, model: str, reqs: list[Req]) -> tuple[list[dict], float]:
    async with http_client(1) as client:
        start = time.perf_counter()
        records = [await stream_one(client, url, model, r, start) for r in reqs]
        return records, time.perf_counter() - start


def summarize(records: list[dict], wall_s: float) -> dict:
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {"requests": len(records), "errors": sum(r["error"] is not None for r in records), "wall_s": wall_s,
            "requests_per_s": len(records) / wall_s, "tokens": sum(r["tokens"] for r in records),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None}


def run_server(args, budget: int, work: dict, out: Path) -> dict:
    from plugins.core.console import announce

    label = "on" if budget else "off"
    server = ServerProcess(argparse.Namespace(**{**vars(args), "requests": 1, "streams": 1, "max_batch": 4}),
                           args.max_model_len, out / f"server-cache-{label}.log", prefix_cache=budget)
    try:
        server.wait_ready()
        model = served_model(server.url)
        warm = Req(-1, work["editor"][0].prompt[:16], None, 2)  # loads kernels, caches nothing shared
        asyncio.run(one_by_one(server.url, model, [warm]))
        result = {}
        announce(f"prefix cache {label}: shared prefix ({len(work['shared_prefix'])} requests)")
        records, _ = asyncio.run(one_by_one(server.url, model, work["shared_prefix"][:1]))
        result["first"] = records[0]
        records, wall = asyncio.run(one_by_one(server.url, model, work["shared_prefix"][1:]))
        result["shared_prefix"] = {**summarize(records, wall), "records": records}
        announce(f"prefix cache {label}: editor trace ({len(work['editor'])} requests)")
        records, wall = asyncio.run(one_by_one(server.url, model, work["editor"]))
        result["editor"] = {**summarize(records, wall), "records": records}
        metrics = httpx2.get(server.url + "/metrics").text
        result["metrics"] = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                             if line.startswith("mqa_prefix_cache")}
        return result
    finally:
        result_code = server.stop()
        announce(f"server (cache {label}) stopped: exit status {result_code}")


def write_markdown(path: Path, result: dict) -> None:
    off, on = result["off"], result["on"]
    a = result["config"]
    lines = [f"# Prefix caching: {result['model']} ({a['backend']}, {a['dtype']}, tp {a['tp']})", "",
             f"Shared prefix: {a['prefix_len']}-token context + {a['tail_len']}-token question, {a['requests']} "
             f"questions one after the other (after a first that fills the cache); editor: a {a['prefix_len']}-token "
             f"file growing {a['editor_growth']} tokens per request, {a['editor_steps']} requests; "
             f"{a['max_tokens']} new tokens each.", "",
             "| workload | cache | TTFT p50 ms | TTFT p99 ms | requests/s | errors |", "|---|---|---|---|---|---|"]
    for work in ("shared_prefix", "editor"):
        for label, r in (("off", off), ("on", on)):
            w = r[work]
            lines.append(f"| {work} | {label} | {w['ttft_p50_s'] * 1e3:.1f} | {w['ttft_p99_s'] * 1e3:.1f} | "
                         f"{w['requests_per_s']:.3f} | {w['errors']} |")
    lines += ["", f"First request (fills the cache): TTFT off {off['first']['ttft_s'] * 1e3:.1f} ms, "
                  f"on {on['first']['ttft_s'] * 1e3:.1f} ms.", ""]
    for k, v in result["ratios"].items():
        lines.append(f"- {k}: {v:.2f}x")
    lines += ["", "Cache counters (on): " + ", ".join(f"{k} {v:g}" for k, v in on["metrics"].items())]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    from plugins.core.config import REPO_ROOT
    from plugins.core.console import exit_without_collecting, quiet_upstream
    from plugins.core.tokenizer import checkpoint_tokenizer

    quiet_upstream()
    exit_without_collecting()
    try:
        tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    except ValueError as e:  # its ids do not fit the model
        ap.error(str(e))
    work = workloads(args, tok)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO_ROOT / "results" / f"prefix-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    result = {"timestamp": stamp, "model": args.checkpoint_dir.resolve().name,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    try:
        result["off"] = run_server(args, 0, work, out)
        result["on"] = run_server(args, args.prefix_cache, work, out)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    off, on = result["off"], result["on"]
    result["ratios"] = {
        "shared-prefix TTFT p50, off / on": off["shared_prefix"]["ttft_p50_s"] / on["shared_prefix"]["ttft_p50_s"],
        "editor TTFT p50, off / on": off["editor"]["ttft_p50_s"] / on["editor"]["ttft_p50_s"],
        "editor requests/s, on / off": on["editor"]["requests_per_s"] / off["editor"]["requests_per_s"]}
    (out / "prefix.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "prefix.md", result)
    print((out / "prefix.md").read_text())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
