"""Choose each linear's implementation by timing it on this machine (the probe's measured table).

On first use per machine and kind, every candidate of `Probe.candidates` for that kind (bf16, int8
or int4: only the kinds the process asks for) runs the four
linears of one santacoder-1b layer (85 MB of bf16 weights: past the caches, as a real step is) at
one row count per bucket (TIMED_ROWS; the last, 2048 rows, on its two MLP linears only), interleaved
with the other candidates of that bucket, best of a few passes (fewer where a pass is long). A
candidate several times slower than the best is not run again (a short pass gets a second first), and
from 256 rows on (where
per-row cost dominates fixed costs such as a conversion) not timed at larger row counts either (null
in the table: it cannot be chosen there).
The fastest per bucket is chosen; the decode bucket (one row) chooses among row-invariant
implementations only, since exact speculative verification (`rows_alone`) runs every row as that
one-row choice. The timings are kept in a JSON file beside the compiled kernels, keyed by the CPU's
model name and flags, the torch version, the thread count and our kernel sources, so the next process
reads them; a file lock keeps concurrent processes (tensor-parallel ranks) from timing at once.

Timings taken while other processes compete for the cores are wrong, and wrong in ways that change the
choice (a 2-thread kernel whose second thread waits for a core is slowed several times, a 1-thread one
is not), so the load is read while timing (`LoadWatch`): the CPU time other processes used on our cores
(/proc/stat, the hypervisor's steal included, less our own from getrusage) over each window of at least
WINDOW_S. A window where they took more than BUSY_SHARE of the cores the timing runs on is busy: its
races run again after a pause (a moment's load passes); past RETRIES busy windows the timing stops,
this process runs the ladder's fixed choices and nothing is kept, so a later start times again (not
within BUSY_HOLD_S: ranks and test processes started beside it would each pay a timing that stops).
`forget` drops a cached table (`python -m plugins.kernels --remeasure`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch

from plugins.kernels import BUCKETS, CSRC, KINDS, ROW_INVARIANT, TIMED_ROWS, PackedWeights, Probe, bucket_label, linear
from plugins.kernels.quant import int4_linear, int8_linear, quantize_int4, quantize_per_channel

# [out, in] of one santacoder-1b layer: c_attn (MQA), attn c_proj, mlp c_fc, mlp c_proj
LAYER = [(2304, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
GELU = (False, False, True, False)  # c_fc runs with its GELU, as the model runs it (fused, or after the GEMM)
PASSES = 3          # more timed passes per candidate and bucket after the first,
RACE_BUDGET_S = 3.0  # while a bucket's race has taken less than this
GIVE_UP = 4.0       # a candidate this many times slower than the best is not timed again (nor at more rows)
NOISE_MS = 50.0     # ...unless its first pass took less: a preemption or two can make that 4x, so it gets a second
DROP_FROM_ROWS = 256  # from this many rows a candidate GIVE_UP times slower is not timed at more rows
FORMAT = 3          # bump when the file's meaning changes
# int8 implementations whose rows are computed as each row alone (exact integer sums)
INT8_ROW_INVARIANT = ("avx512", "avx512f", "avx2")
# Other processes taking more than this share of the cores the timing runs on make it a busy machine's
# table. On a 2-core Xeon timing with 2 threads, quiet windows read 0-0.04, beside one busy loop 0.30-0.42.
BUSY_SHARE = 0.15
WINDOW_S = 0.5  # the load is read over windows at least this long: /proc/stat counts whole ticks (10 ms)
RETRIES = 2  # busy windows a timing outlives (their races run again after a pause); the next one stops it
RETRY_PAUSE_S = 1.0
BUSY_HOLD_S = 60.0  # after a timing stopped for load, processes that would time take the fixed choices


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


def table_path() -> Path:
    return cache_dir() / f"{machine_key()}.json"


def measured_choices(p: Probe, path: Path | None = None, kinds=KINDS) -> tuple[dict, dict]:
    """(choices: kind -> implementation per bucket, timings: kind -> bucket label -> {impl: ms}) for the
    candidates `p` offers for `kinds`, from the cache file for the kinds it holds, the others timed now
    (and cached beside them). A timing the machine's load spoiled (`LoadWatch`) is not kept: its kinds
    get the ladder's fixed choices, and a string saying why instead of timings; for BUSY_HOLD_S after,
    processes that would time (the next rank, a test's next process) take the fixed choices at once."""
    path = path or table_path()
    wanted = {kind: p.candidates(kind) for kind in kinds}
    timings = _read(path)
    busy = None  # what stopped a timing for load, if one did
    if not _covers(timings, wanted):
        from plugins.core.console import announce

        with _locked(path.with_suffix(".lock")):
            timings = _read(path)  # another process may have timed them meanwhile
            todo = {k: c for k, c in wanted.items() if not _covers(timings, {k: c})}
            busy = _busy_note(path) if todo else None
            if todo and not busy:
                announce(f"timing the CPU {'/'.join(todo)} linear implementations on this machine (once per machine, "
                         "kind and thread count, ~20-60 s)...")
                try:
                    timings = _merge(timings, time_candidates(todo, watch=LoadWatch()))
                    _write(path, timings)
                except Busy as exc:
                    busy = str(exc)
                    _write(path.with_suffix(".busy"), {"at": time.time(), "note": busy})
        if busy:
            announce(f"timing the CPU linears: {busy}; this process runs the fixed choices "
                     f"(PLUGINS_KERNELS_TABLE=static), and the timings are not kept (timed again by a start "
                     f"{BUSY_HOLD_S:.0f} s on)")
    spoiled = {k: f"not kept: {busy}" for k in todo} if busy else {}
    timed = {k: c for k, c in wanted.items() if k not in spoiled}
    rows = (1, *BUCKETS[1:], BUCKETS[-1] + 1)  # a row count per bucket
    return ({**choose(timings, timed), **{k: tuple(p.static(k, r) for r in rows) for k in spoiled}},
            {**{k: {b: {i: timings[k][b][i] for i in timed[k]} for b in timings[k]} for k in timed}, **spoiled})


def _busy_note(path: Path) -> str | None:
    """What the timing that stopped for load within BUSY_HOLD_S read, if one did."""
    try:
        note = json.loads(path.with_suffix(".busy").read_text())
        ago = time.time() - note["at"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"{note['note']}, {ago:.0f} s ago" if 0 <= ago < BUSY_HOLD_S else None


def forget(kinds=KINDS, path: Path | None = None) -> None:
    """Drop `kinds` from the cached timings (`python -m plugins.kernels --remeasure`), and a recent
    timing's busy note: the next probe times them again."""
    path = path or table_path()
    with _locked(path.with_suffix(".lock")):
        path.with_suffix(".busy").unlink(missing_ok=True)
        kept = {k: v for k, v in (_read(path) or {}).items() if k in KINDS and k not in kinds}
        if kept:
            _write(path, kept)
        else:
            path.unlink(missing_ok=True)


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


def time_candidates(wanted: dict, layer=LAYER, watch: LoadWatch | None = None) -> dict:
    """kind (of `wanted`) -> bucket label -> {impl: best ms of one pass over `layer`'s linears}. With
    `watch`, the load is read as it goes: the races of a busy window run again after a pause, and the
    busy window past RETRIES (the setup's count too: a busy machine stops early) raises `Busy`."""
    busy_windows = 0

    def window(final: bool = False) -> str | None:
        """None while no window is complete, else 'quiet' or 'busy'."""
        nonlocal busy_windows
        share = watch.read(final) if watch else None
        if share is None or share <= watch.threshold:
            return None if share is None else "quiet"
        busy_windows += 1
        if busy_windows > RETRIES:
            raise Busy(f"{watch.note} (busy windows: {busy_windows})")
        return "busy"

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in layer]
    biases = [torch.randn(n, generator=gen).bfloat16() for n, _ in layer]
    window()
    int8 = [(q, s.bfloat16()) for q, s in map(quantize_per_channel, weights)] if "int8" in wanted else []
    int4 = {}
    for impl in wanted.get("int4", ()):
        window()
        int4[impl] = [quantize_int4(w.float(), layout=impl) for w in weights]
    packs = PackedWeights()

    def runner(kind, impl, x, only=None):
        pick = (lambda seq: seq) if only is None else (lambda seq: [seq[j] for j in only])
        gelu = pick(GELU[:len(layer)])
        if kind == "bf16":
            return lambda: [linear(x[w.shape[1]], w, b, g, packs, impl)
                            for w, b, g in zip(pick(weights), pick(biases), gelu)]
        if kind == "int8":
            return lambda: [int8_linear(x[q.shape[1]], q, s, b, g, packs, impl)
                            for (q, s), b, g in zip(pick(int8), pick(biases), gelu)]
        return lambda: [int4_linear(x[w.shape[1]], w, b, g) for w, b, g in zip(pick(int4[impl]), pick(biases), gelu)]

    def inputs(rows):
        return {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in layer}}

    x = inputs(1)
    for kind in wanted:  # packs made (once per weight, as in a model) before anything is timed
        for impl in wanted[kind]:
            window()
            runner(kind, impl, x)()
    if watch:
        watch.restart()  # what ran during the setup touches no timing
    out = {kind: {} for kind in wanted}
    dropped = {kind: set() for kind in wanted}
    last = len(TIMED_ROWS) - 1
    races = [(i, kind) for i in range(len(TIMED_ROWS)) for kind in wanted]
    j = start = 0  # the next race; the first of the window being read
    kept = {kind: set() for kind in wanted}  # `dropped` as that window began
    while j < len(races):
        i, kind = races[j]
        rows = TIMED_ROWS[i]
        if len(next(iter(x.values()))) != rows:
            x = inputs(rows)
        # the last bucket on the MLP's two linears (80 % of the FLOPs; their shapes favour different paths)
        only = sorted(range(len(layer)), key=lambda n: -layer[n][0] * layer[n][1])[:2] if i == last else None
        live = {impl: runner(kind, impl, x, only) for impl in wanted[kind] if impl not in dropped[kind]}
        times = _race(live)
        best = min(times.values())
        if rows >= DROP_FROM_ROWS:  # compute-bound from here: a fixed cost (a conversion) no longer hides
            dropped[kind] |= {impl for impl, ms in times.items() if ms > GIVE_UP * best}
        out[kind][bucket_label(i)] = {impl: times.get(impl) for impl in wanted[kind]}
        j += 1
        state = window(final=j == len(races))
        if state == "quiet":
            start, kept = j, {k: set(v) for k, v in dropped.items()}
        elif state == "busy":  # a moment's load: that window's races again, once it may have passed
            j, dropped = start, {k: set(v) for k, v in kept.items()}
            time.sleep(RETRY_PAUSE_S)
            watch.restart()
    return out


