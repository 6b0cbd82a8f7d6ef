"""Tensor facts every layer shares: dtype names, input checks before any compute, positions of
left-padded prompts, and the byte counts of tensors and of the KV cache (one home for that formula)."""

from __future__ import annotations

import os

import torch
from transformers import GPTBigCodeConfig

from plugins.core.config import ConfigError, arch, check_tp, head_dim, kv_heads_per_rank

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what weights may be stored in


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def storage_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype weights may be stored in (float16 included: storing is only a cast, on any device)."""
    return resolve_dtype(dtype, device="cuda")


def default_device() -> str:
    """Where engines run unless told: the GPU where there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def world_size() -> int:
    """Ranks of this process's group: the group's size once it is up, else what torchrun / deepspeed set."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def needs_ranks(tp_size: int) -> bool:
    """Whether an engine of `tp_size` ranks must start them (plugins.launch), or this process is one of them."""
    return tp_size > world_size()


def resolve_dtype(dtype: str | torch.dtype, device: str | None = None) -> torch.dtype:
    """A torch dtype from a name; refuses fp16 where the device cannot run it (CPU)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    device = device or default_device()
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
    total, n_positions = input_ids.shape[1] + max_new_tokens, arch(config).n_positions
    if total > n_positions:
        raise ConfigError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} "
                          f"exceeds n_positions {n_positions}")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: each prompt starts at 0, as if run alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def beyond_window(attention_mask: torch.Tensor, queries: int, window: int | None) -> torch.Tensor | None:
    """bool [B, 1, queries, S], True where a key lies `window` or more positions before its query (a sliding
    window: a query sees itself and the window - 1 tokens before it, HF's `sliding_window`). The queries are
    the last `queries` columns of the [B, S] 0/1 mask; positions count the tokens of a row (padding and
    masked holes skipped), so a row sees the same keys wherever it sits. None without a window."""
    if window is None:
        return None
    pos = position_ids(attention_mask)
    return (pos[:, None, -queries:, None] - pos[:, None, None, :]) >= window


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(config: GPTBigCodeConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of K and V one token adds to the cache of one rank (heads sharded over `tp_size`)."""
    element = torch.empty((), dtype=dtype).element_size()
    return arch(config).n_layer * 2 * kv_heads_per_rank(config, tp_size) * head_dim(config) * element


def process_group_backend(cuda: bool | None = None) -> str:
    """The ranks' torch.distributed backend: gloo for CPU tensors, and on a CUDA machine NCCL for CUDA
    tensors in the same group ("cpu:gloo,cuda:nccl"): the model's all-reduces stay on the GPUs while
    object collectives (requests, errors, rank lists) keep going through gloo, as torch routes an object
    collective to the group's CPU backend when it has one."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "cpu:gloo,cuda:nccl" if cuda and dist.is_nccl_available() else "gloo"


def use_local_gpu() -> None:
    """Bind this rank to its own GPU (LOCAL_RANK) before its first CUDA collective: NCCL refuses two
    ranks on one device. Nothing to do without CUDA."""
    import os

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
