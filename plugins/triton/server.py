"""NVIDIA Triton Inference Server as mqa-triton runs it: the server binary nvidia-pytriton's wheel
bundles (in .venv-triton, `make triton`), a model repository written for our one model, and the
environment its Python backend stub needs.

Why the bundled binary and not `tritonserver` (PyPI's in-process API): that wheel is only Python
bindings for CPython 3.12 on glibc 2.39, and loads libtritonserver.so from a Triton container
(docs/deployment.md says what each gives on these machines).

The stub (triton_python_backend_stub, one process per model instance) is built for one CPython minor
version and links libpython3.X.so.1.0: it must load the libpython of the interpreter whose standard
library it then reads, else the two disagree (a Debian libpython 3.11.2 under pyenv's 3.11.7 library
failed in multiprocessing's resource tracker: `'_thread.RLock' object has no attribute
'_recursion_count'`). So the stub gets .venv-triton's interpreter's library directory first on
LD_LIBRARY_PATH, and that venv's bin first on PATH (an embedded CPython finds its prefix, hence the
venv's site-packages, from the `python3` on PATH).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-triton"
MODEL_PY = Path(__file__).with_name("model.py")

# Inputs as Triton's LLM examples name them (vLLM backend: text_input, stream, sampling_parameters,
# exclude_input_in_output, return_*; TensorRT-LLM's ensemble: max_tokens, temperature, top_k, top_p,
# random_seed, stop_words, ...), and vLLM's SamplingParams names besides. All but text_input optional.
INPUTS = [
    ("text_input", "TYPE_STRING", 1), ("stream", "TYPE_BOOL", 1), ("sampling_parameters", "TYPE_STRING", 1),
    ("max_tokens", "TYPE_INT32", 1), ("temperature", "TYPE_FP32", 1), ("top_p", "TYPE_FP32", 1),
    ("top_k", "TYPE_INT32", 1), ("min_p", "TYPE_FP32", 1), ("seed", "TYPE_UINT64", 1),
    ("random_seed", "TYPE_UINT64", 1), ("stop", "TYPE_STRING", -1), ("stop_words", "TYPE_STRING", -1),
    ("stop_token_ids", "TYPE_INT32", -1), ("repetition_penalty", "TYPE_FP32", 1),
    ("presence_penalty", "TYPE_FP32", 1), ("frequency_penalty", "TYPE_FP32", 1), ("min_tokens", "TYPE_INT32", 1),
    ("min_length", "TYPE_INT32", 1), ("ignore_eos", "TYPE_BOOL", 1), ("exclude_input_in_output", "TYPE_BOOL", 1),
    ("return_finish_reason", "TYPE_BOOL", 1), ("return_num_input_tokens", "TYPE_BOOL", 1),
    ("return_num_output_tokens", "TYPE_BOOL", 1),
]
OUTPUTS = [("text_output", "TYPE_STRING", -1), ("finish_reason", "TYPE_STRING", -1),
           ("num_input_tokens", "TYPE_UINT32", 1), ("num_output_tokens", "TYPE_UINT32", 1)]


class TritonMissing(RuntimeError):
    pass


@dataclass
class Install:
    """Where the bundled Triton and the Python its stub runs on are."""

    venv: Path
    root: Path          # .../site-packages/pytriton/tritonserver
    libs: Path          # .../site-packages/nvidia_pytriton.libs
    python_version: str
    python_libdir: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.root / "python_backend_stubs" / self.python_version / "triton_python_backend_stub"


def find_install(venv: Path = DEFAULT_VENV) -> Install:
    python = venv / "bin" / "python"
    if not python.exists():
        raise TritonMissing(f"no Triton venv at {venv}: `make triton` installs it (requirements-triton.txt)")
    probe = ("import json, sys, sysconfig, pathlib, pytriton; print(json.dumps({"
             "'root': str(pathlib.Path(pytriton.__file__).parent / 'tritonserver'), "
             "'version': '%d.%d' % sys.version_info[:2], 'libdir': sysconfig.get_config_var('LIBDIR'), "
             "'soname': sysconfig.get_config_var('INSTSONAME'), "
             "'shared': sysconfig.get_config_var('Py_ENABLE_SHARED')}))")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise TritonMissing(f"{python} cannot import pytriton (`make triton`): {done.stderr.strip()[-500:]}")
    found = json.loads(done.stdout)
    root = Path(found["root"])
    install = Install(venv, root, root.parent.parent / "nvidia_pytriton.libs", found["version"], Path(found["libdir"]))
    for path in (install.binary, install.stub, root / "backends" / "python" / "libtriton_python.so"):
        if not path.exists():
            raise TritonMissing(f"{path} is missing: nvidia-pytriton has no Triton server or Python "
                                f"{install.python_version} stub for this platform")
    if not found["shared"] or not (install.python_libdir / found["soname"]).exists():
        raise TritonMissing(f"{venv}'s Python has no shared library ({install.python_libdir / found['soname']}): "
                            "Triton's Python backend stub links libpython; build the venv from a CPython "
                            "configured with --enable-shared")
    return install


def config_pbtxt(name: str, instances: int, socket_path: str) -> str:
    def tensor(n, t, d, optional):
        return (f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]'
                f'{" optional: true" if optional else ""} }}')

    inputs = ",\n".join(tensor(n, t, d, n != "text_input") for n, t, d in INPUTS)
    outputs = ",\n".join(tensor(n, t, d, False) for n, t, d in OUTPUTS)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{ decoupled: true }}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
            f'parameters {{ key: "engine_socket" value: {{ string_value: "{socket_path}" }} }}\n')


def write_repository(workdir: Path, install: Install, name: str, instances: int, socket_path: str) -> tuple[Path, Path]:
    """(model repository, backend directory) under `workdir`: our model, and a python backend whose stub
    is the one built for .venv-triton's Python."""
    repo = workdir / "models"
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config_pbtxt(name, instances, socket_path))
    shutil.copy(MODEL_PY, repo / name / "1" / "model.py")
    backends = workdir / "backends"
    (backends / "python").mkdir(parents=True)
    source = install.root / "backends" / "python"
    for entry in source.iterdir():
        if entry.is_file():
            (backends / "python" / entry.name).symlink_to(entry)
    (backends / "python" / "triton_python_backend_stub").symlink_to(install.stub)
    return repo, backends


