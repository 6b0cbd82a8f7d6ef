"""The cross-library comparison behind `scripts/compare.py`: one grid, every backend, the same weights.

For each model config one seeded checkpoint is made (or reused); every backend loads it through
`plugins.engine.registry.load_backend` and is driven only through the Backend protocol. HF runs first:
its logits and greedy tokens are the reference the other backends are checked against. Each grid
point (backend x batch x prompt length) is `warmup` untimed generations, then `cycles` timed ones;
a failure at one point is recorded in its row and the run goes on.

The machine is measured at start (probes.py) and every row gets the roofline of `roofline.py` for
that point: what the step should cost here, and how close the measured step came (MBU / MFU).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plugins import kernels
from plugins.bench import roofline
from plugins.bench.config import REFERENCE, BackendEntry, BenchConfig, ModelEntry, draft_model
from plugins.bench.probes import measure_bandwidth, peak_memory_bytes, release_memory, reset_peak_memory
from plugins.bench.roofline import Shape
from plugins.core.checkpoint import ensure_checkpoint
from plugins.core.config import REPO_ROOT, ConfigError, arch, load_train_spec
from plugins.core.tensors import resolve_dtype
from plugins.core.tokenizer import checkpoint_tokenizer, make_batch
from plugins.engine.registry import backend_class, load_backend
from plugins.train import ensure_trained, perplexity

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


def measure_point(backend, cfg: BenchConfig, shape: Shape, local_hw: roofline.Hardware, batch: int,
                  prompt: int, input_ids, mask, texts, tok, ref: Reference, is_reference: bool,
                  dtype_name: str | None = None) -> dict:
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

    dtype_name = dtype_name or cfg.dtype
    dtype = resolve_dtype(dtype_name)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    paths = backend.linear_paths(batch, prompt)
    warning = None
    if dtype_name in kernels.slow_dtypes() and "torch" in paths.values():
        warning = (f"{dtype_name} through torch's own GEMM: this CPU has no fast {dtype_name} path for it "
                   "(no oneDNN bf16), expect it slow")
    tp = backend.tp_size
    layout = getattr(backend, "kv_layout", "head")  # how the engine shards its KV cache over ranks
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
        "stats": getattr(runs[-1], "stats", None) or None,  # engine figures, e.g. speculative acceptance_rate
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

def _checkpoint_path(cfg: BenchConfig, name: str) -> Path:
    root = Path(cfg.checkpoint_dir)
    root = (root if root.is_absolute() else REPO_ROOT / root).resolve()
    path = (root / name).resolve()
    if path.parent != root:  # labels are plain names (config.py); this holds whatever the file system does
        raise ConfigError(f"model label {name!r} leads outside checkpoint_dir {root}")
    return path


def checkpoint_for(cfg: BenchConfig, model: ModelEntry, progress: bool = True) -> Path:
    """A config with a `train:` section: its trained checkpoint (trained once, `<label>-trained`);
    any other: seeded weights (`<label>-seed<seed>`)."""
    if load_train_spec(model.config, **model.overrides) is not None:
        return ensure_trained(model.config, _checkpoint_path(cfg, f"{model.label}-trained"), progress,
                              **model.overrides)
    return ensure_checkpoint(model.hf_config(), _checkpoint_path(cfg, f"{model.label}-seed{cfg.seed}"), seed=cfg.seed)


def resolve_options(cfg: BenchConfig, options: dict) -> dict:
    """A speculative draft named by its model config becomes that model's checkpoint (made if needed)."""
    draft = draft_model(options)
    if draft is None:
        return options
    entry = ModelEntry(label=Path(draft).stem, config=draft)
    return {**options, "speculative": {**options["speculative"], "draft": str(checkpoint_for(cfg, entry))}}


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def attention_kind(config) -> str:
    """MQA (one KV head), MHA (one per query head) or GQA (StarCoder2's groups, a pooled gpt_bigcode)."""
    shape = arch(config)
    return "MQA" if shape.kv_heads == 1 else "MHA" if shape.kv_heads == shape.n_head else f"GQA-{shape.kv_heads}"


def run_grid(cfg: BenchConfig, local_hw: roofline.Hardware, out_dir: Path, profile: bool = False,
             progress: bool = True) -> tuple[list, list]:
    """Rows (one per model x backend x batch x prompt length) and skipped backends."""
    from tqdm import tqdm

    points = [(b, t) for b in cfg.batch_sizes for t in cfg.prompt_lengths]
    # HF first (at fp32 when there is one): the reference every other backend is checked against.
    order = sorted(cfg.backends, key=lambda e: (not (e.name == REFERENCE and e.tp_size == 1),
                                                resolve_dtype(e.dtype or cfg.dtype) != torch.float32))
    rows, skipped = [], []
    bar = tqdm(total=len(cfg.models) * len(order) * len(points), disable=not progress, unit="point")
    for model in cfg.models:
        config = model.hf_config()
        bar.set_description(f"{model.label}: checkpoint")
        ckpt = checkpoint_for(cfg, model, progress)
        # the model's own tokenizer (a trained model may have a smaller one): prompts, texts, perplexity
        tok, _ = checkpoint_tokenizer(ckpt)
        batches = {(b, t): make_batch(tok, b, t, cfg.workload) for b in cfg.batch_sizes for t in cfg.prompt_lengths}
        texts = {key: tok.decode_batch(ids.tolist()) for key, (ids, _) in batches.items()}
        ref = Reference()
        for entry in order:
            base = {"model": model.label, "attention": attention_kind(config),
                    "backend": entry.label, "backend_name": entry.name, "tp_size": entry.tp_size,
                    "options": entry.options, "dtype": entry.dtype or cfg.dtype, "new_tokens": cfg.new_tokens}
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
        options = resolve_options(cfg, entry.options)
        backend = load_backend(entry.name, ckpt, dtype=base["dtype"], tp_size=entry.tp_size, **options)
    except Exception as exc:
        bar.update(len(batches))
        return [{**base, "batch": b, "prompt_len": p, "error": f"load failed: {_error(exc)}"} for b, p in batches]
    load_s = time.perf_counter() - t
    try:
        quality = {}
        if cfg.perplexity:  # once per backend: the same held-out windows through backend.logits
            bar.set_description(f"{base['model']} {entry.label}: perplexity")
            try:
                quality = perplexity(backend, **cfg.perplexity, tok=tok)
            except Exception as exc:
                quality = {"perplexity_error": _error(exc)}
        for (b, p), (ids, mask) in batches.items():
            bar.set_description(f"{base['model']} {entry.label} B={b} T={p}")
            row = {**base, "batch": b, "prompt_len": p, "load_s": load_s, "error": None, **quality}
            try:
                row.update(measure_point(backend, cfg, shape, local_hw, b, p, ids, mask,
                                         texts[(b, p)], tok, ref, is_reference, base["dtype"]))
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
