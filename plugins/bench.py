"""The cross-library comparison behind `scripts/compare.py`: one grid, every backend, the same weights.

For each model config one seeded checkpoint is made (or reused); every backend loads it through
`plugins.backend.load_backend` and is driven only through the Backend protocol. HF runs first: its
logits and greedy tokens are the reference the other backends are checked against. Each grid
point (backend x batch x prompt length) is `warmup` untimed generations, then `cycles` timed ones;
a failure at one point is recorded in its row and the run goes on.

The machine is measured at start (a read-bandwidth probe and a GEMM probe) and every row gets the
roofline of `plugins.roofline` for that point: what the step should cost here, and how close the
measured step came (MBU / MFU).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import psutil
import torch

from . import kernels, roofline
from .backend import BACKENDS, backend_class, check_tp, load_backend, resolve_dtype
from .checkpoint import ensure_checkpoint
from .config import CONFIGS_DIR, REPO_ROOT, ConfigError, load_model_config, read_yaml
from .roofline import Shape
from .tokenizer import load_tokenizer, make_batch

BENCH_DIR = CONFIGS_DIR / "bench"
REFERENCE = "hf"


# --- the bench config ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelEntry:
    label: str
    config: str                      # a name in configs/models/ (or a YAML path)
    overrides: dict = field(default_factory=dict)   # single keys replaced, e.g. {multi_query: false}

    def hf_config(self):
        return load_model_config(self.config, **self.overrides)


@dataclass(frozen=True)
class BackendEntry:
    label: str
    name: str                        # a key of plugins.backend.BACKENDS
    tp_size: int = 1
    options: dict = field(default_factory=dict)     # passed to load_backend as keyword arguments


@dataclass(frozen=True)
class BenchConfig:
    models: tuple
    backends: tuple
    batch_sizes: tuple
    prompt_lengths: tuple
    new_tokens: int
    dtype: str = "float32"
    warmup: int = 1
    cycles: int = 3
    seed: int = 0
    logit_batch: int = 4             # sequences per row whose full logits are compared with HF
    checkpoint_dir: str = "checkpoints"
    project: tuple = ()              # hardware names: an analytical projection appended to results.md
    project_models: tuple = ("starcoder-15b",)
    project_context: int = 2048
    project_batches: tuple = (1, 64)
    name: str = ""


_MODEL_KEYS = {"config", "label", "overrides"}
_BACKEND_KEYS = {"name", "tp_size", "label", "options"}
_BENCH_KEYS = {f.name for f in fields(BenchConfig)} - {"name"}


def _positive_ints(key, value, allow_zero=False) -> tuple:
    values = value if isinstance(value, list) else [value]
    lo = 0 if allow_zero else 1
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < lo for v in values):
        raise ConfigError(f"{key} must be {'a non-negative' if allow_zero else 'a positive'} integer "
                          f"or a list of them, got {value!r}")
    return tuple(values)


def _names(key, value) -> tuple:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{key} must be a name or a list of names, got {value!r}")
    return tuple(values)


def _check_keys(raw: dict, allowed: set, where: str, hint: str = "") -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}{hint}")


def _model_entry(raw) -> ModelEntry:
    if isinstance(raw, str):
        return ModelEntry(label=Path(raw).stem, config=raw)
    if not isinstance(raw, dict) or "config" not in raw:
        raise ConfigError(f"a models entry is a config name or a mapping with 'config', got {raw!r}")
    _check_keys(raw, _MODEL_KEYS, "models entry")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"models entry {raw['config']!r}: overrides must be a mapping")
    return ModelEntry(label=str(raw.get("label") or Path(raw["config"]).stem), config=raw["config"],
                      overrides=dict(overrides))


def _backend_entry(raw) -> BackendEntry:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError(f"a backends entry is a backend name or a mapping with 'name', got {raw!r}")
    _check_keys(raw, _BACKEND_KEYS, f"backends entry {raw['name']!r}", " (backend options go under 'options')")
    name = raw["name"]
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    tp = _positive_ints("tp_size", raw.get("tp_size", 1))
    if len(tp) != 1:
        raise ConfigError(f"backends entry {name!r}: tp_size is one integer")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"backends entry {name!r}: options must be a mapping")
    label = raw.get("label") or (name if tp[0] == 1 else f"{name} tp{tp[0]}")
    return BackendEntry(label=str(label), name=name, tp_size=tp[0], options=dict(options))


def parse_bench_config(raw: dict, name: str = "") -> BenchConfig:
    """Validate everything a run needs before any work: unknown keys, shapes, backends, TP sizes."""
    if not isinstance(raw, dict):
        raise ConfigError("a bench config is a mapping of keys to values")
    _check_keys(raw, _BENCH_KEYS, f"bench config {name}")
    missing = sorted({"models", "backends", "batch_sizes", "prompt_lengths", "new_tokens"} - set(raw))
    if missing:
        raise ConfigError(f"bench config {name}: missing key(s) {', '.join(missing)}")
    models = tuple(_model_entry(m) for m in (raw["models"] if isinstance(raw["models"], list) else [raw["models"]]))
    backends = tuple(_backend_entry(b) for b in (raw["backends"] if isinstance(raw["backends"], list)
                                                 else [raw["backends"]]))
    for kind, labels in (("model", [m.label for m in models]), ("backend", [b.label for b in backends])):
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ConfigError(f"duplicate {kind} label(s) {', '.join(dup)}: give each entry its own 'label'")
    if not any(b.name == REFERENCE and b.tp_size == 1 for b in backends):
        raise ConfigError(f"backends must include {REFERENCE!r} (tp_size 1): it is the reference for correctness")
    if not models:
        raise ConfigError("models is empty")
    cfg = BenchConfig(
        models=models, backends=backends,
        batch_sizes=_positive_ints("batch_sizes", raw["batch_sizes"]),
        prompt_lengths=_positive_ints("prompt_lengths", raw["prompt_lengths"]),
        new_tokens=_positive_ints("new_tokens", raw["new_tokens"])[0],
        dtype=str(raw.get("dtype", "float32")),
        warmup=_positive_ints("warmup", raw.get("warmup", 1), allow_zero=True)[0],
        cycles=_positive_ints("cycles", raw.get("cycles", 3))[0],
        seed=_positive_ints("seed", raw.get("seed", 0), allow_zero=True)[0],
        logit_batch=_positive_ints("logit_batch", raw.get("logit_batch", 4))[0],
        checkpoint_dir=str(raw.get("checkpoint_dir", "checkpoints")),
        project=_names("project", raw.get("project", [])),
        project_models=_names("project_models", raw.get("project_models", ["starcoder-15b"])),
        project_context=_positive_ints("project_context", raw.get("project_context", 2048))[0],
        project_batches=_positive_ints("project_batches", raw.get("project_batches", [1, 64])),
        name=name,
    )
    if cfg.new_tokens < 2:
        raise ConfigError("new_tokens must be >= 2 (one prefill token, then timed decode steps)")
    resolve_dtype(cfg.dtype)
    longest = max(cfg.prompt_lengths)
    for m in cfg.models:
        config = m.hf_config()  # ConfigError for an unknown config or override
        if longest + cfg.new_tokens > config.n_positions:
            raise ConfigError(f"model {m.label}: prompt length {longest} + new_tokens {cfg.new_tokens} "
                              f"exceeds n_positions {config.n_positions}")
        for b in cfg.backends:
            check_tp(config, b.tp_size)
    for hw in cfg.project:
        roofline.read_hardware_spec(hw)
    for m in cfg.project_models:
        load_model_config(m)
    return cfg


def load_bench_config(name_or_path: str | Path) -> BenchConfig:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = BENCH_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in BENCH_DIR.glob("*.yaml")))
        raise ConfigError(f"unknown bench config {str(name_or_path)!r}; known: {known}")
    return parse_bench_config(read_yaml(path), name=path.stem)


# --- the machine --------------------------------------------------------------------------------

def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    """Dense matmul peak (FLOP/s) in `dtype`: best time of an n x n x n GEMM."""
    n = n or (8192 if device() == "cuda" else 2048)
    a = torch.randn(n, n, device=device()).to(dtype)
    b = torch.randn(n, n, device=device()).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        a @ b
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
    return {"mem_bw": bw, "peak_flops": measure_gemm(dtype), "mem_bytes": float(mem), "link_bw": bw,
            "gemv_bw": measure_gemv(dtype), "gemm_dtype": str(dtype).replace("torch.", "")}


def environment() -> dict:
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
        "cpu_kernels": None if torch.cuda.is_available() else kernels.probe().describe(),
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


# --- one grid point -----------------------------------------------------------------------------

def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


@dataclass
class Reference:
    """HF's outputs for one model: logits per prompt length, greedy tokens per (batch, prompt length)."""
    logits: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)


