"""The one interface every engine implements, and the checks every engine shares.

`scripts/compare.py` only ever talks to a `Backend`: it loads one by name with `load_backend`,
then calls `logits` and `generate`. Nothing in the comparison knows which library is underneath:
engines are found by name in `BACKENDS`, never imported by the layers below them.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from transformers import GPTBigCodeConfig

from .config import ConfigError, check_tp


@dataclass
class GenerationResult:
    tokens: torch.Tensor                  # LongTensor [B, T + N]: prompt (as given, padded) + new tokens
    prefill_s: float                      # prompt forward + first token
    step_s: list[float] = field(default_factory=list)  # one entry per further token
    kv_cache_bytes: int = 0               # bytes held by the KV cache tensors (measured, per rank)
    stats: dict = field(default_factory=dict)  # engine-specific figures, e.g. speculative acceptance_rate

    @property
    def new_tokens(self) -> int:
        return len(self.step_s) + 1


@runtime_checkable
class Backend(Protocol):
    name: str
    config: GPTBigCodeConfig
    dtype: torch.dtype
    tp_size: int

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """FloatTensor [B, T, V] for every position (padded positions included)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> GenerationResult:
        """Greedy or seeded sampling on a left-padded batch; no early stop."""

    def close(self) -> None:
        """Release what the backend holds (worker processes for TP > 1)."""


class LocalBackend:
    """What every in-process backend shares: inputs checked before any compute, then moved to its device."""

    config: GPTBigCodeConfig
    device: str

    def _prepare(self, input_ids, attention_mask, max_new_tokens=0):
        check_inputs(self.config, input_ids, attention_mask, max_new_tokens)
        return input_ids.to(self.device), attention_mask.to(self.device)

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        """Which implementation runs the linears of a decode step and of the prefill (plugins.kernels);
        engines that call torch directly report 'torch'."""
        return {"decode": "torch", "prefill": "torch"}

    _batch = None

    def batch_decoder(self, slots: int, capacity: int):
        """A `plugins.core.batching.BatchDecoder` on a KV pool of `slots` x `capacity` tokens."""
        raise ConfigError(f"backend {self.name!r} has no continuous batching")

    def open_batch(self, slots: int, capacity: int | None = None, prefix_cache_bytes: int = 0) -> dict:
        """Allocate the KV pool of a continuous batch (`plugins.core.batching`) and return its state;
        `capacity` (prompt + new tokens per request) defaults to n_positions; `prefix_cache_bytes` > 0
        keeps prompt prefixes' KV for reuse, up to that many bytes (per rank)."""
        from .batching import ContinuousBatch

        capacity = self.config.n_positions if capacity is None else capacity
        for name, value, least in (("slots", slots, 1), ("capacity", capacity, 1),
                                   ("prefix_cache_bytes", prefix_cache_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        if capacity > self.config.n_positions:
            raise ConfigError(f"capacity {capacity} exceeds the model's n_positions {self.config.n_positions}")
        self._batch = None  # the old pool is freed before the new one is allocated
        self._batch = ContinuousBatch(self.batch_decoder(slots, capacity), slots, capacity, self.device,
                                      prefix_cache_bytes)
        return self._batch.state()

    def batch_step(self, admit=(), release=()) -> dict:
        """Admit requests (`BatchRequest`s), drop others (ids), decode one token for every running one."""
        if self._batch is None:
            raise ConfigError("call open_batch(slots, capacity) before batch_step")
        return self._batch.step(list(admit), list(release))

    @classmethod
    def check_options(cls, config: GPTBigCodeConfig, tp_size: int, **options) -> None:
        """Refuse, before any work, options this backend does not take or cannot apply to `config` at
        `tp_size` (bench configs are checked with this before any checkpoint is made)."""
        known = [p for p in inspect.signature(cls.from_hf).parameters if p not in ("hf_dir", "dtype", "tp_size")]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} for backend {cls.name!r}; "
                              f"known: {', '.join(known) or 'none'}")


# name -> "module:class"; imported lazily so a missing optional library only affects its backend.
BACKENDS = {
    "hf": "plugins.hf:HFBackend",
    "deepspeed": "plugins.deepspeed:DeepSpeedBackend",
    "deepspeed-autotp": "plugins.deepspeed:AutoTPBackend",
    "megatron": "plugins.megatron:MegatronGPT",
    "ctranslate2": "plugins.peers.ctranslate2:CTranslate2Backend",
    "llama.cpp": "plugins.peers.llamacpp:LlamaCppBackend",
}


def backend_class(name: str):
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_backend(name: str, hf_dir: str | Path, dtype="float32", tp_size: int = 1, **options) -> Backend:
    """Backend `name` (a key of BACKENDS) on the HF checkpoint `hf_dir`; options are the backend's own."""
    from .checkpoint import read_hf_config

    cls = backend_class(name)
    cls.check_options(read_hf_config(hf_dir), tp_size, **options)
    return cls.from_hf(hf_dir, dtype=dtype, tp_size=tp_size, **options)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what weights may be stored in


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype weights may be stored in (float16 included: storing is only a cast, on any device)."""
    return resolve_dtype(dtype, device="cuda")


def resolve_dtype(dtype: str | torch.dtype, device: str | None = None) -> torch.dtype:
    """A torch dtype from a name; refuses fp16 where the device cannot run it (CPU)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == torch.float16 and device == "cpu":
        raise ConfigError("float16 is not supported on CPU (use bfloat16 or float32)")
    return dtype


def check_load(config: GPTBigCodeConfig, tp_size: int, max_tp: int | None = None) -> None:
    """Shared checks before any weights are read."""
    check_tp(config, tp_size)
    if max_tp is not None and tp_size > max_tp:
        raise ConfigError(f"this backend supports tp_size <= {max_tp}, got {tp_size}")


def check_inputs(config: GPTBigCodeConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int = 0) -> None:
    """Shapes, values, left padding and length against n_positions, checked before any compute."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32,
                                                                                                  torch.int64):
        raise ConfigError(f"input_ids must be an integer tensor [batch, seq], got "
                          f"{tuple(getattr(input_ids, 'shape', ()))} {getattr(input_ids, 'dtype', type(input_ids))}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ConfigError(f"input_ids must hold at least one prompt of at least one token, got "
                          f"{tuple(input_ids.shape)}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ConfigError("attention_mask must be a tensor of the same shape as input_ids")
    if attention_mask.is_floating_point() or attention_mask.is_complex() or bool(
            ((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ConfigError("attention_mask must hold only 0 (padding) and 1 (token), as integers or booleans")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size:
        raise ConfigError(f"token ids must lie in [0, {config.vocab_size})")
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        raise ConfigError("attention_mask must be left-padded (zeros first, then ones)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    total = input_ids.shape[1] + max_new_tokens
    if total > config.n_positions:
        raise ConfigError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} "
                          f"exceeds n_positions {config.n_positions}")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: each prompt starts at 0, as if run alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
