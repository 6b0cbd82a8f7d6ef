"""The fused layer kernels (plugins.kernels.layer_ops): residual adds + layer norm on every compiled
kernel, MQA decode attention on the AVX512 ones, each against torch's ops on the same bf16 inputs;
and that the injected layer runs them where they apply. Marked `kernels`: `make test` reruns these
with every lower rung forced."""

import os

import pytest
import torch
import torch.nn.functional as F
from test_kernels import kernel

from injection.one_token import OneTokenStep
from plugins import kernels
from plugins.core.tensors import position_ids
from plugins.engine.registry import load_backend
from plugins.kernels import layer_ops

pytestmark = pytest.mark.kernels

RUNNABLE = [name for name in kernels.KERNEL_ISA if kernels.supported(name)]
# the avx512 rungs' decode attention, and the AMX one (scores on tiles) where the CPU has AMX-BF16
ATTENTION = [name for name in RUNNABLE if name in kernels.TILED] + (["amx"] if kernels.supported("amx") else [])


def skip_if_none(names):
    return names or [pytest.param("none", marks=pytest.mark.skip(reason="no such kernel runs on this CPU"))]


def bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16()


@pytest.mark.parametrize("name", skip_if_none(RUNNABLE))
@pytest.mark.parametrize("rows,width", [(1, 2048), (5, 37), (16, 2304)])
def test_add_layer_norm_matches_torch(name, rows, width):
    """s = x + y + bias summed in fp32 and rounded once, bit for bit; the norm of s within bf16's
    rounding of torch's fp32 layer norm; without y, s is x itself."""
    gen = torch.Generator().manual_seed(rows + width)
    x, y = bf16(rows, width, gen=gen), bf16(rows, width, gen=gen)
    bias, gamma, beta = bf16(width, gen=gen), bf16(width, gen=gen), bf16(width, gen=gen)
    s, normed = kernel(name).add_layer_norm(x, y, bias, gamma, beta, 1e-5)
    want_s = (x.float() + y.float() + bias.float()).bfloat16()
    assert torch.equal(s, want_s)
    want = F.layer_norm(want_s.float(), (width,), gamma.float(), beta.float(), 1e-5)
    assert torch.all((normed.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-4)
    alone, normed_x = kernel(name).add_layer_norm(x, None, None, gamma, beta, 1e-5)
    assert alone.data_ptr() == x.data_ptr()
    want_x = F.layer_norm(x.float(), (width,), gamma.float(), beta.float(), 1e-5)
    assert torch.all((normed_x.float() - want_x).abs() <= want_x.abs() * 2 ** -8 + 1e-4)


@pytest.mark.parametrize("name", skip_if_none(RUNNABLE))
@pytest.mark.parametrize("with_bias", [True, False])
def test_add_residuals_in_place(name, with_bias):
    """x <- (x + a + a_bias) + y + y_bias, each sum in fp32 rounded once, written into x."""
    gen = torch.Generator().manual_seed(3)
    x, a, y = bf16(4, 70, gen=gen), bf16(4, 70, gen=gen), bf16(4, 70, gen=gen)
    a_bias, y_bias = (bf16(70, gen=gen), bf16(70, gen=gen)) if with_bias else (None, None)
    first = x.float() + a.float() + (a_bias.float() if with_bias else 0)
    want = (first.bfloat16().float() + y.float() + (y_bias.float() if with_bias else 0)).bfloat16()
    before = x.data_ptr()
    kernel(name).add_residuals_(x, a, a_bias, y, y_bias)
    assert x.data_ptr() == before and torch.equal(x, want)


@pytest.mark.parametrize("name", skip_if_none(ATTENTION))
@pytest.mark.parametrize("heads,length,head_dim", [(16, 136, 128), (8, 1, 64), (20, 70, 36), (3, 9, 8)])
def test_mqa_decode_attention_matches_sdpa(name, heads, length, head_dim):
    """One query token per sequence against one K/V head, read through views of a larger cache
    (strided batch), with left padding masked; more than 16 heads are two lane groups; a head dim
    that is not a multiple of 8 ends in single columns. A sequence with nothing to attend gets zeros."""
    gen = torch.Generator().manual_seed(heads * length + head_dim)
    batch, capacity = 4, length + 5
    qkv = bf16(batch, (heads + 2) * head_dim, gen=gen)
    query = qkv[:, :heads * head_dim].view(batch, heads, head_dim)
    k_cache, v_cache = bf16(batch, capacity, head_dim, gen=gen), bf16(batch, capacity, head_dim, gen=gen)
    key, value = k_cache[:, :length], v_cache[:, :length]
    allowed = torch.ones(batch, length, dtype=torch.bool)
    allowed[1, :length // 2] = False   # left padding
    allowed[3] = False                 # nothing to attend
    scale = head_dim ** -0.5
    out = kernel(name).mqa_decode_attention(query, key, value, allowed, scale)
    want = F.scaled_dot_product_attention(query.float()[:, None], key.float()[:, None], value.float()[:, None],
                                          attn_mask=allowed[:, None, None], scale=scale).reshape(batch, -1)
    assert out.shape == (batch, heads * head_dim) and out.dtype == torch.bfloat16
    assert torch.all((out[:3].float() - want[:3]).abs() <= want[:3].abs() * 2 ** -8 + 1e-3)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    unmasked = kernel(name).mqa_decode_attention(query, key, value, None, scale)
    want = F.scaled_dot_product_attention(query.float()[:, None], key.float()[:, None], value.float()[:, None],
                                          scale=scale).reshape(batch, -1)
    assert torch.all((unmasked.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3)


def test_layer_ops_follow_the_rung():
    """Every compiled rung fuses the norms and residual adds; the AVX512 rungs also run the decode
    attention; the torch rung, fp32 and torch.compile use torch's ops (None / False)."""
    p = kernels.probe()
    x, g = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
    q, kv = torch.randn(2, 4, 16).bfloat16(), torch.randn(2, 5, 16).bfloat16()
    assert (layer_ops.add_layer_norm(x, g, g, 1e-5) is not None) == bool(p.modules)
    assert (layer_ops.mqa_decode_attention(q, kv, kv, None, 0.25) is not None) == (
        any(name in p.modules for name in kernels.TILED))
    assert layer_ops.add_layer_norm(x.float(), g.float(), g.float(), 1e-5) is None
    assert layer_ops.mqa_decode_attention(q.float(), kv.float(), kv.float(), None, 0.25) is None


def test_amx_attention_runs_where_the_cpu_has_it_unless_turned_off(monkeypatch):
    """On the avx512 rung of a CPU with AMX-BF16 the decode attention is the AMX kernel (it must build and
    get its tiles: no silent fallback); PLUGINS_KERNELS_AMX=0 gives the rung's own kernel back."""
    amx_here = (kernels.supported("amx") and "avx512" in kernels.decision().modules
                and os.environ.get(layer_ops.AMX_ENV) != "0")
    assert (layer_ops.amx_module() is not None) == amx_here
    if amx_here:
        assert layer_ops.compiled("mqa_decode_attention") is layer_ops.amx_module().mqa_decode_attention
    monkeypatch.setenv(layer_ops.AMX_ENV, "0")
    layer_ops.amx_module.cache_clear()
    try:
        assert layer_ops.amx_module() is None
        rung = layer_ops.compiled("mqa_decode_attention")
        assert rung is None or any(rung is getattr(m, "mqa_decode_attention", None)
                                   for m in kernels.decision().modules.values())
    finally:
        monkeypatch.undo()  # the environment as it was, then the module it chooses
        layer_ops.amx_module.cache_clear()


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_injected_layer_runs_the_fused_kernels(name, ckpt_factory, padded_batch, monkeypatch):
    """A bf16 decode step of the injected model calls the fused kernels once per layer each where the
    rung has them (attention: MQA only), and its logits match the same step on torch's ops."""
    path = ckpt_factory(name)
    ds = load_backend("deepspeed", path, dtype="bfloat16")
    _, ids, mask = padded_batch
    pos = position_ids(mask)
    full = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
    nxt = torch.full((ids.shape[0], 1), 7)

    def step():
        dec = ds.decoder(ids.shape[0], ids.shape[1] + 2)
        dec.prefill(ids, mask, pos)
        return dec.decode(nxt, full, pos[:, -1:] + 1).float()

    ran = {"add_layer_norm": 0, "add_residuals_": 0, "mqa_decode_attention": 0}
    amx = [layer_ops.amx_module()] if layer_ops.amx_module() is not None else []
    for module in [*kernels.decision().modules.values(), *amx]:  # the kernels themselves, whoever calls them
        for fn in ran:
            if hasattr(module, fn):
                def counted(*args, _fn=getattr(module, fn), _name=fn):
                    ran[_name] += 1
                    return _fn(*args)
                monkeypatch.setattr(module, fn, counted)
    fused = step()
    layers = ds.model.config.n_layer
    p = kernels.probe()
    mqa = ds.model.config.multi_query
    assert ran["add_layer_norm"] == (2 * layers * 2 if p.modules else 0)  # prefill + decode, two norms each
    assert ran["add_residuals_"] == (2 * layers if p.modules else 0)
    assert ran["mqa_decode_attention"] == (layers if mqa and any(n in p.modules for n in kernels.TILED) else 0)
    monkeypatch.setattr(layer_ops, "compiled", lambda name: None)
    monkeypatch.setattr(OneTokenStep, "takes", staticmethod(lambda *a: False))  # it holds the kernels it found
    unfused = step()
    assert (fused - unfused).abs().max().item() <= 2e-2


def test_megatron_decode_step_runs_the_attention_kernel(ckpt_factory, padded_batch, monkeypatch):
    """megatron's SDPAttention sends a bf16 one-token MQA step (left-padded batch) to the decode kernel
    where the rung has it, with logits that match the same step on SDPA."""
    ds = load_backend("megatron", ckpt_factory("tiny"), dtype="bfloat16")
    _, ids, mask = padded_batch
    pos = position_ids(mask)
    full = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)

    def step():
        dec = ds.decoder(ids.shape[0], ids.shape[1] + 2)
        dec.prefill(ids, mask, pos)
        return dec.decode(torch.full((ids.shape[0], 1), 7), full, pos[:, -1:] + 1).float()

    calls = []
    real = layer_ops.mqa_decode_attention
    monkeypatch.setattr(layer_ops, "mqa_decode_attention", lambda *a: calls.append(real(*a)) or calls[-1])
    fused = step()
    has_kernel = any(name in kernels.probe().modules for name in kernels.TILED)
    assert len(calls) == ds.config.n_layer and all((c is not None) == has_kernel for c in calls)
    monkeypatch.setattr(layer_ops, "mqa_decode_attention", lambda *a: None)
    assert (fused - step()).abs().max().item() <= 2e-2