def measure_point(backend, options: dict, cfg: BenchConfig, shape: Shape, local_hw: roofline.Hardware, batch: int,
                  prompt: int, input_ids, mask, texts, tok, ref: Reference, is_reference: bool) -> dict:
    """Everything one row reports; raises on failure (the caller records it)."""
    reset_peak_memory()
    k = min(batch, cfg.logit_batch)
    logits = backend.logits(input_ids[:k], mask[:k])
    if is_reference and (prompt not in ref.logits or ref.logits[prompt].shape[0] < k):
        ref.logits[prompt] = logits
    want = ref.logits.get(prompt)
    max_diff = None if want is None else float((logits - want[:k]).abs().max())
    del logits

    for _ in range(cfg.warmup):
        backend.generate(input_ids, mask, cfg.new_tokens)
    # A VM's bandwidth can swing ~2x within minutes; this row's own reading says what it ran on.
    read_bw = measure_bandwidth(256 << 20, repeats=3)
    runs = [backend.generate(input_ids, mask, cfg.new_tokens) for _ in range(cfg.cycles)]
    new = runs[0].tokens[:, prompt:]
    if is_reference:
        ref.tokens[(batch, prompt)] = new
    want = ref.tokens.get((batch, prompt))
    agreement = None if want is None else 100.0 * float((new == want).float().mean())

    t = time.perf_counter()
    tok.encode_batch(texts)
    tokenize_s = time.perf_counter() - t
    t = time.perf_counter()
    tok.decode_batch(new.tolist())
    detokenize_s = time.perf_counter() - t
    peak = peak_memory_bytes()

    steps = [s for r in runs for s in r.step_s]
    decode_s = statistics.median(steps)
    prefill_s = statistics.median(r.prefill_s for r in runs)
    total_s = statistics.median(r.prefill_s + sum(r.step_s) for r in runs)

    dtype = resolve_dtype(cfg.dtype)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    paths = backend.linear_paths(batch, prompt)
    warning = None
    if cfg.dtype in kernels.slow_dtypes() and "torch" in paths.values():
        warning = (f"{cfg.dtype} through torch's own GEMM: this CPU has no fast {cfg.dtype} path for it "
                   "(no oneDNN bf16), expect it slow")
    tp = backend.tp_size
    # The KV layout a backend was asked for (issue 9's `kv_layout` option); engines default to "head".
    layout = "batch" if options.get("kv_layout") == "batch" else "head"
    hw = local_hw.split(tp) if tp > 1 else local_hw  # TP ranks here share one host
    context = prompt + cfg.new_tokens // 2          # keys seen by the median decode step
    dec = roofline.decode_estimate(shape, hw, batch, context, dtype_bytes, tp, layout)
    pre = roofline.prefill_estimate(shape, hw, batch, prompt, dtype_bytes, tp, layout)
    # The shared loop runs new_tokens - 1 decode steps: the cache ends holding prompt + new - 1 tokens.
    kv_theory = roofline.kv_bytes(shape, batch, prompt + cfg.new_tokens - 1, dtype_bytes, tp, layout)
    return {
        "linear_paths": paths,
        "warning": warning,
        "prefill_ms": _ms(prefill_s),
        "decode_ms_median": _ms(decode_s),
        "decode_ms_p90": _ms(_percentile(steps, 0.9)),
        "tokens_per_s": batch * cfg.new_tokens / total_s,
        "read_bw": read_bw,
        "peak_mem_bytes": peak,
        "kv_layout": layout,
        "kv_bytes": int(runs[-1].kv_cache_bytes),
        "stats": getattr(runs[-1], "stats", None) or None,  # [speed] e.g. speculative acceptance_rate
        "kv_bytes_theory": kv_theory,
        "token_agreement_pct": agreement,
        "max_logit_diff": max_diff,
        "logit_sequences": k,
        "tokenize_ms": _ms(tokenize_s),
        "detokenize_ms": _ms(detokenize_s),
        "weight_bytes_per_rank": roofline.weight_bytes(shape, dtype_bytes, tp),
        "decode_bytes": dec.bytes,
        "decode_flops": dec.flops,
        "mem_ms": _ms(dec.memory_s),
        "compute_ms": _ms(dec.compute_s),
        "comm_ms": _ms(dec.comm_s),
        "bound": dec.bound,
        "predicted_decode_ms": _ms(dec.total_s),
        "predicted_prefill_ms": _ms(pre.total_s),
        "measured_over_predicted": decode_s / dec.total_s,
        "mbu_pct": 100.0 * dec.mbu(decode_s, hw),
        "mfu_pct": 100.0 * dec.mfu(decode_s, hw),
        "prefill_mfu_pct": 100.0 * pre.mfu(prefill_s, hw),
    }


