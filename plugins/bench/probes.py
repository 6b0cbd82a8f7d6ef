"""What the comparison measures about the machine: read bandwidth, GEMM peak, the batch-1 GEMV
rate, the software environment, and the peak memory of one grid point (this process and its
TP workers)."""

from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil
import torch

from plugins import kernels
from plugins.core.config import REPO_ROOT
from plugins.core.tensors import default_device


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


device = default_device


def measure_bandwidth(nbytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s): best time to sum an fp32 tensor far larger than the caches."""
    nbytes = nbytes or (2 << 30 if device() == "cuda" else 512 << 20)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device())
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        x.sum()
        _sync()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_gemm(dtype: torch.dtype, n: int | None = None, repeats: int = 3) -> float:
    """Dense matmul peak (FLOP/s) in `dtype`: best time of an n x n x n GEMM, on CPU through the linear
    the engines use (plugins.kernels: oneDNN-packed bf16, or fp32 tiles where bf16 has no fast GEMM)."""
    n = n or (8192 if device() == "cuda" else 2048)
    a = torch.randn(n, n, device=device()).to(dtype)
    b = torch.randn(n, n, device=device()).to(dtype)
    packs = kernels.PackedWeights()

    def matmul():
        return a @ b if device() == "cuda" else kernels.linear(a, b, packs=packs)

    matmul()
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        matmul()
        _sync()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def measure_gemv(dtype: torch.dtype, repeats: int = 5) -> float:
    """Bytes/s of weights a batch-1 `F.linear` streams: what a decode step's matmuls get in practice
    (reported beside the roofline, which uses the stream bandwidth above)."""
    w = torch.randn(8192, 4096, device=device()).to(dtype)
    x = torch.randn(1, 4096, device=device()).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        _sync()
        best = min(best, time.perf_counter() - t)
    return w.numel() * w.element_size() / best


def measure_machine(dtype: torch.dtype) -> dict:
    """The figures `configs/hardware/cpu-measured.yaml` leaves to be measured (+ the GEMV rate, for reading)."""
    bw = measure_bandwidth()
    mem = torch.cuda.get_device_properties(0).total_memory if device() == "cuda" else psutil.virtual_memory().total
    path = "cuda" if device() == "cuda" else (kernels.probe("bf16").bf16(2048) if dtype == torch.bfloat16 else "torch")
    return {"mem_bw": bw, "peak_flops": measure_gemm(dtype), "mem_bytes": float(mem), "link_bw": bw,
            "gemv_bw": measure_gemv(dtype), "gemm_dtype": str(dtype).replace("torch.", ""), "gemm_path": path}


def environment(dtype: torch.dtype) -> dict:
    """Versions, CPU, threads; and the CPU linears' choices as `dtype`'s linears run them (fp32 runs
    torch's own: nothing is timed for it)."""
    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "versions": {p: version(p) for p in ("torch", "transformers", "deepspeed", "megatron-core", "tokenizers",
                                             "numpy")} | {"python": platform.python_version()},
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_kernels": None if torch.cuda.is_available() else
        (kernels.probe("bf16") if dtype == torch.bfloat16 else kernels.decision()).describe(),
        "git_commit": commit,
    }


# Peak memory of one grid point. CPU: the kernel's peak-RSS counter (VmHWM) of this process and of
# its children (TP workers), reset at the start of the point by writing 5 to /proc/PID/clear_refs,
# summed at the end. CUDA: torch's max allocated (this process).

def _processes():
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    for p in _processes():
        try:
            Path(f"/proc/{p.pid}/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    total = 0
    for p in _processes():
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) * 1024
        except (OSError, StopIteration, psutil.Error):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
    return total


def release_memory() -> None:
    """Hand freed heap back to the OS between backends, so one backend's leftovers do not count in the
    next one's peak RSS (glibc keeps freed arenas mapped otherwise)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


