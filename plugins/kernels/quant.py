"""Weight-only quantization; activations stay bf16/fp32.

Decode at small batch is bound by reading weights. int8 (per-output-channel symmetric scales) halves
the bytes of bf16: bf16 activations run our kernel where `plugins.kernels.probe("int8")` has one (AVX512-VNNI:
any number of rows, as fast as oneDNN's bf16 GEMM from 16 rows; AVX512F: any number of rows; AVX2: one
row), otherwise torch's own
`aten._weight_int8pack_mm` (CPU and CUDA), which dequantizes inside the kernel, or the weight
dequantized for the call ('dequant', the choice for many rows where the bf16 GEMM is fast). int4 (groups of
INT4_GROUP input channels, a scale and a zero point each) quarters them: our AVX512-VNNI kernel on
bf16 activations (its own pack, read as stored), else torch's CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plugins.kernels import TILED, PackedWeights, bf16_choice, choice_rows, decision, linear, probe


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], fp32 scales [out]) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                gelu: bool = False, packs: PackedWeights | None = None, impl: str | None = None) -> torch.Tensor:
    """F.linear with an int8 weight (then tanh GELU if asked). `scales` must already be in x's dtype.
    `packs` keeps the weight packed for the avx512f rung's GEMM (any rows; without it, the stored weight).
    bf16 on CPU runs the probe's choice for this many rows (or `impl`, a name Probe.int8 gives)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.device.type != "cpu" or x2.dtype != torch.bfloat16 or torch.compiler.is_compiling() or (
            bias is not None and bias.dtype != torch.bfloat16):
        impl = "torch"
    impl = impl or probe("int8").int8(choice_rows(x2.shape[0]))
    if impl == "avx512f" and packs is not None:
        out = decision().kernel(impl).linear_int8_tiles(x2.contiguous(), packs.get(q, impl), q.shape[0], scales, bias,
                                                        gelu)
        return out.view(*shape[:-1], q.shape[0])
    if impl not in ("torch", "dequant"):  # our kernels (any rows)
        out = decision().kernel(impl).linear_int8(x2.contiguous(), q, scales, bias, gelu)
        return out.view(*shape[:-1], q.shape[0])
    # 'dequant': the weight widened for this call (~2 passes over it, then the bf16 linear's choice);
    # torch's packed kernel takes fp32 / bf16 activations only, and (CPU, torch 2.13) segfaults when K
    # is not a multiple of 16 (tested): those dequantize too
    if impl == "dequant" or x2.dtype not in (torch.float32, torch.bfloat16) or (
            x2.device.type == "cpu" and shape[-1] % 16):
        inner = bf16_choice(x2)
        if inner in ("fp32", "fp32-whole"):  # straight to fp32: one conversion
            out = F.linear(x2.float(), q.float() * scales[:, None].float()).to(x2.dtype)
        else:  # a weight made for this call is not worth packing: oneDNN unpacked
            out = linear(x2, q.to(x2.dtype) * scales[:, None].to(x2.dtype),
                         impl="torch" if inner in TILED or inner == "onednn" else inner)
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
        self.packs = PackedWeights()

    def forward(self, x):
        return int8_linear(x, self.weight_int8, self.scales, self.bias, packs=self.packs)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


# 128 input channels share a scale and a zero point (bf16): 4.25 bits per weight, 0.27x bf16 (groups
# of 32 would cost 5 bits, 0.31x); the per-group zero point keeps the error of 16 levels small.
INT4_GROUP = 128


