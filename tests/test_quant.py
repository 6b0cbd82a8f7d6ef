"""int8 weight-only quantization (plugins.kernels.quant): per-channel error bounds, the int8 linear on
every path, and a quantized HF model that agrees with bf16 at about half the linear bytes."""

import copy

import pytest
import torch
from torch import nn

from plugins.core.checkpoint import init_model
from plugins.core.config import load_model_config
from plugins.core.generation import Sampler, generate
from plugins.hf import HFDecoder
from plugins.kernels.quant import Int8Linear, int8_linear, quantize_linears, quantize_per_channel, stored_bytes


def test_per_channel_quantization_error_is_bounded():
    w = torch.randn(64, 32) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scale
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (q.float() * scales[:, None] - w).abs().amax(1)
    assert torch.all(err <= scales / 2 + 1e-7)  # at most half a step, per channel


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantized_linear(dtype):
    lin = nn.Linear(48, 40).to(dtype)
    x = torch.randn(3, 5, 48, dtype=dtype)
    q, scales = quantize_per_channel(lin.weight)
    ref = nn.functional.linear(x.float(), q.float() * scales[:, None], lin.bias.float())
    out = int8_linear(x, q, scales.to(dtype), lin.bias)
    assert out.shape == (3, 5, 40) and out.dtype == dtype
    assert (out.float() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.kernels
def test_int8_linear_prefill_rows_dequantize_to_the_same_result():
    from plugins.kernels.quant import DEQUANT_ROWS

    lin = nn.Linear(48, 40).to(torch.bfloat16)
    q, scales = quantize_per_channel(lin.weight)
    x = torch.randn(DEQUANT_ROWS + 2, 48, dtype=torch.bfloat16)
    many = int8_linear(x, q, scales.to(torch.bfloat16), lin.bias)  # the dequantize + GEMM path
    one_by_one = torch.cat([int8_linear(x[i:i + 1], q, scales.to(torch.bfloat16), lin.bias) for i in range(len(x))])
    assert (many.float() - one_by_one.float()).abs().max() < 0.1


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_int8_model_agrees_with_bf16_and_halves_linear_bytes(name, padded_batch):
    _, ids, mask = padded_batch
    model = init_model(load_model_config(name), seed=0, dtype=torch.bfloat16)
    qmodel = quantize_linears(copy.deepcopy(model))
    linears = [m for m in qmodel.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * model.config.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj; lm_head kept
    bf16_linear_bytes = sum(stored_bytes(m) for m in model.modules() if isinstance(m, nn.Linear)
                            and m is not model.lm_head)
    int8_linear_bytes = sum(stored_bytes(m) for m in linears)
    assert 0.45 < int8_linear_bytes / bf16_linear_bytes < 0.56
    ref = generate(HFDecoder(model), ids, mask, 32, Sampler())
    out = generate(HFDecoder(qmodel), ids, mask, 32, Sampler())
    agreement = (ref.tokens[:, -32:] == out.tokens[:, -32:]).float().mean().item()
    assert agreement >= 0.95, agreement
