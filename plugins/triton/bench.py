"""mqa-serve against mqa-triton on the same checkpoint, engine flags and workload, measured by one client
(aiperf, `make clients`): each server alone, one aiperf run each. Run as `python -m plugins.triton.bench`.

  python -m plugins.triton.bench /tmp/mqa/small --server-args='--dtype bfloat16' \\
      --requests 48 --concurrency 8 --isl 128 --osl 64

aiperf streams both: mqa-serve's /v1/completions (endpoint type completions), Triton's
/v2/models/<model>/generate_stream (endpoint type template, the body Triton's LLM examples take);
greedy, EOS ignored, output tokens counted by aiperf with the checkpoint's tokenizer for both (no
server token counts: the generate extension reports none). Both servers run the CPU kernels' fixed
choices (PLUGINS_KERNELS_TABLE=static). Besides aiperf's figures: the CPU time the
server's processes took per output token, and the machine's load average around each run (on a
shared machine, other processes move the latencies more than that). Prints a markdown table and
writes aiperf's exports under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from plugins.bench.versus import closed_loop
from plugins.launch.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true, '
            '"temperature": 0, "ignore_eos": true}')
METRICS = {"output tok/s": ("output_token_throughput", "avg"), "req/s": ("request_throughput", "avg"),
           "TTFT p50 ms": ("time_to_first_token", "p50"), "TTFT p99 ms": ("time_to_first_token", "p99"),
           "ITL p50 ms": ("inter_token_latency", "p50"), "ITL p99 ms": ("inter_token_latency", "p99"),
           "latency p50 ms": ("request_latency", "p50"), "completed": ("request_count", "avg")}
EXTRA = ("errors", "server CPU ms/token", "load avg", "engine steps", "decode step ms", "mixed step ms")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m plugins.triton.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("--server-args", default="", help="engine flags both servers get, one string after '='")
    ap.add_argument("--aiperf", type=Path, default=REPO / ".venv-aiperf" / "bin" / "aiperf")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--isl", type=int, default=128, help="prompt tokens (aiperf's synthetic prompts)")
    ap.add_argument("--osl", type=int, default=64, help="output tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--triton-first", action="store_true", help="run mqa-triton's measurement first")
    ap.add_argument("--out", type=Path, help="default: a new temporary directory")
    return ap.parse_args(argv)


def wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start; see {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def run_server(cmd: list[str], ready_url: str, log: Path):
    out = open(log, "w")
    # both run the kernel ladder's fixed choices: timed at start on a busy machine, the two could differ
    env = {**os.environ, "PLUGINS_KERNELS_TABLE": "static"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait(ready_url, proc, log)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every process under it (Triton's server and its stubs,
    TP ranks), the exited children it waited for included."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root] + root.children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def engine_figures(metrics_url: str) -> dict:
    """From the engine's /metrics (Triton's metrics port mirrors them, within a second): engine steps,
    their mean time by phase, and generated tokens."""
    import re

    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        text = r.read().decode()

    def value(series: str) -> float:
        m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    out = {"engine steps": value("mqa_decode_steps_total"), "tokens": value("mqa_generation_tokens_total")}
    for phase in ("decode", "mixed", "prefill"):
        n = value(f'mqa_step_seconds_count{{phase="{phase}"}}')
        out[f"{phase} step ms"] = 1000 * value(f'mqa_step_seconds_sum{{phase="{phase}"}}') / n if n else None
    return out


def aiperf(args, endpoint: list[str], model: str, url: str, out: Path, server: subprocess.Popen,
           metrics_url: str) -> dict:
    cmd = [str(args.aiperf), "profile", "--model", model, "--url", url, *endpoint, "--streaming",
           "--tokenizer", str(args.checkpoint_dir), "--ui", "none", "--no-gpu-telemetry",
           # no /metrics scrapes (aiperf's default, ~3 a second): they would load mqa-serve's own process,
           # and miss Triton's (on its metrics port)
           "--no-server-metrics",
           "--request-count", str(args.requests), *closed_loop(args.concurrency), "--warmup-request-count",
           str(args.concurrency), "--isl", str(args.isl), "--osl", str(args.osl), "--random-seed", str(args.seed),
           "--output-artifact-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # aiperf 0.13 then refuses local dirs
    out.mkdir(parents=True, exist_ok=True)
    cpu, load = cpu_seconds(server.pid), os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    cpu, load = cpu_seconds(server.pid) - cpu, (load + os.getloadavg()[0]) / 2
    (out / "aiperf.log").write_text(shlex.join(cmd) + "\n\n" + done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"aiperf failed ({done.returncode}); see {out / 'aiperf.log'}")
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    row = {name: data.get(metric, {}).get(stat) for name, (metric, stat) in METRICS.items()}
    row["errors"] = int(data.get("error_request_count", {}).get("avg") or 0)
    # the server's own CPU time per token (warm-up requests included: every request gives --osl tokens),
    # which other processes on the machine slow down less than they slow its latencies
    row["server CPU ms/token"] = 1000 * cpu / ((args.requests + args.concurrency) * args.osl)
    row["load avg"] = load  # the machine's 1-minute load average around the run (2 cores here)
    time.sleep(2)  # Triton's copy of the engine's metrics is at most a second old
    row.update(engine_figures(metrics_url))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="triton-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    model = args.checkpoint_dir.resolve().name
    engine = shlex.split(args.server_args)
    rows = {}

    def measure_serve():
        port = free_port()
        serve = run_server([sys.executable, "-m", "plugins.http", str(args.checkpoint_dir), "--port", str(port),
                            *engine], f"http://127.0.0.1:{port}/health", out / "mqa-serve.log")
        try:
            rows["mqa-serve"] = aiperf(args, ["--endpoint-type", "completions", "--extra-inputs", "ignore_eos:true",
                                              "--extra-inputs", "temperature:0"], model, f"http://127.0.0.1:{port}",
                                       out / "mqa-serve", serve, f"http://127.0.0.1:{port}/metrics")
        finally:
            stop(serve)

    def measure_triton():
        ports = [free_port() for _ in range(3)]
        template = out / "triton-template.json"  # a file: aiperf splits an inline --extra-inputs value at commas
        template.write_text(TEMPLATE)
        triton = run_server([sys.executable, "-m", "plugins.triton", str(args.checkpoint_dir), "--port",
                             str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *engine],
                            f"http://127.0.0.1:{ports[0]}/v2/models/{model}/ready", out / "mqa-triton.log")
        try:
            rows["mqa-triton"] = aiperf(args, ["--endpoint-type", "template", "--custom-endpoint",
                                               f"/v2/models/{model}/generate_stream", "--extra-inputs",
                                               f"payload_template:{template}", "--extra-inputs",
                                               "response_field:text_output"], model,
                                        f"http://127.0.0.1:{ports[0]}", out / "mqa-triton", triton,
                                        f"http://127.0.0.1:{ports[2]}/metrics")
        finally:
            stop(triton)

    for measure in ((measure_triton, measure_serve) if args.triton_first else (measure_serve, measure_triton)):
        measure()
    (out / "bench.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "rows": rows}, indent=1))
    columns = list(METRICS) + list(EXTRA)
    print(f"{args.requests} requests x ({args.isl} + {args.osl}) tokens, {args.concurrency} concurrent, "
          f"{model}, engine flags: {args.server_args or '(defaults)'}; aiperf exports in {out}")
    print("| server | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for server, row in rows.items():
        print(f"| {server} | " + " | ".join("-" if row[c] is None else f"{row[c]:.1f}" if isinstance(row[c], float)
                                            else str(row[c]) for c in columns) + " |")
    serve_row, triton_row = rows["mqa-serve"], rows["mqa-triton"]
    if serve_row["output tok/s"] and triton_row["output tok/s"]:
        print(f"triton / serve output tok/s: {triton_row['output tok/s'] / serve_row['output tok/s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
