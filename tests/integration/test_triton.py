"""`mqa-triton`: our engine inside NVIDIA Triton (the server nvidia-pytriton bundles, in .venv-triton:
`make triton`), live on 127.0.0.1, driven by Triton's own client (tritonclient 2.73, HTTP and gRPC)
and by raw HTTP for the generate extension (tritonclient has no call for it).

Every greedy answer served under concurrency, through either of the model's two instances, must be
what `generate` gives for that request alone on the same engine (fp32); a bad request fails alone,
with Triton's error shape; readiness, model config and /metrics (Triton's and our engine's series)
answer; SIGTERM lets running streams finish and the process exits 0.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from plugins.core.tokenizer import prompt_token_ids
from plugins.launch.launcher import free_port
from plugins.engine.registry import load_backend

REPO = Path(__file__).resolve().parents[2]
TRITON_PYTHON = REPO / ".venv-triton" / "bin" / "python"
pytestmark = pytest.mark.skipif(not TRITON_PYTHON.exists(), reason="Triton is installed by `make triton`")
SLOTS = 4
MODEL = "tiny"

# Runs in .venv-triton: each call (kind, args) in its own thread, started `delay` s apart; its answer
# as JSON. HTTP generate and generate_stream are raw HTTP; gRPC streams are tritonclient's.
DRIVER = r"""
import json, queue, sys, threading, time, urllib.error, urllib.request
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

