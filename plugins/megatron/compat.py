"""Every patch megatron-core 0.16.1 needs to run on CPU, in one place.

Applied by `apply()` only when CUDA is absent; with a GPU megatron-core runs as shipped.
tests/unit/test_megatron.py has one test per patch that fails once upstream no longer needs it
(or no longer has the shape we patch).
"""

from __future__ import annotations

import torch

from plugins import kernels

_applied = False
ORIGINAL = {"current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize}


def _cpu_device() -> str:
    return "cpu"


def _no_sync(device=None) -> None:
    pass


def apply() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    # megatron.core.utils.GlobalMemoryBuffer.get_tensor (attention scores buffer),
    # transformer.attention.Attention._allocate_memory (the static KV cache) and
    # tensor_parallel.mappings._gather_along_* (TP all-gather outputs) allocate on
    # `torch.cuda.current_device()`, which raises without CUDA. On a CPU-only torch the real
    # function can only raise, so answering "cpu" changes nothing for anyone else.
    torch.cuda.current_device = _cpu_device
    # megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync
    # .preload_tensors and async_utils call `torch.cuda.synchronize()` around D2H copies that
    # are no-ops here.
    torch.cuda.synchronize = _no_sync
    # megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork (entered around attention
    # dropout even at p=0) swaps CUDA RNG states; the inference tracker's fork is a no-op.
    from megatron.core.tensor_parallel import random as mpu_random
    mpu_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # megatron.core.tensor_parallel.layers.{Column,Row}ParallelLinear._forward_impl: every
    # linear (QKV, projections, MLP, output layer) runs F.linear, whose batch-1 bf16 GEMV streams
    # weights below our kernels' rate, and whose multi-row bf16 GEMM has no fast path on CPUs without
    # oneDNN bf16 (AVX2). bf16 without autograd goes where `plugins.kernels.probe()` says: our
    # kernels (their packs kept on the linear module, as long as it lives), or fp32 on converted
    # weights, on the weight as megatron stores it, [out / tp, in]; oneDNN and the rest stay upstream.
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    for cls in (ColumnParallelLinear, RowParallelLinear):
        ORIGINAL[f"{cls.__name__}._forward_impl"] = cls._forward_impl
        cls._forward_impl = _make_decode_forward_impl(cls._forward_impl)
    _applied = True


def _make_decode_forward_impl(upstream):
    def _forward_impl(self, input, weight, *args, **kwargs):
        bias = kwargs.get("bias")
        if (weight.dtype == torch.bfloat16 and not torch.is_grad_enabled() and not args and weight.is_contiguous()
                and (bias is None or bias.dtype == torch.bfloat16)
                and kernels.bf16_choice(input) in (*kernels.ROW_INVARIANT, "fp32")):
            packs = self.__dict__.setdefault("_decode_packs", kernels.PackedWeights())
            return kernels.linear(input, weight, bias, packs=packs)
        return upstream(self, input, weight, *args, **kwargs)

    return _forward_impl