@dataclass
class Int4Weight:
    """A [N, K] weight on the int4_grid of groups of INT4_GROUP inputs, weight = (q - 8) * scale + zero
    (q in 0..15), in one of two packs:

    - "avx512" (bf16 activations where `probe("int4").int4()` names our kernel): `packed` uint8 [T, K' / 4,
      128] in the kernel's order (pack_int4_tiles), `scale_zeros` [T, G, 2, 64] bf16: per tile of 64
      columns and group, the scales then the zero points;
    - "torch": torch's CPU int4 pack (`aten._convert_weight_to_int4pack_for_cpu`: N padded to 64, K
      to a whole group), `scale_zeros` [G, N', 2] in the activations' dtype, as its kernel takes them."""

    shape: tuple[int, int]
    packed: torch.Tensor
    scale_zeros: torch.Tensor
    layout: str = "torch"


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, G, INT4_GROUP] uint8 in 0..15, scales [N, G], offsets [N, G]): per group,
    16 levels from its min to its max (weight ~= q * scale + offset); K zero-padded to a whole group."""
    n, k = weight.shape
    w = F.pad(weight.detach().float(), (0, -k % INT4_GROUP)).view(n, -1, INT4_GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q, scales, lo


TILE = 64  # output columns per tile of our int4 kernel


def pack_int4_tiles(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, G, INT4_GROUP] (0..15), scales and zeros [N, G] -> our kernel's pack (see csrc/tiles_avx512.h):
    per tile of 64 columns and 4 inputs, 128 bytes: columns 0-15 | 16-31 << 4, then 32-47 | 48-63 << 4,
    each column 4 bytes of consecutive inputs (vpdpbusd's layout); and bf16 [T, G, 2, 64] scales, zeros."""
    n, groups, _ = q.shape
    tiles, k4 = -(-n // TILE), groups * INT4_GROUP // 4
    q = F.pad(q, (0, 0, 0, 0, 0, tiles * TILE - n)).reshape(tiles, 4, 16, k4, 4).permute(0, 3, 1, 2, 4)
    packed = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(tiles, k4, 128).contiguous()
    params = F.pad(torch.stack([scales, zeros], -1), (0, 0, 0, 0, 0, tiles * TILE - n))
    return packed, params.view(tiles, TILE, groups, 2).permute(0, 2, 3, 1).contiguous().to(torch.bfloat16)


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16, layout: str | None = None) -> Int4Weight:
    """weight [N, K] -> Int4Weight (the int4_grid levels) for activations of `dtype`, in the pack of the
    kernel that will run it here (or of `layout`, a name Probe.int4 gives)."""
    n, k = weight.shape
    q, scales, lo = int4_grid(weight)
    zeros = lo + 8 * scales  # (q - 8) * scale + zero: the zero point is mid-range, small, cheap to round
    if layout is None:
        layout = probe("int4").int4() if dtype == torch.bfloat16 and weight.device.type == "cpu" else "torch"
    if layout != "torch":
        packed, params = pack_int4_tiles(q, scales, zeros)
        return Int4Weight((n, k), packed, params, layout)
    q = F.pad(q.view(n, -1), (0, 0, 0, -n % 64)).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scale_zeros = F.pad(torch.stack([scales, zeros], -1), (0, 0, 0, 0, 0, -n % 64)).transpose(0, 1)
    return Int4Weight((n, k), packed, scale_zeros.contiguous().to(dtype))


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
    """F.linear with an Int4Weight (then tanh GELU if asked): our kernel on its pack, else torch's CPU
    int4 kernel. Both compute a row alike whatever the number of rows (tested bit for bit)."""
    shape, (n, k) = x.shape, w.shape
    x2 = x.reshape(-1, k)
    if w.layout != "torch":
        if x2.dtype != torch.bfloat16:
            raise TypeError(f"this int4 weight was packed for bf16 activations, got {x2.dtype}")
        out = decision().kernel(w.layout).linear_int4(x2.contiguous(), w.packed, w.scale_zeros, n, bias, gelu)
        return out.reshape(*shape[:-1], n)
    padded = w.scale_zeros.shape[0] * INT4_GROUP
    if padded != k:  # a K that is not a whole number of groups (never santacoder's): zero inputs
        x2 = F.pad(x2, (0, padded - k))
    x2 = x2.to(w.scale_zeros.dtype).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, INT4_GROUP, w.scale_zeros)
    out = out[:, :n].to(x.dtype)
    if bias is not None:
        out = out + bias
    if gelu:
        out = F.gelu(out, approximate="tanh")
    return out.reshape(*shape[:-1], n)


class Int4Linear(nn.Module):
    def __init__(self, source: nn.Linear):
        super().__init__()
        self.weight_int4 = quantize_int4(source.weight, source.weight.dtype)
        self.register_buffer("int4_packed", self.weight_int4.packed)  # buffers: stored_bytes sees them
        self.register_buffer("int4_scale_zeros", self.weight_int4.scale_zeros)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach().clone(), requires_grad=False)

    def forward(self, x):
        return int4_linear(x, self.weight_int4, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"


QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(module: nn.Module, skip=("lm_head",), kind: str = "int8") -> nn.Module:
    """Replace every nn.Linear below `module` (except names containing `skip`) by a `kind` linear, in place.

    The LM head stays in full precision by default: it is tied to the embedding, and the ranking of
    the top tokens is what int8 errors would disturb most.
    """
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and not any(s in name for s in skip):
            setattr(module, name, QUANTIZED[kind](child))
        else:
            quantize_linears(child, skip, kind)
    return module


def stored_bytes(module: nn.Module) -> int:
    """Bytes a module stores: parameters and numeric buffers (tied tensors once; HF's boolean mask table excluded)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.dtype != torch.bool and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