http_url, grpc_url, metrics_url, model = sys.argv[1:5]
calls = json.loads(sys.stdin.read())
DTYPES = {"BYTES": object, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": bool}

def post(path, body):
    req = urllib.request.Request(f"http://{http_url}/v2/models/{model}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def generate(body):
    status, text = post("generate", body)
    return {"status": status, "body": json.loads(text)}

def generate_stream(body):
    status, text = post("generate_stream", body)
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return {"status": status, "events": events}

def grpc_stream(inputs, cancel_after=None):
    client = grpcclient.InferenceServerClient(grpc_url)
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensors = []
    for name, (values, dtype) in inputs.items():
        array = np.array([v.encode() if dtype == "BYTES" else v for v in values], dtype=DTYPES[dtype])
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    client.async_stream_infer(model, tensors, request_id="r")
    out = []
    while True:
        result, error = answers.get(timeout=120)
        if error is not None:
            out.append({"error": error.message()})
            break
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        item = {"text": result.as_numpy("text_output")[0].decode(), "final": final}
        for name in ("finish_reason", "num_input_tokens", "num_output_tokens"):
            value = result.as_numpy(name)
            if value is not None:
                item[name] = value[0].decode() if name == "finish_reason" else int(value[0])
        out.append(item)
        if final or (cancel_after is not None and len(out) >= cancel_after):
            break
    client.stop_stream(cancel_requests=cancel_after is not None)
    client.close()
    return out

def meta():
    client = httpclient.InferenceServerClient(http_url)
    return {"live": client.is_server_live(), "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready(model), "metadata": client.get_model_metadata(model),
            "config": client.get_model_config(model),
            "statistics": client.get_inference_statistics(model)}

def metrics():
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=30) as r:
        return r.read().decode()

results = [None] * len(calls)
def run(i, kind, args, delay):
    time.sleep(delay)
    try:
        results[i] = globals()[kind](*args)
    except Exception as e:
        results[i] = {"raised": type(e).__name__, "message": str(e)}

threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


class Triton:
    """A live `mqa-triton` (python -m plugins.triton) over the tiny checkpoint, stopped by SIGTERM."""

    def __init__(self, ckpt, *args, graceful_timeout=20):
        self.ports = [free_port() for _ in range(3)]
        while len(set(self.ports)) < 3:
            self.ports = [free_port() for _ in range(3)]
        self.http, self.grpc, self.metrics = (f"127.0.0.1:{p}" for p in self.ports)
        self.log = open(Path(ckpt).parent / f"triton-{self.ports[0]}.log", "w+")
        # tiny: 2 layers x K,V x 16 dims x 4 bytes x 256 positions per slot
        cmd = [sys.executable, "-m", "plugins.triton", str(ckpt), "--backend", "hf", "--dtype", "float32",
               "--kv-budget", str(SLOTS * 2 * 2 * 16 * 4 * 256), "--max-waiting", "16", "--port", str(self.ports[0]),
               "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]),
               "--model-name", MODEL, "--graceful-timeout", str(graceful_timeout), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(timeout=10)
                pytest.fail(f"mqa-triton did not start:\n{self.output()}")
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http}/v2/models/{MODEL}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-8000:]

    def drive(self, calls: list, timeout=300) -> list:
        """calls: (kind, args, delay) run concurrently by tritonclient in .venv-triton."""
        done = subprocess.run([str(TRITON_PYTHON), "-c", DRIVER, self.http, self.grpc, self.metrics, MODEL],
                              input=json.dumps(calls), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    def stop(self, timeout=90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def engine(ckpt):
    return load_backend("hf", ckpt, dtype="float32")


@pytest.fixture(scope="module")
def triton(ckpt):
    server = Triton(ckpt, "--instances", "2")
    yield server
    code = server.stop()
    assert code == 0, server.output()


def expected(engine, tokenizer, ids, max_tokens):
    """What `generate` alone gives, cut after EOS as the server stops there: (text, tokens, finish reason)."""
    t = torch.tensor([ids])
    new = engine.generate(t, torch.ones_like(t), max_tokens).tokens[0, len(ids):].tolist()
    eos = tokenizer.token_to_id("<|endoftext|>")
    reason = "length"
    if eos in new:
        new, reason = new[:new.index(eos) + 1], "stop"
    return tokenizer.decode(new, skip_special_tokens=True), len(new), reason


PROMPTS = [(5 + 3 * i, 4 + 5 * i) for i in range(9)]  # (prompt tokens, max_tokens), all different


def prompt(tokenizer, i, length) -> str:
    return tokenizer.decode(prompt_token_ids(tokenizer, length, i))


def check_greedy(engine, tokenizer, i, text, finish=None, input_tokens=None, output_tokens=None):
    length, max_tokens = PROMPTS[i]
    ids = tokenizer.encode(prompt(tokenizer, i, length)).ids
    want, n, reason = expected(engine, tokenizer, ids, max_tokens)
    assert text == want, f"request {i}"
    assert finish in (None, reason), f"request {i}"
    assert input_tokens in (None, len(ids)) and output_tokens in (None, n), f"request {i}"


def test_concurrent_greedy_generate_matches_generate_alone(triton, engine, tokenizer):
    # TensorRT-LLM's names as top-level fields (the generate extension makes them input tensors)
    calls = [("generate", [{"text_input": prompt(tokenizer, i, length), "max_tokens": max_tokens, "temperature": 0,
                            "return_finish_reason": True, "return_num_input_tokens": True,
                            "return_num_output_tokens": True}], 0.05 * i)
             for i, (length, max_tokens) in enumerate(PROMPTS)]
    for i, answer in enumerate(triton.drive(calls)):
        assert answer["status"] == 200, answer
        body = answer["body"]
        assert body["model_name"] == MODEL
        check_greedy(engine, tokenizer, i, body["text_output"], body["finish_reason"], body["num_input_tokens"],
                     body["num_output_tokens"])


def test_concurrent_streams_match_generate_alone(triton, engine, tokenizer):
    """gRPC streams (tritonclient's decoupled streaming) and HTTP generate_stream, interleaved; options
    as input tensors, as vLLM's sampling_parameters, and as request parameters."""
    calls = []
    for i, (length, max_tokens) in enumerate(PROMPTS):
        text = prompt(tokenizer, i, length)
        if i % 3 == 0:
            calls.append(("grpc_stream", [{"text_input": [[text], "BYTES"], "max_tokens": [[max_tokens], "INT32"],
                                           "temperature": [[0.0], "FP32"], "stream": [[True], "BOOL"],
                                           "return_finish_reason": [[True], "BOOL"]}], 0.05 * i))
        elif i % 3 == 1:
            sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens})
            calls.append(("grpc_stream", [{"text_input": [[text], "BYTES"], "stream": [[True], "BOOL"],
                                           "sampling_parameters": [[sampling], "BYTES"]}], 0.05 * i))
        else:
            calls.append(("generate_stream", [{"text_input": text, "stream": True, "return_finish_reason": True,
                                               "parameters": {"max_tokens": max_tokens, "temperature": 0}}], 0.05 * i))
    for i, answer in enumerate(triton.drive(calls)):
        events = answer if isinstance(answer, list) else answer["events"]
        assert events and all("error" not in e for e in events), answer
        if isinstance(answer, list):
            assert [e["final"] for e in events] == [False] * (len(events) - 1) + [True]
        check_greedy(engine, tokenizer, i, "".join(e["text_output" if "text_output" in e else "text"] for e in events),
                     events[-1].get("finish_reason"))


