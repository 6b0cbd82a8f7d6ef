"""keep_freed_memory: what one step frees, the next reuses (no fresh pages faulted in per step)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A step's pattern on a thread started after the call (as the engine's step thread is): two 32 MiB
# activations made and freed per step beside long-lived tensors; the median page faults of 10 steps after
# warm-up (a step that grows the heap faults in its new pages once).
STEPS = r"""
import resource, sys, threading, torch
sys.path.insert(0, sys.argv[2])
from plugins.kernels.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def work():
    a = torch.ones(2048, 8192, dtype=torch.bfloat16)
    w = torch.ones(2048, 2048, dtype=torch.bfloat16)
    def step():
        h = a + 1
        g = h * 2
        return (g[:, :2048] + w).sum()
    faults = []
    for _ in range(13):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(kept, sorted(faults[3:])[5])
t = threading.Thread(target=work)
t.start()
t.join()
"""


def faults_per_step(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode, str(ROOT)], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}).stdout.split()
    return out[0], float(out[1])


def test_freed_activations_are_reused_not_faulted_in_again():
    page = 4096
    _, default = faults_per_step("default")
    kept, after = faults_per_step("keep")
    assert kept == "True"  # glibc took every setting
    assert default > (32 << 20) // page  # glibc's defaults: at least one activation's pages per step, afresh
    assert after < 100, f"{after} page faults per step with freed memory kept"


def test_a_preloaded_allocator_is_left_alone(monkeypatch):
    from plugins.kernels.allocator import keep_freed_memory

    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert keep_freed_memory() is False
