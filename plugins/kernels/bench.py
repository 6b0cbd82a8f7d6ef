"""Time the linears of santacoder-1b layers per implementation and row count (what
`python -m plugins.kernels --bench` prints): bf16 as the probe runs it, int8 and int4 by every
kernel this machine has. Best of `reps`; compare within one run (bandwidth moves between runs)."""

from __future__ import annotations

import time

import torch

from plugins.kernels import PackedWeights, linear, probe
from plugins.kernels.quant import int4_linear, int8_linear, quantize_int4, quantize_per_channel

# [out, in] of one santacoder-1b layer: c_attn (MQA), attn c_proj, mlp c_fc, mlp c_proj
LAYER = [(2304, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench(rows=(1, 2, 4, 8, 16, 64), layers: int = 2, reps: int = 7, layer=LAYER) -> list[dict]:
    """ms per pass over `layers` layers' linears, per row count: one dict per row count."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in layer * layers]
    int8 = [(q, s.bfloat16()) for q, s in map(quantize_per_channel, weights)]
    int4 = [quantize_int4(w.float()) for w in weights]
    packs = PackedWeights()
    table = []
    for m in rows:
        x = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in layer}}
        table.append({
            "rows": m,
            f"bf16 {probe().bf16(m)}": _best(lambda: [linear(x[w.shape[1]], w, None, False, packs)
                                                      for w in weights], reps),
            f"int8 {probe().int8(m)}": _best(lambda: [int8_linear(x[q.shape[1]], q, s, None, packs=packs)
                                                      for q, s in int8], reps),
            f"int4 {int4[0].layout}": _best(lambda: [int4_linear(x[w.shape[1]], w, None) for w in int4], reps),
        })
    return table