def test_a_bad_request_fails_alone_with_tritons_error(triton, engine, tokenizer):
    good = [("generate", [{"text_input": prompt(tokenizer, i, PROMPTS[i][0]), "max_tokens": PROMPTS[i][1],
                           "temperature": 0}], 0.05 * i) for i in range(3)]
    bad = [
        ("generate", [{"text_input": "def f():", "max_tokens": 10 ** 6}], 0.02),               # over the context
        ("generate", [{"text_input": "def f():", "temperature": -1}], 0.04),                   # out of range
        ("generate", [{"text_input": "def f():", "sampling_parameters": json.dumps({"n": 2})}], 0.06),
        ("generate", [{"max_tokens": 4}], 0.08),                                                # no text_input
        ("generate_stream", [{"text_input": "def f():", "stream": True, "top_p": 0}], 0.1),
        ("grpc_stream", [{"text_input": [["def f():"], "BYTES"], "max_tokens": [[0], "INT32"]}], 0.12),
    ]
    answers = triton.drive(good + bad)
    for i, answer in enumerate(answers[:3]):
        assert answer["status"] == 200, answer
        check_greedy(engine, tokenizer, i, answer["body"]["text_output"])
    too_long, temperature, n, missing, stream, grpc = answers[3:]
    # Triton's error shape: {"error": message}, HTTP 400 for a model's INVALID_ARG
    assert too_long["status"] == 400 and set(too_long["body"]) == {"error"}
    assert "max_tokens" in too_long["body"]["error"] and "context" in too_long["body"]["error"]
    assert temperature["status"] == 400 and "`temperature`" in temperature["body"]["error"]
    assert n["status"] == 400 and "sampling_parameters.n" in n["body"]["error"]
    assert missing["status"] == 400 and "text_input" in missing["body"]["error"]
    assert stream["status"] == 400 and stream["events"] == [{"error": stream["events"][0]["error"]}]
    assert "`top_p`" in stream["events"][0]["error"]
    assert grpc == [{"error": grpc[0]["error"]}] and "`max_tokens` must be >= 1" in grpc[0]["error"]
    assert "Traceback" not in triton.output()


def test_a_client_that_cancels_frees_its_slot(triton):
    """tritonclient's stop_stream(cancel_requests=True) after the first response of a 240-token stream:
    Triton cancels the request, its stub closes the engine's connection, the engine drops the row."""
    [answer] = triton.drive([("grpc_stream", [{"text_input": [["def f(x):"], "BYTES"], "max_tokens": [[240], "INT32"],
                                               "ignore_eos": [[True], "BOOL"], "stream": [[True], "BOOL"]}, 1], 0)])
    assert len(answer) == 1 and not answer[0]["final"], answer
    deadline = time.monotonic() + 30
    while True:  # the engine's metrics reach Triton's /metrics within a second
        [text] = triton.drive([("metrics", [], 0)])
        cancelled = re.search(r'^mqa_requests_finished_total{reason="cancelled"} (\S+)$', text, re.MULTILINE)
        if cancelled and float(cancelled.group(1)) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert cancelled and float(cancelled.group(1)) == 1, text
    assert re.search(r"^mqa_requests_running 0(\.0)?$", text, re.MULTILINE), text


