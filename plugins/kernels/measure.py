"""Choose each linear's implementation by timing it on this machine (the probe's measured table).

On first use per machine and kind, every candidate of `Probe.candidates` for that kind (bf16, int8
or int4: only the kinds the process asks for) runs the four
linears of one santacoder-1b layer (85 MB of bf16 weights: past the caches, as a real step is) at
one row count per bucket (TIMED_ROWS; the last, 2048 rows, on its two MLP linears only), interleaved
with the other candidates of that bucket, best of a few passes (fewer where a pass is long). A
candidate whose first pass takes several times the best is not run again, and from 256 rows on (where
per-row cost dominates fixed costs such as a conversion) not timed at larger row counts either (null
in the table: it cannot be chosen there).
The fastest per bucket is chosen; the decode bucket (one row) chooses among row-invariant
implementations only, since exact speculative verification (`rows_alone`) runs every row as that
one-row choice. The timings are kept in a JSON file beside the compiled kernels, keyed by the CPU's
model name and flags, the torch version, the thread count and our kernel sources, so the next process
reads them; a file lock keeps concurrent processes (tensor-parallel ranks) from timing at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from plugins.kernels import BUCKETS, CSRC, KINDS, ROW_INVARIANT, TIMED_ROWS, PackedWeights, Probe, bucket_label, linear
from plugins.kernels.quant import int4_linear, int8_linear, quantize_int4, quantize_per_channel

# [out, in] of one santacoder-1b layer: c_attn (MQA), attn c_proj, mlp c_fc, mlp c_proj
LAYER = [(2304, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
PASSES = 3          # more timed passes per candidate and bucket after the first,
RACE_BUDGET_S = 3.0  # while a bucket's race has taken less than this
GIVE_UP = 4.0       # a candidate this many times slower than the best is not timed again (nor at more rows)
DROP_FROM_ROWS = 256  # from this many rows a candidate GIVE_UP times slower is not timed at more rows
FORMAT = 2          # bump when the file's meaning changes
# int8 implementations whose rows are computed as each row alone (exact integer sums)
INT8_ROW_INVARIANT = ("avx512", "avx512f", "avx2")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def machine_key() -> str:
    """What the timings depend on: CPU, its flags, torch, threads, our kernel sources and this file."""
    flags = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)
    sources = b"".join(p.read_bytes() for p in [*sorted(CSRC.glob("*.*")), Path(__file__)])
    text = json.dumps([FORMAT, cpu_model(), flags, torch.__version__, torch.get_num_threads(), LAYER, TIMED_ROWS,
                       hashlib.sha256(sources).hexdigest()])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("kernel_choices", verbose=False))


def measured_choices(p: Probe, path: Path | None = None, kinds=KINDS) -> tuple[dict, dict]:
    """(choices: kind -> implementation per bucket, timings: kind -> bucket label -> {impl: ms}) for the
    candidates `p` offers for `kinds`, from the cache file when it holds them all, else timed now (and
    cached beside the other kinds' timings)."""
    path = path or cache_dir() / f"{machine_key()}.json"
    wanted = {kind: p.candidates(kind) for kind in kinds}
    timings = _read(path)
    if not _covers(timings, wanted):
        with _locked(path.with_suffix(".lock")):
            timings = _read(path)  # another process may have timed them meanwhile
            if not _covers(timings, wanted):
                from plugins.core.console import announce

                announce(f"timing the CPU {'/'.join(wanted)} linear implementations on this machine (once per machine, "
                         "kind and thread count, ~20-60 s)...")
                timings = _merge(timings, time_candidates(wanted))
                _write(path, timings)
    return choose(timings, wanted), {k: {b: {i: timings[k][b][i] for i in wanted[k]} for b in timings[k]}
                                     for k in wanted}


def choose(timings: dict, wanted: dict) -> dict:
    """The fastest candidate per kind (of `wanted`) and bucket; the one-row bucket among row-invariant
    ones (if any)."""
    choices = {}
    for kind in wanted:
        invariant = ROW_INVARIANT if kind == "bf16" else INT8_ROW_INVARIANT if kind == "int8" else wanted[kind]
        row = []
        for i in range(len(BUCKETS) + 1):
            times = timings[kind][bucket_label(i)]
            timed = [c for c in wanted[kind] if times[c] is not None]
            pool = [c for c in timed if i > 0 or c in invariant] or timed
            row.append(min(pool, key=lambda c: times[c]))
        choices[kind] = tuple(row)
    return choices


def time_candidates(wanted: dict, layer=LAYER) -> dict:
    """kind (of `wanted`) -> bucket label -> {impl: best ms of one pass over `layer`'s linears}."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in layer]
    biases = [torch.randn(n, generator=gen).bfloat16() for n, _ in layer]
    int8 = [(q, s.bfloat16()) for q, s in map(quantize_per_channel, weights)] if "int8" in wanted else []
    int4 = {impl: [quantize_int4(w.float(), layout=impl) for w in weights] for impl in wanted.get("int4", ())}
    packs = PackedWeights()

    def runner(kind, impl, x, only=None):
        pick = (lambda seq: seq) if only is None else (lambda seq: [seq[j] for j in only])
        if kind == "bf16":
            return lambda: [linear(x[w.shape[1]], w, b, False, packs, impl) for w, b in zip(pick(weights), pick(biases))]
        if kind == "int8":
            return lambda: [int8_linear(x[q.shape[1]], q, s, b, False, packs, impl)
                            for (q, s), b in zip(pick(int8), pick(biases))]
        return lambda: [int4_linear(x[w.shape[1]], w, b) for w, b in zip(pick(int4[impl]), pick(biases))]

    x = {k: torch.randn(1, k, generator=gen).bfloat16() for k in {k for _, k in layer}}
    for kind in wanted:  # packs made (once per weight, as in a model) before anything is timed
        for impl in wanted[kind]:
            runner(kind, impl, x)()
    out = {kind: {} for kind in wanted}
    dropped = {kind: set() for kind in wanted}
    last = len(TIMED_ROWS) - 1
    for i, rows in enumerate(TIMED_ROWS):
        x = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in layer}}
        # the last bucket on the MLP's two linears (80 % of the FLOPs; their shapes favour different paths)
        only = sorted(range(len(layer)), key=lambda j: -layer[j][0] * layer[j][1])[:2] if i == last else None
        for kind in wanted:
            live = {impl: runner(kind, impl, x, only) for impl in wanted[kind] if impl not in dropped[kind]}
            times = _race(live)
            best = min(times.values())
            if rows >= DROP_FROM_ROWS:  # compute-bound from here: a fixed cost (a conversion) no longer hides
                dropped[kind] |= {impl for impl, ms in times.items() if ms > GIVE_UP * best}
            out[kind][bucket_label(i)] = {impl: times.get(impl) for impl in wanted[kind]}
    return out


def _race(fns: dict) -> dict:
    """Best ms per function: one pass each, then up to PASSES rounds (while the race is under
    RACE_BUDGET_S) that run every remaining function once in turn, so a swing of the machine's
    bandwidth hits all."""
    began = time.perf_counter()
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = (time.perf_counter() - start) * 1e3
    best = dict(first)
    live = [n for n in fns if first[n] <= GIVE_UP * min(first.values())]
    for _ in range(PASSES):
        if time.perf_counter() - began > RACE_BUDGET_S:
            break
        for name in live:
            start = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return {name: max(round(ms, 4), 1e-4) for name, ms in best.items()}


def _covers(timings: dict | None, wanted: dict) -> bool:
    try:
        return all(set(wanted[k]) <= set(timings[k][bucket_label(i)])
                   for k in wanted for i in range(len(BUCKETS) + 1))
    except (KeyError, TypeError):
        return False


def _merge(old: dict | None, new: dict) -> dict:
    """New timings replace old ones per kind and bucket (a kind timed again is timed whole)."""
    merged = {k: dict((old or {}).get(k) or {}) for k in KINDS}
    for kind, buckets in new.items():
        merged[kind].update(buckets)
    return merged


def _read(path: Path) -> dict | None:
    """The cached timings (the kinds timed so far), or None when absent or not of the expected shape
    (then timed again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and all(
        isinstance(data[k], dict) and all(
            isinstance(b, dict) and all(v is None or isinstance(v, (int, float)) and v > 0 for v in b.values())
            and any(v is not None for v in b.values()) for b in data[k].values()) for k in KINDS if k in data)
    return data if ok else None


def _write(path: Path, timings: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(timings, indent=1, sort_keys=True))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
