"""CPU linear layers for decode and prefill, and the one place that decides which implementation runs.

The ladder, fastest first; each rung is a real path with its own tests:

  avx512  our kernels (csrc/decode_avx512.cpp), AVX512-BF16 + VNNI: bf16, int8 and int4 linears of
          any row count (bf16 on weights packed once for vdpbf16ps: csrc/gemm_bf16_avx512.h)
  onednn  oneDNN-packed bf16 weights (`mkldnn._linear_pointwise`), where oneDNN can pack bf16 and
          the CPU has bf16 instructions (AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT); int8 one-row
          steps on the avx2 kernel
  avx512f our bf16 GEMM of the avx512 rung on the same packed weights, AVX512F without bf16
          instructions (csrc/decode_avx512f.cpp: weights widened to fp32 in registers, fp32 FMAs),
          and int8 linears (vpmaddwd, the avx2 kernel's exact integer sums), any row count; int4
          as on the avx2 rung
  avx2    our kernel (csrc/decode_avx2.cpp), AVX2 + FMA: bf16 steps of up to KERNEL_ROWS rows and
          int8 one-row steps (weights widened to fp32 / int16 in registers); more bf16 rows: fp32
  torch   `F.linear` / `aten._weight_int8pack_mm` as torch ships them

`decision()` finds, once per process, the highest rung this CPU supports and whose kernel builds
(a build failure warns once and steps down), capped by the environment variable
PLUGINS_KERNELS=<rung>, so a machine with AVX512 runs the lower paths too (tests, CI).

Which implementation a linear of a given row count runs (`probe(kind)`, asked by the first linear of
that kind: bf16, int8 or int4) is then measured, not read from a table of CPU flags
(plugins/kernels/measure.py): on first use per machine and kind every candidate this CPU runs (our
kernels, oneDNN's packed bf16 linear, which uses AMX tiles where the CPU has them, torch's own ops)
is timed on a santacoder-1b layer at one row count per bucket of BUCKETS (decode, verify, batch,
prefill), and the fastest is used per bucket; the timings are cached beside the compiled kernels,
keyed by the CPU, torch and our kernel sources. One-row steps choose among row-invariant
implementations only (`rows_alone`). PLUGINS_KERNELS_TABLE=static skips the timing and uses the
ladder's fixed choices (`Probe.static`), as tests that check those paths do; a timing that other
processes disturbed gives those too, and is not kept.

bf16 without a GEMM of ours or oneDNN's (AVX2 CPUs, or a forced rung below avx512f): products with
more rows than the kernel takes run in fp32 ('fp32'): each thread converts a tile of weight
rows (~1 MB) into its own buffer and runs torch's fp32 GEMM on it (csrc/common.h), so no copy of
the weight is ever made and bf16 is no slower than fp32 (measured faster: it reads half the bytes).
Without a compiled kernel (torch rung) 'fp32' converts the whole weight for the call (transient:
the largest weight once in fp32, 64 MB for santacoder-1b's c_fc). torch's own bf16 GEMM on such
CPUs has no fast path (seconds per decode step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from plugins.kernels.cpu import (  # noqa: F401 (the package's API)
    BF16_INSTRUCTIONS, CSRC, KERNEL_ISA, build, capabilities, has_bf16_instructions, onednn_packs_bf16, supported)
from plugins.kernels.packing import TILE_COLS, TILED, PackedWeights, pack_tiles  # noqa: F401 (the package's API)

RUNGS = ("avx512", "onednn", "avx512f", "avx2", "torch")
ENV = "PLUGINS_KERNELS"
# The avx2 rung's kernel takes up to this many rows; more run fp32 GEMMs on converted weight tiles,
# which win from there on (docs/results/2026-11-30-cpu-linears.md).
KERNEL_ROWS = 16
# From a short prompt's prefill on, oneDNN's bf16 GEMM beats our avx512 kernel where it runs (AMX Xeon,
# measured 2026-12-07: 3.2x at 64 rows, 6.6x at 256), so the fixed ladder hands it those rows
STATIC_GEMM_ROWS = 32
# Implementations whose every output row is computed as that row alone would be (see rows_alone)
ROW_INVARIANT = (*TILED, "avx2")


# Row buckets: upper bounds of decode (1), speculative verify (2-8), batched decode (9-32), one short
# prompt's prefill (33-128), prefill (129-512), then batched prefill; the row count each is timed at
# (measure.py). Batched prefill has its own: at 2048 rows converting the whole weight for one fp32
# GEMM beat per-thread converted tiles by 1.3-1.6x, at 256 rows it lost by 1.6x (AVX2 EPYC, 2 threads)
BUCKETS = (1, 8, 32, 128, 512)
TIMED_ROWS = (1, 4, 16, 64, 256, 2048)
TABLE_ENV = "PLUGINS_KERNELS_TABLE"
KINDS = ("bf16", "int8", "int4")


def bucket(rows: int) -> int:
    return next((i for i, top in enumerate(BUCKETS) if rows <= top), len(BUCKETS))


def bucket_label(i: int) -> str:
    low = 1 if i == 0 else BUCKETS[i - 1] + 1
    return str(low) if i == 0 else f"{low}-{BUCKETS[i]}" if i < len(BUCKETS) else f">{BUCKETS[-1]}"


@dataclass(frozen=True)
class Probe:
    """Which implementation each linear uses on this machine, by dtype and number of rows."""

    rung: str                  # the highest rung in use (RUNGS)
    bf16_gemm: bool            # multi-row bf16 has a fast GEMM (oneDNN packing) at this rung
    forced: str | None = None  # the PLUGINS_KERNELS cap, if set
    modules: dict = field(default_factory=dict, compare=False, repr=False)  # compiled kernels by name
    # measured: kind -> implementation per bucket for the kinds timed so far (None: the static ladder;
    # a kind not timed yet runs its static choice), and the timings behind them
    choices: dict | None = None
    timings: dict = field(default_factory=dict, compare=False, repr=False)

    def bf16(self, rows: int) -> str:
        """'avx512' | 'avx512f' | 'avx2' (our kernels), 'onednn', 'fp32' (fp32 GEMMs on weight tiles each
        thread converts), 'fp32-whole' (the weight converted for the call, one fp32 GEMM), 'torch'."""
        return self._choice("bf16", rows)

    def int8(self, rows: int) -> str:
        """'avx512' | 'avx512f' | 'avx2' (our kernels), 'torch' (aten._weight_int8pack_mm) or 'dequant'
        (the weight widened to bf16 for the call, then the bf16 choice)."""
        return self._choice("int8", rows)

    def int4(self) -> str:
        """'avx512' (our kernel, bf16 activations, any rows) or 'torch' (aten._weight_int4pack_mm_for_cpu):
        one pack per weight, so one answer for every row count (the faster at one row)."""
        return self._choice("int4", 1)

    def _choice(self, kind: str, rows: int) -> str:
        if self.choices and kind in self.choices:
            return self.choices[kind][0 if kind == "int4" else bucket(rows)]
        return self.static(kind, rows)

    def static(self, kind: str, rows: int) -> str:
        """The ladder's fixed choice (no timing): what PLUGINS_KERNELS_TABLE=static runs, and what a
        process runs whose timing the machine's load spoiled."""
        if kind == "bf16":
            if self.rung in TILED and not (self.bf16_gemm and rows > STATIC_GEMM_ROWS):
                return self.rung
            if rows <= KERNEL_ROWS and self.rung == "avx2":
                return "avx2"
            if self.bf16_gemm:
                return "onednn"
            return "torch" if rows <= 1 else "fp32"
        if kind == "int8":
            for name in ("avx512", "avx512f"):  # any rows
                if name in self.modules:
                    return name
            if rows <= 1 and "avx2" in self.modules:
                return "avx2"
            return "torch" if rows < DEQUANT_ROWS else "dequant"
        return "avx512" if "avx512" in self.modules else "torch"

    def candidates(self, kind: str) -> list[str]:
        """Every implementation of `kind` this process can run (measure.py times them)."""
        ours = [name for name in KERNEL_ISA if name in self.modules]
        if kind == "bf16":
            return ours + (["onednn"] if self.onednn else []) + (["fp32"] if ours else []) + ["fp32-whole", "torch"]
        if kind == "int8":
            return ours + ["torch", "dequant"]
        return (["avx512"] if "avx512" in self.modules else []) + ["torch"]

    @property
    def onednn(self) -> bool:
        """oneDNN's packed bf16 linear may run here: no cap below its rung, and oneDNN packs bf16."""
        allowed = self.forced is None or RUNGS.index(self.forced) <= RUNGS.index("onednn")
        return allowed and onednn_packs_bf16()

    def kernel(self, impl: str):
        return self.modules[impl]

    def describe(self) -> dict:
        """What ran, for results.json and the console: the rung, the choice per dtype and row bucket, and
        (measured) the best ms per candidate behind each choice."""
        out = {"rung": self.rung, "forced": self.forced, "bf16_gemm": self.bf16_gemm,
               "table": "measured" if self.choices else table_mode()}
        if out["table"] == "measured" and not self.choices:  # `decision()`: nothing asked for a choice yet
            return out | {"table": "not measured (no bf16, int8 or int4 linear ran)"}
        labels = [bucket_label(i) for i in range(len(BUCKETS) + 1)]
        rows = [1, *(top for top in BUCKETS[1:]), BUCKETS[-1] + 1]  # a row count in each bucket
        unasked = "not measured (no linear of this kind ran)"
        for kind in ("bf16", "int8"):
            out[kind] = (unasked if self.choices and kind not in self.choices
                         else {label: self._choice(kind, r) for label, r in zip(labels, rows)})
        out["int4"] = unasked if self.choices and "int4" not in self.choices else self.int4()
        if self.timings:
            out["timings_ms"] = self.timings
            busy = [kind for kind, t in self.timings.items() if isinstance(t, str)]  # measure.py: not kept
            if busy:
                out["table"] = (f"static for {'/'.join(busy)}: the machine was busy while timing"
                                + (", measured for the others" if len(busy) < len(self.choices) else ""))
        return out


