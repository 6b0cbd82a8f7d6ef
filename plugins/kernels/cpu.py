"""What this CPU can run and compiling our kernels for it: the flags each kernel needs, torch's
feature table, whether oneDNN packs bf16, and the g++ build (cached per machine)."""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# torch.cpu.get_capabilities() names each kernel needs, and the flags it is compiled with
KERNEL_ISA = {
    "avx512": (("avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16", "avx512_vnni"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]),
    "avx512f": (("avx512_f", "avx512_bw", "avx512_vl"), ["-mavx512f", "-mavx512bw", "-mavx512vl"]),
    "avx2": (("avx2", "fma3", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
}
# Not a rung: the decode attention with AMX tiles beside the avx512 rung (csrc/decode_amx.cpp)
AMX_ISA = ((*KERNEL_ISA["avx512"][0], "amx_tile", "amx_bf16"), [*KERNEL_ISA["avx512"][1], "-mamx-tile", "-mamx-bf16"])


def capabilities() -> dict:
    return torch.cpu.get_capabilities()  # torch's cpuinfo-based feature table


# Without one of these oneDNN emulates bf16 with fp32 FMAs and loses to the avx2 and avx512f rungs'
# paths at every row count past one (measured on an AVX512F Xeon: docs/results/2026-11-30-cpu-linears.md).
BF16_INSTRUCTIONS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


def has_bf16_instructions(caps: dict | None = None) -> bool:
    caps = capabilities() if caps is None else caps
    return any(caps.get(flag, False) for flag in BF16_INSTRUCTIONS)


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 here (fast only with has_bf16_instructions()). It raises on CPUs
    without AVX512BW/VL/DQ or AVX-NE-CONVERT (e.g. AVX2-only EPYCs), and runs a slow path when
    ONEDNN_MAX_CPU_ISA caps it below AVX512: torch's own check, the cap, then a real 2x2 pack."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if not cap.startswith(("ALL", "AVX512", "AVX10", "AMX", "AVX2_VNNI_2")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=torch.bfloat16), 1)
        return True
    except RuntimeError:
        return False


def supported(name: str, caps: dict | None = None) -> bool:
    """Whether this CPU has the instructions kernel `name` is compiled for."""
    caps = capabilities() if caps is None else caps
    return all(caps.get(flag, False) for flag in _isa(name)[0])


def _isa(name: str):
    return AMX_ISA if name == "amx" else KERNEL_ISA[name]


@functools.cache
def build(name: str):
    """Compile (once per machine, cached in $TORCH_EXTENSIONS_DIR) and load kernel `name`; None on failure."""
    from torch.utils.cpp_extension import load

    from plugins.core.console import announce, extension_built

    if not extension_built(f"decode_{name}"):
        announce(f"building the {name} decode kernel with g++ (once per machine, ~25 s)...")
    flags = _isa(name)[1]
    # torch's loader rebuilds when the sources or flags change; the headers' hash goes into the flags
    header = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:16]
    try:
        return load(f"decode_{name}", [str(CSRC / f"decode_{name}.cpp")], verbose=False,
                    extra_cflags=["-O3", "-fopenmp", *flags, f"-DCOMMON_H_SHA={header}"],
                    extra_include_paths=[str(CSRC)])
    except Exception as exc:  # no compiler, old assembler, ...
        warnings.warn(f"{name} decode kernel unavailable ({type(exc).__name__}: {exc}); using a lower rung")
        return None