def test_readiness_config_and_metrics(triton):
    # after the requests above: Triton's own series and our engine's (mirrored every second)
    deadline = time.monotonic() + 30
    while True:
        [meta, text] = triton.drive([("meta", [], 0), ("metrics", [], 0)])
        tokens = re.search(r"^mqa_generation_tokens_total (\S+)$", text, re.MULTILINE)
        if (tokens and float(tokens.group(1)) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert meta["live"] and meta["ready"] and meta["model_ready"]
    config = meta["config"]
    assert config["backend"] == "python" and config["model_transaction_policy"]["decoupled"]
    assert config["instance_group"][0]["count"] == 2
    names = {i["name"] for i in config["input"]}
    assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "stop",
            "sampling_parameters", "random_seed", "stop_words"} <= names
    assert {o["name"] for o in config["output"]} >= {"text_output", "finish_reason"}
    assert [i["name"] for i in meta["metadata"]["inputs"]][0] == "text_input"
    assert int(meta["statistics"]["model_stats"][0]["inference_count"]) > 0
    assert re.search(rf'^nv_inference_count{{model="{MODEL}",version="1"}} [1-9]', text, re.MULTILINE), text
    assert tokens and float(tokens.group(1)) > 0, text
    for series in ("mqa_requests_running", "mqa_kv_pool_slots", "mqa_time_to_first_token_seconds_count",
                   'mqa_time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert re.search(rf"^{re.escape(series)} ", text, re.MULTILINE), series
    assert re.search(rf"^mqa_kv_pool_slots {SLOTS}(\.0)?$", text, re.MULTILINE)


# Runs in .venv-triton: n greedy gRPC streams of `tokens` tokens each, one JSON line per response as it arrives
STREAMS = r"""
import json, queue, sys
import numpy as np
import tritonclient.grpc as grpcclient

grpc_url, model, n, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = grpcclient.InferenceServerClient(grpc_url)
answers = queue.Queue()
client.start_stream(callback=lambda result, error: answers.put((result, error)))

def tensor(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t

for i in range(n):
    client.async_stream_infer(model, [
        tensor("text_input", np.array([f"def f{i}(x):".encode()], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([tokens], dtype=np.int32), "INT32"),
        tensor("temperature", np.array([0.0], dtype=np.float32), "FP32"),
        tensor("ignore_eos", np.array([True]), "BOOL"), tensor("stream", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL")], request_id=str(i))
finals = 0
while finals < n:
    result, error = answers.get(timeout=120)
    if error is not None:
        print(json.dumps({"error": error.message()}), flush=True)
        finals += 1
        continue
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param
    count = result.as_numpy("num_output_tokens")
    print(json.dumps({"id": response.id, "final": final, "tokens": None if count is None else int(count[0])}),
          flush=True)
    finals += final
client.stop_stream()
"""


def test_sigterm_lets_running_streams_finish(triton):
    """The module's server, last: SIGTERM once each of three streams has its first tokens (all three
    are then running: the pool has four slots); each still ends whole, and the process exits 0."""
    driver = subprocess.Popen([str(TRITON_PYTHON), "-c", STREAMS, triton.grpc, MODEL, "3", "200"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, ends, mid_stream = set(), [], 0
    for line in driver.stdout:
        event = json.loads(line)
        assert "error" not in event, (event, triton.output())
        if event["final"]:
            ends.append(event)
        elif len(started) < 3:
            started.add(event["id"])
            if len(started) == 3:
                triton.proc.send_signal(signal.SIGTERM)
                mid_stream = 3 - len(ends)  # streams not yet ended when the signal went
    assert driver.wait(60) == 0, driver.stderr.read()[-3000:]
    assert len(ends) == 3 and all(e["tokens"] == 200 for e in ends), ends
    assert mid_stream > 0  # the signal came while streams ran (each sends a response per engine step)
    assert triton.stop() == 0, triton.output()