# int8 with torch's kernel: the packed kernel's cost grows with the rows; dequantizing costs a fixed ~2
# passes over the weight, so from some hundreds of rows dequantizing wins (docs/results/2026-11-30-cpu-linears.md)
DEQUANT_ROWS = 256


def forced_rung() -> str | None:
    value = os.environ.get(ENV, "").strip().lower() or None
    if value is not None and value not in RUNGS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(RUNGS)}")
    return value


_DECISION: Probe | None = None  # plain globals: torch.compile reads them without tracing the probe
_PROBE: Probe | None = None
_TIMING = False  # a timing runs now: the linears it runs are named, and nothing asked inside times again
_MEASURED = False  # PLUGINS_KERNELS_TABLE says measured (read once, with the decision: probe() runs per linear)


def decision() -> Probe:
    """The rung and the compiled kernels of this process, without the measured table: what callers
    that need a kernel module (not a choice among implementations) ask, so fp32 runs time nothing."""
    global _DECISION
    if _DECISION is None:
        _DECISION = _decide(measuring=table_mode() == "measured")
    return _DECISION


def probe(kind: str | None = None) -> Probe:
    """The ladder decision with the implementation per row bucket of `kind`'s linears ("bf16",
    "int8", "int4"; None: every kind): measured on first use per machine and kind (then read from the
    cache file), or the static ladder. A bf16 server never times the int8 or int4 candidates."""
    global _PROBE, _TIMING, _MEASURED
    if _PROBE is None:
        _PROBE, _MEASURED = decision(), table_mode() == "measured"
    measured = _PROBE.choices or {}
    if not _MEASURED or _TIMING or kind in measured:
        return _PROBE
    kinds = [k for k in ((kind,) if kind else KINDS) if k not in measured]
    if kinds:
        from plugins.kernels.measure import measured_choices

        found, _TIMING = _PROBE, True
        try:
            choices, timings = measured_choices(found, kinds=kinds)
            _PROBE = replace(found, choices={**(found.choices or {}), **choices},
                             timings={**found.timings, **timings})
        except Exception as exc:  # a candidate that fails to run here: the static ladder for these, said once
            warnings.warn(f"timing the {'/'.join(kinds)} linear implementations failed "
                          f"({type(exc).__name__}: {exc}); using the static ladder")
            _PROBE = replace(found, choices={**(found.choices or {}),
                                             **{k: tuple(found.static(k, r) for r in (1, *BUCKETS[1:], BUCKETS[-1] + 1))
                                                for k in kinds}})
        finally:
            _TIMING = False
    return _PROBE