def profile_backend(backend, input_ids, mask, new_tokens: int, path: Path) -> None:
    """One generation under torch.profiler (this process only: TP workers are not traced)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        backend.generate(input_ids, mask, new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


# --- the grid -----------------------------------------------------------------------------------

def checkpoint_for(cfg: BenchConfig, model: ModelEntry) -> Path:
    root = Path(cfg.checkpoint_dir)
    root = root if root.is_absolute() else REPO_ROOT / root
    return ensure_checkpoint(model.hf_config(), root / f"{model.label}-seed{cfg.seed}", seed=cfg.seed)


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def run_grid(cfg: BenchConfig, local_hw: roofline.Hardware, out_dir: Path, profile: bool = False,
             progress: bool = True) -> tuple[list, list]:
    """Rows (one per model x backend x batch x prompt length) and skipped backends."""
    from tqdm import tqdm

    tok = load_tokenizer()
    batches = {(b, t): make_batch(tok, b, t) for b in cfg.batch_sizes for t in cfg.prompt_lengths}
    texts = {key: tok.decode_batch(ids.tolist()) for key, (ids, _) in batches.items()}
    points = [(b, t) for b in cfg.batch_sizes for t in cfg.prompt_lengths]
    # HF first: the reference every other backend is checked against.
    order = sorted(cfg.backends, key=lambda e: not (e.name == REFERENCE and e.tp_size == 1))
    rows, skipped = [], []
    bar = tqdm(total=len(cfg.models) * len(order) * len(points), disable=not progress, unit="point")
    for model in cfg.models:
        config = model.hf_config()
        bar.set_description(f"{model.label}: checkpoint")
        ckpt = checkpoint_for(cfg, model)
        ref = Reference()
        for entry in order:
            base = {"model": model.label, "attention": "MQA" if config.multi_query else "MHA",
                    "backend": entry.label, "backend_name": entry.name, "tp_size": entry.tp_size,
                    "options": entry.options, "dtype": cfg.dtype, "new_tokens": cfg.new_tokens}
            try:
                backend_class(entry.name)
            except Exception as exc:  # missing module or a library that fails to import
                skipped.append({"model": model.label, "backend": entry.label, "backend_name": entry.name,
                                "reason": _error(exc)})
                bar.update(len(points))
                continue
            is_reference = entry.name == REFERENCE and entry.tp_size == 1 and not ref.tokens
            rows += run_backend(entry, base, ckpt, cfg, Shape.from_config(config), local_hw, batches, texts, tok,
                                ref, is_reference, bar, out_dir if profile else None)
        del ref
        release_memory()
    bar.close()
    return rows, skipped


def run_backend(entry: BackendEntry, base: dict, ckpt: Path, cfg: BenchConfig, shape: Shape,
                local_hw: roofline.Hardware, batches: dict, texts: dict, tok, ref: Reference, is_reference: bool,
                bar, profile_dir: Path | None) -> list[dict]:
    """Load one backend, run every grid point on it, close it: one row per point, errors included."""
    rows = []
    bar.set_description(f"{base['model']} {entry.label}: load")
    t = time.perf_counter()
    try:
        backend = load_backend(entry.name, ckpt, dtype=cfg.dtype, tp_size=entry.tp_size, **entry.options)
    except Exception as exc:
        bar.update(len(batches))
        return [{**base, "batch": b, "prompt_len": p, "error": f"load failed: {_error(exc)}"} for b, p in batches]
    load_s = time.perf_counter() - t
    try:
        for (b, p), (ids, mask) in batches.items():
            bar.set_description(f"{base['model']} {entry.label} B={b} T={p}")
            row = {**base, "batch": b, "prompt_len": p, "load_s": load_s, "error": None}
            try:
                row.update(measure_point(backend, entry.options, cfg, shape, local_hw, b, p, ids, mask,
                                         texts[(b, p)], tok, ref, is_reference))
            except Exception as exc:  # out-of-memory included: record it, go on with the next point
                row["error"] = _error(exc)
                release_memory()
            if row.get("warning"):
                bar.write(f"warning: {base['model']} {entry.label} B={b} T={p}: {row['warning']}", file=sys.stderr)
            rows.append(row)
            bar.update(1)
        if profile_dir is not None:
            (ids, mask), safe = next(iter(batches.values())), entry.label.replace(" ", "-").replace("/", "-")
            trace = profile_dir / "profile" / f"{base['model']}-{safe}.json"
            try:
                profile_backend(backend, ids, mask, cfg.new_tokens, trace)
            except Exception as exc:
                print(f"profile of {entry.label} failed: {_error(exc)}", file=sys.stderr)
    finally:
        backend.close()
        del backend
        release_memory()
    return rows
