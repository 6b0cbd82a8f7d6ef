"""The conversion procedure: read SRC, optionally pool KV heads and cast, write and verify DST.

Every format module has `read(src) -> (config, hf_state)`, `write(config, hf_state, dst_dir, tp_size=1)`
(`pp_size` and `iteration` where the format has pipeline stages and iterations, `layer_spec` for
megatron-torch) and `check_loadable(dst_dir, config)`; `hf_state` is the HF-named full state dict (the hub,
see mapping.py). `convert()` = read -> optional KV-head pooling / dtype cast -> write into a temp dir beside
DST -> check it against what its consumer loads strictly (consumers.py) -> read it back and compare every
tensor -> rename to DST.
"""

from __future__ import annotations

import importlib
import inspect
import time
from pathlib import Path

import torch

from converters.formats import FORMATS, WRITABLE
from converters.mapping import ConversionError, Layout, pool_kv_heads
from plugins.core.atomic import OutputError, atomic_dir, check_destination
from plugins.core.config import ConfigError, arch, check_hf_config
from plugins.core.config import kv_heads as kv_heads_of
from plugins.core.tensors import storage_dtype

ARCH = ("family", "n_layer", "hidden", "n_head", "n_positions", "vocab_size", "tied", "eps", "inner", "kv_heads",
        "rope_theta", "sliding_window")  # plugins.core.arch.Arch fields


def format_module(name: str, write: bool = False):
    known = WRITABLE if write else tuple(FORMATS)
    if name not in known:
        raise ConversionError(f"unknown {'output' if write else 'input'} format {name!r}; known: {', '.join(known)}")
    try:
        return importlib.import_module(FORMATS[name])
    except ModuleNotFoundError as e:
        if e.name != FORMATS[name]:
            raise
        raise ConversionError(f"format {name!r} is not available ({FORMATS[name]} is not installed)") from None


def _call(fn, *args, progress=None, **kwargs):
    """Pass the progress bar only to format functions that take one."""
    if progress is not None and "progress" in inspect.signature(fn).parameters:
        kwargs["progress"] = progress
    return fn(*args, **kwargs)


def _stage(progress, name: str):
    if progress is not None:
        progress.set_description(name)


def verify(config, hub: dict, config2, hub2: dict) -> None:
    """The written checkpoint must read back to exactly what was written."""
    wrote, back = arch(config), arch(config2)
    for k in ARCH:
        if getattr(wrote, k) != getattr(back, k):
            raise ConversionError(f"verification failed: {k} reads back as {getattr(back, k)!r}, "
                                  f"wrote {getattr(wrote, k)!r}")
    if set(hub) != set(hub2):
        raise ConversionError(f"verification failed: tensors differ: {sorted(set(hub) ^ set(hub2))[:5]}")
    for name, t in hub.items():
        if t.dtype != hub2[name].dtype or not torch.equal(t, hub2[name]):
            raise ConversionError(f"verification failed: {name} does not read back bit-exact")


def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def convert(src, dst, src_format: str, dst_format: str, tp_size: int = 1, pp_size: int = 1,
            kv_heads: int | None = None, dtype: str | torch.dtype | None = None, iteration: int | None = None,
            force: bool = False, progress=None, layer_spec: str | None = None) -> dict:
    """Convert checkpoint SRC (src_format) to DST (dst_format); returns a summary dict.

    tp_size, pp_size: tensor / pipeline ranks of the output (Megatron formats; PP: Megatron-LM legacy and
    the BigCode fork). kv_heads: mean-pool K/V heads into this many groups (MHA -> MQA with 1).
    dtype: cast every tensor (float32, bfloat16, float16: storage only, so float16 works on CPU too).
    iteration: which iteration of a Megatron-LM / BigCode-fork SRC (default: the tracker's).
    progress: a tqdm-like bar (`set_description`, `reset(total)`, `update`), ticked per layer.
    layer_spec: megatron-torch's layer names, "local" (default) or "te" (Transformer Engine's).
    Errors (ConversionError, a ValueError) are raised before DST is touched; DST appears only
    once complete and verified, atomically (plugins.core.atomic).
    """
    try:
        return _convert(Path(src), Path(dst), src_format, dst_format, tp_size, pp_size, kv_heads, dtype, iteration,
                        force, progress, layer_spec)
    except ConversionError:
        raise
    except ConfigError as e:  # from the shared readers and checks: one error type for converter users
        raise ConversionError(str(e)) from None