def table_mode() -> str:
    value = os.environ.get(TABLE_ENV, "").strip().lower() or "measured"
    if value not in ("measured", "static"):
        raise ValueError(f"{TABLE_ENV}={value!r}: expected 'measured' or 'static'")
    return value


def _decide(measuring: bool = False) -> Probe:
    """The rung and the compiled kernels. Timing wants every kernel this CPU runs (below the cap);
    the static ladder only those it uses."""
    forced = forced_rung()
    allowed = RUNGS[RUNGS.index(forced):] if forced else RUNGS
    caps = capabilities()
    bf16_gemm = "onednn" in allowed and has_bf16_instructions(caps) and onednn_packs_bf16()
    modules = {}
    if measuring:  # every kernel this CPU runs: compile them side by side (one g++ each), not one after another
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(build, [n for n in ("avx512", "avx512f", "avx2") if n in allowed and supported(n, caps)]))
    # static: avx2 is also the int8 one-row kernel of the onednn and avx512f rungs; avx512f only where
    # neither avx512 nor oneDNN's bf16 GEMM runs
    for name in ("avx512", "avx512f", "avx2"):
        wanted = measuring or ("avx512" not in modules and not (name == "avx512f" and bf16_gemm))
        if name in allowed and wanted and supported(name, caps):
            module = build(name)
            if module is not None:
                modules[name] = module
    for rung in allowed:
        if rung in modules or rung == "torch" or (rung == "onednn" and bf16_gemm):
            return Probe(rung, bf16_gemm, forced, modules)
    raise AssertionError("unreachable: the torch rung is always available")