def _race(fns: dict) -> dict:
    """Best ms per function: one pass each, then up to PASSES rounds (while the race is under
    RACE_BUDGET_S) that run every remaining function once in turn, so a swing of the machine's
    bandwidth hits all. A function GIVE_UP times slower than the best is left out of them, after a
    second pass where its first was short (under NOISE_MS: one preemption can slow such a pass 4x)."""
    began = time.perf_counter()
    best = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        best[name] = (time.perf_counter() - start) * 1e3
    for round_ in range(PASSES):
        if time.perf_counter() - began > RACE_BUDGET_S:
            break
        fastest = min(best.values())
        for name in [n for n in fns if best[n] <= GIVE_UP * fastest or (round_ == 0 and best[n] < NOISE_MS)]:
            start = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return {name: max(round(ms, 4), 1e-4) for name, ms in best.items()}


class Busy(Exception):
    """Other processes took too much of the cores while timing (the message says how much)."""


def cpu_sample() -> tuple[float, float, float] | None:
    """(wall s, CPU s all processes used on the CPUs this process may run on, including the hypervisor's
    steal, CPU s this process used), or None where /proc/stat cannot be read."""
    allowed = os.sched_getaffinity(0)
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in allowed:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
                    total += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), total / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def contention(others_s: float, wall_s: float, cpus: int, threads: int) -> float:
    """The share of the cores a timing's `threads` run on that other processes took over a window of
    `wall_s`: their CPU time beyond the cores those threads leave free, per core the threads use. A 1-thread
    timing on 2 cores shares nothing with one busy process on the other core."""
    used = max(1, min(threads, cpus))
    return min(1.0, max(0.0, others_s / wall_s - (cpus - used)) / used)  # (ticks round either way)