def _convert(src: Path, dst: Path, src_format, dst_format, tp_size, pp_size, kv_heads, dtype, iteration, force,
             progress, layer_spec) -> dict:
    t0 = time.perf_counter()
    reader, writer = format_module(src_format), format_module(dst_format, write=True)
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConversionError(f"{name} must be a positive integer, got {value!r}")
    if dst_format == "hf" and tp_size != 1:
        raise ConversionError(f"the HF format has no tensor parallelism (got tp_size={tp_size})")
    if pp_size != 1 and not _takes(writer.write, "pp_size"):
        raise ConversionError(f"format {dst_format!r} has no pipeline stages (got pp_size={pp_size}); "
                              "write megatron-torch, megatron-legacy or bigcode-megatron for PP")
    if layer_spec is not None and not _takes(writer.write, "layer_spec"):
        raise ConversionError(f"format {dst_format!r} has no layer spec choice (layer_spec={layer_spec!r}); "
                              "it is megatron-torch's")
    if iteration is not None and not _takes(reader.read, "iteration"):
        raise ConversionError(f"format {src_format!r} has no iterations (iteration={iteration!r})")
    cast = storage_dtype(dtype) if dtype is not None else None
    if not src.exists():
        raise ConversionError(f"{src} does not exist")
    check_destination(dst, force, sources=[src])

    _stage(progress, f"read {src_format}")
    read_kwargs = {"iteration": iteration} if iteration is not None else {}
    try:
        config, hub = _call(reader.read, src, progress=progress, **read_kwargs)
    except (ConfigError, MemoryError):
        raise
    except Exception as e:  # an untrusted file that is not what its format says: one error, no traceback
        raise ConversionError(f"cannot read {src} as {src_format}: {type(e).__name__}: {e}") from None
    check_hf_config(config, f"{src} ({src_format})")
    if kv_heads is not None:
        config, hub = pool_kv_heads(hub, config, kv_heads)
    if cast is not None:
        hub = {k: v.to(cast) for k, v in hub.items()}
    broken = next((k for k, v in hub.items() if not bool(torch.isfinite(v).all())), None)
    if broken is not None:
        raise ConversionError(f"{src}: {broken} holds NaN or infinite values; refusing to convert a broken checkpoint")
    # Refuse what the writer would refuse before creating anything.
    Layout(config, tp_size, None, "mcore" if dst_format in ("megatron", "megatron-torch") else "legacy")
    write_kwargs = {"pp_size": pp_size} if pp_size != 1 else {}
    if layer_spec is not None:
        write_kwargs["layer_spec"] = layer_spec
    if hasattr(writer, "check_writable"):
        writer.check_writable(config, tp_size, **write_kwargs)

    try:
        with atomic_dir(dst, force=force, sources=[src]) as tmp:
            _stage(progress, f"write {dst_format}")
            source = {"source": src} if _takes(writer.write, "source") else {}  # its tokenizer travels along
            _call(writer.write, config, hub, tmp, tp_size=tp_size, progress=progress, **write_kwargs, **source)
            _stage(progress, "check keys")
            writer.check_loadable(tmp, config)  # what its consumer loads, strictly: before anything is published
            _stage(progress, "verify")
            config2, hub2 = _call(writer.read, tmp, progress=progress)
            verify(config, hub, config2, hub2)
            del hub2
    except OutputError as e:
        raise ConversionError(str(e)) from None
    n_bytes = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    return {"src": str(src), "dst": str(dst), "from": src_format, "to": dst_format, "tp_size": tp_size,
            "pp_size": pp_size, "kv_heads": kv_heads_of(config), "tensors": len(hub),
            "params": sum(t.numel() for t in hub.values()), "bytes": n_bytes,
            "seconds": time.perf_counter() - t0}
