"""Our compiled CPU kernel: the bf16 decode linear in `csrc/decode_linear.cpp`.

Built once per machine with torch's JIT extension loader (g++ and ninja, as DeepSpeed builds its
own CPU ops), cached under $TORCH_EXTENSIONS_DIR. It needs AVX512-BF16; on CPUs without it, or if
the build fails (with a warning), `decode_linear()` is None and the layers use oneDNN.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "decode_linear.cpp"
ISA = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo flags the kernel is compiled for


def cpu_has_isa() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in ISA)


@functools.cache
def decode_linear():
    """The compiled module (`.linear(x [M, K], weight [N, K], bias | None, gelu) -> [M, N]`, bf16), or None."""
    if not cpu_has_isa():
        return None
    from torch.utils.cpp_extension import load

    try:
        return load("decode_linear", [str(SOURCE)], verbose=False,
                    extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"])
    except Exception as exc:  # no compiler, old assembler, ...
        warnings.warn(f"decode_linear kernel unavailable ({type(exc).__name__}: {exc}); using oneDNN for decode")
        return None
