"""[speed]: int8 weight-only quantization and exact greedy speculative decoding."""

import copy

import pytest
import torch
from torch import nn

from plugins.checkpoint import init_model
from plugins.config import load_model_config
from plugins.generation import Sampler, generate
from plugins.hf import HFDecoder
from plugins.quant import Int8Linear, int8_linear, quantize_linears, quantize_per_channel, weight_bytes
from plugins.speculative import speculative_generate


def test_per_channel_quantization_error_is_bounded():
    w = torch.randn(64, 32) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scale
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (q.float() * scales[:, None] - w).abs().amax(1)
    assert torch.all(err <= scales / 2 + 1e-7)  # at most half a step, per channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantized_linear(dtype):
    lin = nn.Linear(48, 40).to(dtype)
    x = torch.randn(3, 5, 48, dtype=dtype)
    q, scales = quantize_per_channel(lin.weight)
    ref = nn.functional.linear(x.float(), q.float() * scales[:, None], lin.bias.float())
    out = int8_linear(x, q, scales.to(dtype), lin.bias)
    assert out.shape == (3, 5, 40) and out.dtype == dtype
    assert (out.float() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_int8_model_agrees_with_bf16_and_halves_linear_bytes(name, padded_batch):
    _, ids, mask = padded_batch
    model = init_model(load_model_config(name), seed=0, dtype=torch.bfloat16)
    qmodel = quantize_linears(copy.deepcopy(model))
    linears = [m for m in qmodel.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * model.config.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj; lm_head kept
    bf16_linear_bytes = sum(weight_bytes(m) for m in model.modules() if isinstance(m, nn.Linear)
                            and m is not model.lm_head)
    int8_linear_bytes = sum(weight_bytes(m) for m in linears)
    assert 0.45 < int8_linear_bytes / bf16_linear_bytes < 0.56
    ref = generate(HFDecoder(model), ids, mask, 32, Sampler())
    out = generate(HFDecoder(qmodel), ids, mask, 32, Sampler())
    agreement = (ref.tokens[:, -32:] == out.tokens[:, -32:]).float().mean().item()
    assert agreement >= 0.95, agreement


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_plain_greedy(name, k, padded_batch):
    _, ids, mask = padded_batch
    cfg = load_model_config(name)
    target = init_model(cfg, seed=0)
    plain = generate(HFDecoder(target), ids, mask, 40, Sampler())
    # A good draft (the target in int8) and a useless one (other weights): output must not change.
    for draft, min_rate in ((quantize_linears(copy.deepcopy(target)), 0.8), (init_model(cfg, seed=9), 0.0)):
        res, stats = speculative_generate(HFDecoder(target), HFDecoder(draft), ids, mask, 40, k=k)
        assert torch.equal(res.tokens, plain.tokens)
        assert stats.acceptance_rate >= min_rate and stats.drafted == k * stats.rounds
        assert len(res.step_s) == 39