def environment(install: Install) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(install.python_libdir), str(install.libs)] + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])
    env["PATH"] = os.pathsep.join([str(install.venv / "bin"), os.environ.get("PATH", "/usr/bin:/bin")])
    return env


class TritonServer:
    """The tritonserver process over a model repository of ours (started by `start`, stopped by `stop`)."""

    def __init__(self, install: Install, model: str, instances: int, host: str, http_port: int,
                 grpc_port: int, metrics_port: int, exit_timeout: float, extra: list[str] = ()):
        self.install, self.model, self.host = install, model, host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.workdir = Path(tempfile.mkdtemp(prefix="mqa-triton-"))  # private (0700): the engine's socket is here
        self.socket_path = str(self.workdir / "engine.sock")
        self.repo, self.backends = write_repository(self.workdir, install, model, instances, self.socket_path)
        self.args = [
            str(install.binary), f"--model-repository={self.repo}", f"--backend-directory={self.backends}",
            f"--http-address={host}", f"--http-port={http_port}", f"--grpc-address={host}",
            f"--grpc-port={grpc_port}", f"--metrics-address={host}", f"--metrics-port={metrics_port}",
            f"--exit-timeout-secs={max(1, int(exit_timeout + 0.999))}",
            # a CPU machine: no pinned host memory, no GPU metrics (each only logs a failure there)
            "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false", "--log-info=false", *extra]
        self.proc: subprocess.Popen | None = None
        self._terminated = False

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=environment(self.install), stdin=subprocess.DEVNULL)

    def url(self, path: str = "") -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.http_port}{path}"

    def model_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url(f"/v2/models/{self.model}/ready"), timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float, alive=lambda: True) -> None:
        deadline = time.monotonic() + timeout
        while not self.model_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} before the model was ready")
            if not alive():
                raise RuntimeError("the engine failed while Triton started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the model was not ready in Triton after {timeout:.0f} s")
            time.sleep(0.1)

    def terminate(self) -> None:
        """SIGTERM, once (Triton logs each one)."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM: Triton refuses new requests and waits (--exit-timeout-secs) for those in flight;
        SIGKILL if it has not exited `timeout` seconds later. Its return code."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
