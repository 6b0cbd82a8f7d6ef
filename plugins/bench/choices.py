"""Benchmark n choices per request (one prefill, n rows) against n separate requests, and a
pass@k-shaped run. Run as `python -m plugins.bench.choices`.

  python -m plugins.bench.choices /tmp/mqa/santacoder-1b                 # deepspeed bf16, n 16, 256 + 128
  python -m plugins.bench.choices /tmp/tiny --dtype float32 --n 4 --prompt-len 32 --max-tokens 8 \\
      --passk-prompts 2 --passk-n 3

Workloads (one server, prefix cache off so only the sharing of n is measured; sampled at temperature
0.8 with EOS ignored, so every row makes --max-tokens tokens):
  n          one --prompt-len prompt, one request with n = --n, against --n concurrent requests of n = 1
             (seeds seed + j: the same samples): wall time of each, prompt tokens computed (/metrics).
  pass@k     --passk-prompts prompts x n = --passk-n, all requests at once: tokens/s and the share of
             engine time in prefill (prompt tokens computed / all tokens computed).
Prints a summary and writes results/choices-<timestamp>/{choices.json, server.log}.
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

from plugins.bench.load import ServerProcess, http_client, results_dir, served_model
from plugins.serving.args import add_engine_args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "server KV pool per rank (default 1GB)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passk-prompts", type=int, default=20)
    ap.add_argument("--passk-n", type=int, default=20)
    ap.add_argument("--passk-max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for name in ("tp", "n", "prompt_len", "max_tokens", "passk_prompts", "passk_n", "passk_max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", httpx2.get(url + "/metrics", timeout=30).text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def counters(url: str) -> dict:
    return {k: metric(url, f"mqa_{k}_total") for k in ("prefill_tokens", "generation_tokens", "prompt_tokens")}


async def post_all(url: str, bodies: list[dict]) -> tuple[list[dict], float]:
    async with http_client(len(bodies)) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
        wall = time.perf_counter() - start
    for a in answers:
        a.raise_for_status()
    return [a.json() for a in answers], wall


def measured(url: str, bodies: list[dict]) -> dict:
    before = counters(url)
    answers, wall = asyncio.run(post_all(url, bodies))
    after = counters(url)
    delta = {k: after[k] - before[k] for k in before}
    texts = [c["text"] for a in answers for c in sorted(a["choices"], key=lambda c: c["index"])]
    return {"wall_s": wall, "requests": len(bodies), "choices": len(texts),
            "tokens_per_s": delta["generation_tokens"] / wall,
            **delta, "prefill_share": delta["prefill_tokens"] / (delta["prefill_tokens"] + delta["generation_tokens"]),
            "texts": texts}


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.console import announce
    from plugins.core.tokenizer import checkpoint_tokenizer, prompt_token_ids

    tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    out = results_dir(args.out, "choices")
    slots = max(args.n, args.passk_n)
    longest = max(args.prompt_len + args.max_tokens, args.prompt_len + args.passk_max_tokens)
    server = ServerProcess(argparse.Namespace(**{**vars(args), "requests": args.passk_prompts * args.passk_n,
                                                 "streams": slots, "max_batch": slots}),
                           longest, out / "server.log", prefix_cache=0)
    try:
        server.wait_ready()
        model = served_model(server.url)
        common = {"model": model, "temperature": 0.8, "ignore_eos": True}
        prompt = prompt_token_ids(tok, args.prompt_len, 3)
        asyncio.run(post_all(server.url, [{**common, "prompt": prompt[:8], "max_tokens": 2}]))  # warm-up
        announce(f"n = {args.n} in one request")
        shared = measured(server.url, [{**common, "prompt": prompt, "max_tokens": args.max_tokens, "n": args.n,
                                        "seed": 7}])
        announce(f"{args.n} separate requests")
        separate = measured(server.url, [{**common, "prompt": prompt, "max_tokens": args.max_tokens, "seed": 7 + j}
                                         for j in range(args.n)])
        same = shared.pop("texts") == separate.pop("texts")
        announce(f"pass@k: {args.passk_prompts} prompts x n = {args.passk_n}")
        passk = measured(server.url, [{**common, "prompt": prompt_token_ids(tok, args.prompt_len, 40 + i),
                                       "max_tokens": args.passk_max_tokens, "n": args.passk_n, "seed": i}
                                      for i in range(args.passk_prompts)])
        passk.pop("texts")
    finally:
        server.stop()
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "n": shared, "separate": separate,
              "same_samples": same, "passk": passk}
    (out / "choices.json").write_text(json.dumps(result, indent=2))
    print(f"n = {args.n} of one {args.prompt_len}-token prompt x {args.max_tokens} tokens: one request "
          f"{shared['wall_s']:.2f} s ({shared['prefill_tokens']:.0f} prompt tokens computed), {args.n} requests "
          f"{separate['wall_s']:.2f} s ({separate['prefill_tokens']:.0f}): "
          f"{separate['wall_s'] / shared['wall_s']:.2f}x; "
          f"samples identical: {same}")
    print(f"pass@k {args.passk_prompts} x n {args.passk_n} x {args.passk_max_tokens} tokens: {passk['wall_s']:.1f} s, "
          f"{passk['tokens_per_s']:.1f} tokens/s, prefill share {passk['prefill_share']:.1%} of tokens computed")
    print(f"wrote {out / 'choices.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