def reset() -> None:
    """Forget the decision (tests that change PLUGINS_KERNELS)."""
    global _DECISION, _PROBE, _TIMING, _MEASURED
    _DECISION = _PROBE = None
    _TIMING = _MEASURED = False


_ROWS_ALONE = False  # plain global, as _PROBE


@contextlib.contextmanager
def rows_alone():
    """Inside, a CPU linear computes every row with the arithmetic one row gets alone (our kernels are
    row-invariant: each output takes the same instructions in the same order whatever the row count),
    so a speculative verify of k + 1 tokens reproduces k + 1 one-token steps bit for bit. (On the avx512
    rung every row count already runs that way.)"""
    global _ROWS_ALONE
    before, _ROWS_ALONE = _ROWS_ALONE, True
    try:
        yield
    finally:
        _ROWS_ALONE = before


def rows_alone_active() -> bool:
    return _ROWS_ALONE


def choice_rows(rows: int) -> int:
    """The row count the probe is asked about: 1 inside `rows_alone()`."""
    return 1 if _ROWS_ALONE else rows


def bf16_choice(x: torch.Tensor) -> str | None:
    """The implementation a bf16 CPU input `x` [..., K] gets; None for other dtypes and devices."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    rows = choice_rows(x.numel() // x.shape[-1])
    if torch.compiler.is_compiling():  # traceable paths only; inductor packs weights itself
        return "torch" if _DECISION is None or _DECISION.bf16_gemm or rows <= 1 else "fp32"
    return probe("bf16").bf16(rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
           packs: PackedWeights | None = None, impl: str | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) (then tanh GELU); weight [N, K] stored row-major (nn.Linear's layout).

    bf16 on CPU runs the probe's choice for this many rows (or `impl`, a name Probe.bf16 gives);
    everything else is `F.linear`."""
    impl = impl or bf16_choice(x)
    if impl in TILED:  # without `packs`, the weight is packed for this call only
        packed = (packs or PackedWeights()).get(weight, impl)
        out = decision().kernel(impl).linear_tiles(x.reshape(-1, x.shape[-1]).contiguous(), packed,
                                                   weight.shape[0], bias, gelu)
        return out.view(*x.shape[:-1], weight.shape[0])
    if impl == "avx2":
        out = decision().kernel(impl).linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, gelu)
        return out.view(*x.shape[:-1], weight.shape[0])
    if impl == "onednn":
        packed = (packs or PackedWeights()).get(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu" if gelu else "none", [],
                                                  "tanh" if gelu else "")
    if impl in ("fp32", "fp32-whole"):
        module = next(iter(decision().modules.values()), None) if not torch.compiler.is_compiling() else None
        if module is not None and impl == "fp32":
            out = module.linear_fp32(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, gelu)
            return out.view(*x.shape[:-1], weight.shape[0])
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return (F.gelu(out, approximate="tanh") if gelu else out).to(x.dtype)
    out = F.linear(x, weight, bias)
    return F.gelu(out, approximate="tanh") if gelu else out


def packed_bf16_impls() -> list[str]:
    """The bf16 implementations with a weight pack of their own (our tiles, oneDNN's reorder) that the
    probe picks at some row count: what a model packs once, at load (`PackedWeights.prepack`)."""
    p = probe("bf16")
    picks = {p.bf16(rows) for rows in (1, *(top + 1 for top in BUCKETS))}  # a row count per bucket
    return sorted(impl for impl in picks if impl in TILED or impl == "onednn")


def paths(dtype: torch.dtype, batch: int, prompt_len: int, int8: bool = False) -> dict:
    """What `linear` / `int8_linear` run for a decode step of `batch` rows and a prefill of
    batch x prompt_len rows, in `dtype` on CPU (the probe's choice; CUDA and fp32: 'torch')."""
    if dtype != torch.bfloat16 or torch.cuda.is_available():
        return {"decode": "torch", "prefill": "torch"}
    p = probe("int8" if int8 else "bf16")
    if int8:
        return {"decode": f"int8 {p.int8(batch)}", "prefill": f"int8 {p.int8(batch * prompt_len)}"}
    return {"decode": p.bf16(batch), "prefill": p.bf16(batch * prompt_len)}


def slow_dtypes() -> list[str]:
    """Dtypes torch itself computes without a fast GEMM here (HF and other plain-torch engines)."""
    return [] if onednn_packs_bf16() else ["bfloat16"]
