"""Our compiled CPU kernels for one-row decode linears (`csrc/decode_linear.cpp`): bf16 weights
(`linear`, used by the injected layers and LM head) and int8 weights (`linear_int8`, plugins.quant).

Built once per machine with torch's JIT extension loader (g++ and ninja, as DeepSpeed builds its
own CPU ops), cached under $TORCH_EXTENSIONS_DIR. They need AVX512-BF16 and AVX512-VNNI; on CPUs
without them, or if the build fails (with a warning), `decode_linear()` is None and callers use
oneDNN / torch's int8 kernel.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_linear.cpp"
ISA = ("avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16", "avx512_vnni")  # what the kernels are compiled for


@functools.cache
def decode_linear():
    """The compiled module, or None. `.linear(x [M, K] bf16, weight [N, K] bf16, bias | None, gelu)` and
    `.linear_int8(x, weight [N, K] int8, scales [N] bf16, bias | None, gelu)` -> [M, N] bf16."""
    caps = torch.cpu.get_capabilities()  # torch's cpuinfo-based feature table
    if not all(caps.get(flag, False) for flag in ISA):
        return None
    from torch.utils.cpp_extension import load

    try:
        return load("decode_linear", [str(SOURCE)], verbose=False,
                    extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
                                  "-mavx512vnni"])
    except Exception as exc:  # no compiler, old assembler, ...
        warnings.warn(f"decode_linear kernel unavailable ({type(exc).__name__}: {exc}); using oneDNN for decode")
        return None
