"""Weight-only quantization (plugins.kernels.quant): per-channel int8 and group-wise int4 error bounds,
the quantized linears on every path (one row and many alike), and quantized HF models that agree with
bf16 at about half (int8) and under 0.3x (int4) of the linear bytes."""

import copy

import pytest
import torch
from torch import nn

from plugins import kernels
from plugins.core.checkpoint import init_model
from plugins.core.config import load_model_config
from plugins.engine.generation import generate
from plugins.engine.hf_model import HFDecoder
from plugins.engine.sampling import Sampler
from plugins.kernels.quant import (INT4_GROUP, Int4Linear, Int8Linear, int4_grid, int4_linear, int8_linear,
                                   quantize_int4, quantize_linears, quantize_per_channel, stored_bytes)


def test_per_channel_quantization_error_is_bounded():
    w = torch.randn(64, 32) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scale
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (q.float() * scales[:, None] - w).abs().amax(1)
    assert torch.all(err <= scales / 2 + 1e-7)  # at most half a step, per channel


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [48, 130])  # 130: torch's int8pack kernel would crash (dequantized)
def test_int8_linear_matches_dequantized_linear(dtype, in_features):
    lin = nn.Linear(in_features, 40).to(dtype)
    x = torch.randn(3, 5, in_features, dtype=dtype)
    q, scales = quantize_per_channel(lin.weight)
    ref = nn.functional.linear(x.float(), q.float() * scales[:, None], lin.bias.float())
    out = int8_linear(x, q, scales.to(dtype), lin.bias)
    assert out.shape == (3, 5, 40) and out.dtype == dtype
    assert (out.float() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.kernels
def test_int8_linear_prefill_rows_dequantize_to_the_same_result():
    from plugins.kernels import DEQUANT_ROWS

    lin = nn.Linear(48, 40).to(torch.bfloat16)
    q, scales = quantize_per_channel(lin.weight)
    x = torch.randn(DEQUANT_ROWS + 2, 48, dtype=torch.bfloat16)
    many = int8_linear(x, q, scales.to(torch.bfloat16), lin.bias)  # the dequantize + GEMM path, or our kernel
    one_by_one = torch.cat([int8_linear(x[i:i + 1], q, scales.to(torch.bfloat16), lin.bias) for i in range(len(x))])
    if kernels.probe().int8(len(x)) in ("avx512", "avx512f"):  # exact integer sums whatever the rows
        assert torch.equal(many, one_by_one)
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


def test_int4_grid_error_is_half_a_step_per_group():
    w = torch.randn(24, 300) * torch.logspace(-2, 1, 24)[:, None]  # K = 300: a partial last group
    q, scales, offsets = int4_grid(w)
    assert q.shape == (24, 3, INT4_GROUP) and int(q.max()) <= 15
    grid = (q.float() * scales[..., None] + offsets[..., None]).view(24, -1)[:, :300]
    step = scales.repeat_interleave(INT4_GROUP, 1)[:, :300]
    assert torch.all((grid - w).abs() <= step / 2 + 1e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 200), (64, 128), (130, 384), (70, 1100)])  # odd N and K; K over chunks
def test_int4_linear_matches_the_fp32_grid(shape, dtype):
    n, k = shape
    w, bias = torch.randn(n, k), torch.randn(n).to(dtype)
    q, scales, offsets = int4_grid(w)
    # the grid as stored: scales and zero points in the activations' dtype
    stored_scales, stored_zeros = scales.to(dtype).float(), (offsets + 8 * scales).to(dtype).float()
    grid = ((q.float() - 8) * stored_scales[..., None] + stored_zeros[..., None]).view(n, -1)[:, :k]
    weight = quantize_int4(w, dtype)
    for rows in (1, 3, 130):  # a decode step, a verify, a prefill
        x = torch.randn(rows, k).to(dtype)
        want = x.float() @ grid.t() + bias.float()
        got = int4_linear(x, weight, bias)
        assert got.shape == (rows, n) and got.dtype == dtype
        # bf16: the product and then the biased sum each rounded to bf16 (half an ulp, 2^-8 relative,
        # each: torch's kernel adds the bias after its own rounding); measured at most 7.1e-3 over 150 seeds
        bound = 1e-4 if dtype == torch.float32 else 2 ** -7 + 2e-3
        assert (got.float() - want).abs().max() <= bound * want.abs().max(), (rows, dtype)


@pytest.mark.kernels
def test_int4_rows_are_computed_as_one_row_alone():
    """The int4 kernel in use (ours, or torch's: then this fails if an upstream change breaks it)
    computes a row the same way whatever the number of rows, what an exact speculative verify on int4
    weights relies on."""
    for n, k in ((96, 256), (70, 1100)):
        weight = quantize_int4(torch.randn(n, k))
        x = torch.randn(11, k).to(torch.bfloat16)
        one_by_one = torch.cat([int4_linear(x[i:i + 1], weight, None) for i in range(11)])
        assert torch.equal(int4_linear(x, weight, None), one_by_one), weight.layout


def test_int4_linears_store_under_0_3x_of_bf16():
    """The four linears of a santacoder-1b layer (K a multiple of the group: no padding)."""
    shapes = [(2048, 2304), (2048, 2048), (2048, 8192), (8192, 2048)]
    sources = [nn.Linear(i, o).to(torch.bfloat16) for i, o in shapes]
    bf16 = sum(stored_bytes(m) for m in sources)
    int4 = sum(stored_bytes(Int4Linear(m)) for m in sources)
    assert int4 <= 0.3 * bf16, int4 / bf16


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_int4_model_agrees_with_bf16(name, padded_batch):
    _, ids, mask = padded_batch
    model = init_model(load_model_config(name), seed=0, dtype=torch.bfloat16)
    qmodel = quantize_linears(copy.deepcopy(model), kind="int4")
    assert len([m for m in qmodel.modules() if isinstance(m, Int4Linear)]) == 4 * model.config.n_layer
    # A random model's logits are nearly flat (greedy agreement means little: the trained model's figures
    # are in the quality bench); the logits must move by quantization error only, about 4x int8's.
    real = mask.bool()
    want = model(ids, attention_mask=mask).logits[real].float()
    int4 = (qmodel(ids, attention_mask=mask).logits[real].float() - want).abs()
    int8 = (quantize_linears(copy.deepcopy(model))(ids, attention_mask=mask).logits[real].float() - want).abs()
    print(f"{name}: mean |logit diff| vs bf16: int4 {int4.mean():.4f}, int8 {int8.mean():.4f}; "
          f"logit std {want.std():.3f}")
    assert int4.mean() < 0.1 * want.std() and int8.mean() < int4.mean() < 20 * int8.mean()
