"""int8 weight-only quantization: per-output-channel symmetric scales, activations stay bf16/fp32.

Decode at small batch is bound by reading weights; int8 halves the bytes of bf16. One bf16 row
runs our kernel where `plugins.kernels.probe()` has one (AVX512-VNNI or AVX2); otherwise torch's
own `aten._weight_int8pack_mm` (CPU and CUDA), which dequantizes inside the kernel.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from . import linear, probe


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], fp32 scales [out]) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


DEQUANT_ROWS = 128


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                gelu: bool = False) -> torch.Tensor:
    """F.linear with an int8 weight (then tanh GELU if asked). `scales` must already be in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    impl = "torch"
    if x.device.type == "cpu" and x2.dtype == torch.bfloat16 and not torch.compiler.is_compiling() and (
            bias is None or bias.dtype == torch.bfloat16):
        impl = probe().int8(x2.shape[0])
    if impl != "torch":  # one row (a decode step at batch 1): our kernel, ~1.6x torch's int8 GEMV
        out = probe().kernel(impl).linear_int8(x2.contiguous(), q, scales, bias, gelu)
        return out.view(*shape[:-1], q.shape[0])
    # The packed kernel takes fp32 / bf16 activations, and its cost grows with the rows (measured here:
    # ~linear in M, as slow as dequantize + GEMM at ~128 rows): a prefill dequantizes once instead.
    if x2.dtype not in (torch.float32, torch.bfloat16) or x2.shape[0] >= DEQUANT_ROWS:
        out = linear(x2, q.to(x2.dtype) * scales[:, None].to(x2.dtype))
    else:
        out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), q, scales)
    if bias is not None:
        out = out + bias
    if gelu:
        out = F.gelu(out, approximate="tanh")
    return out.reshape(*shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    def __init__(self, source: nn.Linear):
        super().__init__()
        q, scales = quantize_per_channel(source.weight)
        dtype = source.weight.dtype
        self.in_features, self.out_features = source.in_features, source.out_features
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales.to(dtype))
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        return int8_linear(x, self.weight_int8, self.scales, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_linears(module: nn.Module, skip=("lm_head",)) -> nn.Module:
    """Replace every nn.Linear below `module` (except names containing `skip`) by Int8Linear, in place.

    The LM head stays in full precision by default: it is tied to the embedding, and the ranking of
    the top tokens is what int8 errors would disturb most.
    """
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and not any(s in name for s in skip):
            setattr(module, name, Int8Linear(child))
        else:
            quantize_linears(child, skip)
    return module


def stored_bytes(module: nn.Module) -> int:
    """Bytes a module stores: parameters and numeric buffers (tied tensors once; HF's boolean mask table excluded)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.dtype != torch.bool and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
