"""The rest of a decoder layer's CPU bf16 work, fused in our kernels: the residual adds with the layer
norm (csrc/layer_norm.h, every compiled rung) and one-token attention on an MQA cache
(csrc/attention_avx512.h, the AVX512 rungs; on AMX tiles where the CPU has AMX-BF16: csrc/decode_amx.cpp,
1.4-1.6x faster at every shape measured, docs/kernels.md). Where no kernel applies (other dtypes, CUDA, the torch
rung, under torch.compile) each function says so (None / False) and the caller runs torch's ops.

What they save is small (a few percent of a decode step: docs/results/2026-11-30-fused-layer-kernels.md);
they are timed on their own against torch's ops, not under the profiler, whose per-op overhead makes
torch's small ops look several times slower.
"""

from __future__ import annotations

import functools
import os

import torch

from plugins import kernels

AMX_ENV = "PLUGINS_KERNELS_AMX"  # "0": the avx512 rung's decode attention on an AMX Xeon too


@functools.cache
def amx_module():
    """csrc/decode_amx.cpp where it runs: the avx512 rung in use, a CPU with AMX-BF16, the kernel built and
    the tiles granted by the OS, unless PLUGINS_KERNELS_AMX=0; else None."""
    if os.environ.get(AMX_ENV) == "0" or "avx512" not in kernels.decision().modules or not kernels.supported("amx"):
        return None
    module = kernels.build("amx")
    return module if module is not None and module.amx_ready() else None


def compiled(name: str):
    """The kernel `name` of the first compiled module that has it (the decode attention: AMX's where it
    runs); None where none has (the torch rung)."""
    if name == "mqa_decode_attention" and amx_module() is not None:
        return amx_module().mqa_decode_attention
    return next((getattr(m, name) for m in kernels.decision().modules.values() if hasattr(m, name)), None)


def _kernel(name: str, *tensors):
    """The compiled kernel `name`, if every tensor given is a bf16 CPU tensor; else None."""
    if torch.compiler.is_compiling():
        return None
    if any(t is not None and (t.device.type != "cpu" or t.dtype != torch.bfloat16) for t in tensors):
        return None
    return compiled(name)


def add_layer_norm(x, gamma, beta, eps: float, y=None, bias=None):
    """(s, layer_norm(s)) for s = x + y + bias (s = x without y) over the last dim, in one pass;
    s is rounded once to bf16 (fp32 sum). None where no kernel applies."""
    kernel = _kernel("add_layer_norm", x, y, bias, gamma, beta)
    if kernel is None:
        return None
    n = x.shape[-1]
    s, normed = kernel(x.reshape(-1, n).contiguous(), None if y is None else y.reshape(-1, n).contiguous(),
                       bias, gamma.contiguous(), beta.contiguous(), float(eps))
    return s.view(x.shape), normed.view(x.shape)


def add_residuals_(x, a, a_bias, y, y_bias) -> bool:
    """In place: x = (x + a + a_bias) + y + y_bias, each sum in fp32 rounded once to bf16 (the two
    residual adds of a pre-LN layer: attention output a, MLP output y). False where no kernel applies."""
    kernel = _kernel("add_residuals_", x, a, a_bias, y, y_bias)
    if kernel is None or not x.is_contiguous():
        return False
    n = x.shape[-1]
    kernel(x.view(-1, n), a.reshape(-1, n).contiguous(), a_bias, y.reshape(-1, n).contiguous(), y_bias)
    return True


def mqa_decode_attention(query, key, value, allowed, scale: float):
    """One query token per sequence on a one-head cache: query [B, H, D], key / value [B, L, D] (views
    of the cache are fine: only the last dim must be contiguous), allowed [B, L] bool (True = attend)
    or None -> [B, H * D]. None where no kernel applies."""
    kernel = _kernel("mqa_decode_attention", query, key, value)
    if (kernel is None or (allowed is not None and allowed.dtype != torch.bool)
            or any(t.stride(-1) != 1 for t in (query, key, value))):
        return None
    return kernel(query, key, value, allowed, float(scale))
