"""Benchmark served speculation (prompt lookup, an int8 draft model): edit-shaped requests at several
concurrencies, and the verify forward's cost against a plain decode step by batch size. Run as
`python -m plugins.bench.speculation`.

  python -m plugins.bench.speculation /tmp/mqa/santacoder-1b          # deepspeed bf16; int4; lookup; int8 draft
  python -m plugins.bench.speculation /tmp/tiny --dtype float32 --streams 1 2 --prompt-len 64 --max-tokens 16 \\
      --rows 1 2 --out /tmp/spec-tiny

Served: one server per engine option set (bf16, bf16 + lookup, int4, int4 + lookup, bf16 + int8 draft); for each
--streams value, that many concurrent greedy requests whose prompt is a code window followed by its
own first half again (an edit: the model is asked to continue text it has seen), --max-tokens each:
output tokens/s and the acceptance the server reports. Offline: the engine's pool decode step of n rows
against its verify forward of n rows x (k + 1) tokens (k = --k): the cost the server weighs, as it
serves, against the tokens verify steps keep (plugins.serving.speculation).
`--always` serves with PLUGINS_SPECULATION=always (every step verifies), to see what the measured
choice avoids. Writes results/speculation-<timestamp>/speculation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx2
import torch

from plugins.bench.load import ServerProcess, http_client, open_connections, results_dir, served_model
from plugins.serving.args import add_engine_args

OPTION_SETS = {"plain": {}, "lookup": {"speculative": "prompt-lookup"}, "int4": {"quantize": "int4"},
               "int4+lookup": {"quantize": "int4", "speculative": "prompt-lookup"},
               "int8-draft": {"speculative": "int8"}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "server KV pool per rank (default 1GB)")
    ap.add_argument("--sets", nargs="+", choices=list(OPTION_SETS), default=list(OPTION_SETS))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=256, help="the code window (the prompt adds half of it again)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, help="proposed tokens per row and step (default: the server's, 10 for prompt "
                                          "lookup and 4 for a draft model; the offline verify cost: 10)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="offline: batch sizes")
    ap.add_argument("--always", action="store_true", help="speculate at every step (no measured choice)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def edit_prompts(tok, n: int, length: int) -> list[list[int]]:
    from plugins.core.tokenizer import prompt_token_ids

    out = []
    for i in range(n):
        window = prompt_token_ids(tok, length, 200 + i)
        out.append(window + window[:length // 2])
    return out


async def burst(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    async with http_client(len(prompts)) as client:
        await open_connections(client, url, len(prompts))
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            for p in prompts))
        wall = time.perf_counter() - start
    for a in answers:
        a.raise_for_status()
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / wall


def counters(url: str) -> dict:
    text = httpx2.get(url + "/metrics", timeout=30).text
    found = {}
    for key in ("draft_tokens", "accepted_tokens"):
        m = re.search(rf"^mqa_spec_decode_{key}_total ([0-9.e+-]+)$", text, re.MULTILINE)
        found[key] = float(m.group(1)) if m else 0.0
    return found


def served(args, tok, out: Path) -> dict:
    from plugins.core.console import announce

    if args.always:
        os.environ["PLUGINS_SPECULATION"] = "always"  # the servers inherit it

    results = {}
    longest = args.prompt_len + args.prompt_len // 2 + args.max_tokens
    for name in args.sets:
        options = OPTION_SETS[name]
        flags = [f"--{key} {value}" for key, value in options.items()]
        ns = argparse.Namespace(**{**vars(args), "requests": max(args.streams), "streams": max(args.streams),
                                   "max_batch": max(args.streams), "quantize": options.get("quantize"),
                                   "speculative": options.get("speculative"), "num_speculative_tokens": args.k})
        server = ServerProcess(ns, longest, out / f"server-{name}.log", prefix_cache=0)
        try:
            server.wait_ready()
            model = served_model(server.url)
            asyncio.run(burst(server.url, model, edit_prompts(tok, 1, 16), 2))  # warm-up
            for streams in args.streams:
                announce(f"{name} ({' '.join(flags) or 'no options'}): {streams} streams")
                before = counters(server.url)
                rate = asyncio.run(burst(server.url, model, edit_prompts(tok, streams, args.prompt_len),
                                         args.max_tokens))
                after = counters(server.url)
                drafted = after["draft_tokens"] - before["draft_tokens"]
                accepted = after["accepted_tokens"] - before["accepted_tokens"]
                results.setdefault(name, {})[streams] = {"output_tok_s": rate, "drafted": drafted,
                                                         "acceptance": accepted / drafted if drafted else None}
        finally:
            server.stop()
    return results


@torch.inference_mode()
def verify_cost(args) -> dict:
    """Seconds of the pool's decode step and of its verify forward (k + 1 tokens per row), by rows."""
    from plugins.engine.registry import load_backend

    backend = load_backend(args.backend, args.checkpoint_dir, dtype=args.dtype)
    slots, t, k = max(args.rows), args.prompt_len, args.k or 10
    pool = backend.batch_decoder(slots, t + k + 2)
    out = {}
    for n in args.rows:
        mask = torch.ones((n, t + k + 1), dtype=torch.long)
        tokens = torch.zeros((n, k + 1), dtype=torch.long)
        pos = torch.arange(t, t + k + 1).repeat(n, 1)
        times = {"decode": [], "verify": []}
        for _ in range(4):
            start = time.perf_counter()
            pool.decode(tokens[:, :1], mask[:, :t + 1], pos[:, :1])
            times["decode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.verify(tokens, mask, pos)
            times["verify"].append(time.perf_counter() - start)
        decode, verify = (statistics.median(times[k][1:]) for k in ("decode", "verify"))
        out[n] = {"decode_s": decode, "verify_s": verify, "ratio": verify / decode}
    backend.close()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.tokenizer import checkpoint_tokenizer

    tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    out = results_dir(args.out, "speculation")
    cost = verify_cost(args)
    results = served(args, tok, out)
    (out / "speculation.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                      "verify_cost": cost, "served": results}, indent=2))
    print(f"verify of {(args.k or 10) + 1} tokens per row against one decode step ({args.dtype}):")
    print("| rows | decode ms | verify ms | verify / decode |\n|---|---|---|---|")
    for n, c in cost.items():
        print(f"| {n} | {c['decode_s'] * 1000:.0f} | {c['verify_s'] * 1000:.0f} | {c['ratio']:.2f} |")
    print("\nserved edit-shaped requests, output tokens/s (acceptance):")
    print("| options | " + " | ".join(f"{s} streams" for s in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    for name, rows in results.items():
        cells = [f"{r['output_tok_s']:.1f}" + (f" ({r['acceptance']:.0%})" if r["acceptance"] is not None else "")
                 for r in rows.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"wrote {out / 'speculation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
