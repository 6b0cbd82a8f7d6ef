"""Replicas against tensor parallelism, and cache-aware routing against round robin, through `mqa-fleet`
(vllm-router in front of every configuration, so each pays the same hop). Run as `python -m plugins.bench.fleet`.

  python -m plugins.bench.fleet /tmp/mqa/santacoder-1b                 # deepspeed bf16, this machine's cores
  python -m plugins.bench.fleet /tmp/tiny --dtype float32 --streams 4 --prompt-len 32 --max-tokens 16 \\
      --file-len 128 --out /tmp/fleet-tiny

Workloads (one fleet at a time, each warmed up by one request):
  streams  --streams concurrent clients, 2 x --streams requests of --prompt-len + --max-tokens tokens
           (closed loop): output tokens/s, TTFT p50 / p99, ITL p50 / p99.
  editor   one editor: a --file-len-token file growing by 4 tokens per request, and a second file
           every third request (24 requests, each sent when the last is answered): TTFT p50 / p99 and
           the prefix-cache hit rate summed over the replicas' /metrics.
Fleets: 2 replicas of TP 1 (cache_aware): streams + editor; 1 replica of TP 2: streams; 2 replicas of
TP 1 (round_robin): editor. Writes results/fleet-<timestamp>/{fleet.json, fleet.md, <fleet>.log}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from plugins.bench.load import Req, closed_loop, make_requests, results_dir, stream_one
from plugins.bench.serving import summarize
from plugins.launch.launcher import free_port

FLEETS = {  # name -> (mqa-fleet flags, workloads)
    "2x-tp1-cache-aware": (["--replicas", "2", "--policy", "cache_aware"], ("streams", "editor")),
    "1x-tp2": (["--replicas", "1", "--tp", "2"], ("streams",)),
    "2x-tp1-round-robin": (["--replicas", "2", "--policy", "round_robin"], ("editor",)),
}
CACHE = ("mqa_prefix_cache_lookups_total", "mqa_prefix_cache_hits_total", "mqa_prefix_cache_reused_tokens_total",
         "mqa_prompt_tokens_total")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("--backend", default="deepspeed")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--file-len", type=int, default=1024, help="tokens of each editor file")
    ap.add_argument("--fleets", nargs="+", choices=list(FLEETS), default=list(FLEETS))
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


class FleetProcess:
    def __init__(self, args, flags: list[str], log_path: Path):
        from plugins.core.config import REPO_ROOT

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "plugins.fleet", str(args.checkpoint_dir), *flags, "--port",
               self.url.rsplit(":", 1)[1], "--backend", args.backend, "--dtype", args.dtype,
               "--log-dir", str(log_path.with_suffix(""))]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 900
        while "serving on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mqa-fleet did not start:\n{self.output()}")
            time.sleep(0.5)
        self.workers = re.search(r"over (.*) \(Ctrl-C", self.output())[1].split(", ")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def counters(self) -> dict[str, float]:
        total = dict.fromkeys(CACHE, 0.0)
        for url in self.workers:
            text = httpx2.get(url + "/metrics", timeout=30).text
            for name in CACHE:
                total[name] += float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def editor_trace(tok, file_len: int) -> list[Req]:
    from plugins.core.tokenizer import PROMPTS_FILE

    ids = tok.encode(PROMPTS_FILE.read_text()).ids
    files = [ids[:file_len + 64], ids[2 * file_len:3 * file_len + 64]]
    reqs, grown = [], [0, 0]
    for k in range(24):
        f = 1 if k % 3 == 2 else 0
        text = tok.decode(files[f][:file_len + 4 * grown[f]])
        grown[f] += 1
        reqs.append(Req(k, text, tok.encode(text).ids, 8))
    return reqs


async def one_by_one(url: str, model: str, reqs: list[Req]) -> tuple[list[dict], float]:
    async with httpx2.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        records = [await stream_one(client, url, model, r, t0) for r in reqs]
        return records, time.perf_counter() - t0


def run(args) -> dict:
    from plugins.core.tokenizer import checkpoint_tokenizer

    tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    model = args.checkpoint_dir.resolve().name
    streams = make_requests(tok, args.prompt_len, [args.max_tokens] * (2 * args.streams))
    editor = editor_trace(tok, args.file_len)
    out = results_dir(args.out, "fleet")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "fleets": {}}
    for name in args.fleets:
        flags, workloads = FLEETS[name]
        fleet = FleetProcess(args, flags, out / f"{name}.log")
        try:
            asyncio.run(one_by_one(fleet.url, model, make_requests(tok, 16, [4])))  # warm-up
            row = {}
            if "streams" in workloads:
                records, wall = asyncio.run(closed_loop(fleet.url, model, streams, args.streams))
                row["streams"] = summarize(records, wall)
            if "editor" in workloads:
                before = fleet.counters()
                records, wall = asyncio.run(one_by_one(fleet.url, model, editor))
                after = fleet.counters()
                d = {k: after[k] - before[k] for k in CACHE}
                row["editor"] = {**summarize(records, wall),
                                 "hit_rate": d["mqa_prefix_cache_hits_total"] / d["mqa_prefix_cache_lookups_total"],
                                 "reused_token_share": d["mqa_prefix_cache_reused_tokens_total"]
                                 / d["mqa_prompt_tokens_total"]}
            result["fleets"][name] = row
            print(f"{name}: {json.dumps(row, default=str)[:600]}", flush=True)
        finally:
            fleet.stop()
    (out / "fleet.json").write_text(json.dumps(result, indent=2))
    (out / "fleet.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["| fleet | workload | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | hit rate | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["fleets"].items():
        for work, s in row.items():
            ms = [f"{s[k] * 1000:.0f}" if s[k] is not None else "-" for k in
                  ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")]
            hit = f"{s['hit_rate']:.1%}" if "hit_rate" in s else "-"
            lines.append(f"| {name} | {work} | {s['throughput_tok_s']:.1f} | {' | '.join(ms)} | {hit} | "
                         f"{s['errors']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