class LoadWatch:
    """Reads `contention` over windows of at least WINDOW_S while a timing runs (`read`); `readings`
    holds each window's share, `note` says what the last one read."""

    def __init__(self, threshold: float = BUSY_SHARE, sample=None):
        self.sample, self.threshold = sample or cpu_sample, threshold
        self.readings: list[float] = []
        self.note = ""
        self.restart()

    def restart(self) -> None:
        """The next window begins now."""
        self.mark = self.sample()

    def read(self, final: bool = False) -> float | None:
        """The share of the window since the last reading (or `restart`), or None while it is shorter
        than WINDOW_S; the `final` one is read from a fifth of that (a shorter rest changes nothing)."""
        now = self.sample()
        if now is None or self.mark is None or now[0] - self.mark[0] < (WINDOW_S / 5 if final else WINDOW_S):
            return None
        cpus, wall = len(os.sched_getaffinity(0)), now[0] - self.mark[0]
        others = (now[1] - self.mark[1]) - (now[2] - self.mark[2])
        share = contention(others, wall, cpus, torch.get_num_threads())
        self.mark = now
        self.readings.append(round(share, 3))
        self.note = (f"other processes took {share:.0%} of the cores the timing ran on "
                     f"({max(others, 0) / wall:.2f} of {cpus} CPUs over {wall:.1f} s)")
        return share


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
