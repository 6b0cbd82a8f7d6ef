"""The CPU linear kernels (plugins.kernels): each compiled kernel against an fp32 reference, and what
each rung computes end to end (the probe's decisions and the measured choice: test_kernel_choice.py).

Tests marked `kernels` are run by `make test` once natively and once with every lower rung forced
(PLUGINS_KERNELS=onednn / avx512f / avx2 / torch), so a machine with AVX512 covers the paths of AVX2-only
machines too. The kernel tests themselves run every kernel this CPU can execute, whatever the rung.
"""

import os
import shutil

import pytest
import torch
from torch import nn

from plugins import kernels
from plugins.core.tensors import position_ids
from plugins.engine.registry import load_backend
from plugins.kernels import KERNEL_ROWS, PackedWeights
from plugins.kernels.quant import int8_linear, quantize_per_channel

pytestmark = pytest.mark.kernels

RUNNABLE = [name for name in kernels.KERNEL_ISA if kernels.supported(name)]
per_kernel = pytest.mark.parametrize("name", RUNNABLE or [pytest.param("none", marks=pytest.mark.skip(
    reason="CPU without AVX2/AVX512: no decode kernel runs here"))])


def kernel(name):
    """Kernel `name` built and loaded. This CPU runs it (RUNNABLE) and `make setup` installs g++, so a
    build that fails is this test's failure, not a skip: a broken kernel source must not leave the
    suite green. Only a machine without a C++ compiler skips."""
    module = kernels.build(name)
    if module is None:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip(f"no C++ compiler here to build the {name} kernel")
        pytest.fail(f"the {name} kernel did not build (the warning above says why)")
    return module


def test_a_kernel_that_does_not_build_fails_its_tests(monkeypatch):
    monkeypatch.setitem(kernels.KERNEL_ISA, "missing", ((), []))  # its source file does not exist
    with pytest.warns(UserWarning, match="missing decode kernel unavailable"):
        with pytest.raises(pytest.fail.Exception, match="did not build"):
            kernel("missing")


def bf16_linear(name, x, w, bias, gelu):
    """Kernel `name`'s bf16 linear: avx512's and avx512f's on the weight packed for them, avx2's on the
    weight as stored."""
    if name in kernels.TILED:
        return kernel(name).linear_tiles(x, kernels.pack_tiles(w), w.shape[0], bias, gelu)
    return kernel(name).linear(x, w, bias, gelu)


def test_onednn_bf16_check_agrees_with_packing():
    """The probe's oneDNN answer is what packing really does on this CPU."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8).bfloat16(), 1)
        packs = True
    except RuntimeError as exc:
        assert "bf16 path needs the cpu support" in str(exc)
        packs = False
    assert kernels.onednn_packs_bf16() == packs


def test_bf16_tiles_pack_layout():
    """Our bf16 GEMM's pack (built on any CPU, run on avx512): tile t, pair p, column c, half j holds
    weight[64 t + c, 2 p + j], zero past N and K."""
    w = torch.randn(70, 5).bfloat16()  # a partial second tile, an odd K
    packed = kernels.pack_tiles(w)
    assert packed.shape == (2, 3, 64, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for t, p, c, j in [(0, 0, 0, 0), (0, 1, 5, 1), (1, 2, 5, 0), (1, 0, 3, 1)]:
        assert packed[t, p, c, j] == w[64 * t + c, 2 * p + j]
    assert not packed[0, 2, :, 1].any() and not packed[1, :, 6:].any()  # padding: K's 6th input, rows 70..127


# --- each compiled kernel ---------------------------------------------------------------------------

@per_kernel
@pytest.mark.parametrize("function", ["linear", "linear_fp32"])  # the kernel's own; converted tiles + fp32 GEMM
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 2304, 2048), (1, 37, 100), (3, 64, 96), (6, 40, 33),
                                                            (16, 24, 70), (40, 520, 2050), (7, 9, 70000)])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_bf16_matches_fp32_reference(name, function, rows, out_features, in_features, gelu):
    """Any M, N and K (tails of every width, of tiles): fp32 accumulation, one rounding."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    ref = nn.functional.linear(x.float(), w.float(), bias.float())
    if gelu:
        ref = nn.functional.gelu(ref, approximate="tanh")
    out = bf16_linear(name, x, w, bias, gelu) if function == "linear" else kernel(name).linear_fp32(x, w, bias, gelu)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # bf16 rounding of the result (2^-8 relative) plus fp32 summation error
    assert torch.all((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4 * in_features ** 0.5)


@per_kernel
def test_kernel_rounds_to_bf16_as_torch(name):
    """One input: each dot is one exact product, so the output is torch's own rounding of
    product + bias to bf16, bit for bit (nearest, ties to even: 4096 outputs hold ~16 ties)."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 1, generator=gen).bfloat16(), torch.randn(64, 1, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    want = (x.float() @ w.float().t() + bias.float()).bfloat16()
    assert torch.equal(bf16_linear(name, x, w, bias, False), want)


@per_kernel
@pytest.mark.parametrize("in_features,out_features", [(259, 52), (1100, 130)])
def test_kernel_rows_are_independent_of_the_batch(name, in_features, out_features):
    """Each output row is computed by the same instructions in the same order whatever M is (int8
    with several rows: exact integer sums in another order, the same epilogue; 1100 inputs span
    three of its chunks, 130 outputs end in a partial tile; bf16 on avx512 / avx512f: 101 rows are two row
    chunks of 96 and row tiles of 6, 259 inputs two blocks of pairs, the last pair half padding)."""
    x, w = torch.randn(101, in_features).bfloat16(), torch.randn(out_features, in_features).bfloat16()
    q, scales = quantize_per_channel(w)
    whole = bf16_linear(name, x, w, None, True)
    whole8 = kernel(name).linear_int8(x, q, scales.bfloat16(), None, False)
    for i in (0, 4, 5, 6, 11, 95, 96, 100):
        row = x[i:i + 1].contiguous()
        assert torch.equal(bf16_linear(name, row, w, None, True), whole[i:i + 1])
        assert torch.equal(kernel(name).linear_int8(row, q, scales.bfloat16(), None, False), whole8[i:i + 1])


@per_kernel
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 2304, 2048), (1, 37, 100), (3, 64, 130),
                                                            (1, 16, 8200), (16, 200, 2050)])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_int8_matches_dequantized_reference(name, rows, out_features, in_features, gelu):
    """int8 weights x activations held as 16-bit fixed point per row, exact integer sums, one rounding
    (K = 8200: long enough that the avx2 kernel flushes its int32 sums to int64)."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = (torch.randn(rows, in_features, generator=gen) * torch.logspace(-3, 1, in_features)).bfloat16()
    q, scales = quantize_per_channel(torch.randn(out_features, in_features, generator=gen))
    scales = scales.bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    w = q.float() * scales.float()[:, None]
    ref = nn.functional.linear(x.float(), w, bias.float())
    if gelu:
        ref = nn.functional.gelu(ref, approximate="tanh")
    out = kernel(name).linear_int8(x, q, scales, bias, gelu)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # fixed point: |dx| <= max|x| / 64000 per element; then the bf16 rounding of the result
    fixed_point = x.float().abs().amax(1, keepdim=True) / 64000 * w.abs().sum(1)
    assert torch.all((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1.2 * fixed_point + 1e-6)


@per_kernel
def test_kernel_int8_saturated_sums_do_not_overflow(name):
    """Every weight at +127 and every activation at the fixed-point maximum: the largest sums there are."""
    K = 24576  # StarCoder's widest input (MLP c_proj)
    q = torch.full((3, K), 127, dtype=torch.int8)
    scales = torch.ones(3).bfloat16()
    x = torch.ones(1, K).bfloat16()
    out = kernel(name).linear_int8(x, q, scales, None, False)
    assert torch.allclose(out.float(), torch.full((1, 3), 127.0 * K), rtol=2 ** -8)


@pytest.mark.parametrize("name", [n for n in RUNNABLE if n == "avx512f"] or [pytest.param(
    "avx512f", marks=pytest.mark.skip(reason="CPU without AVX512: no int8 GEMM on packed tiles runs here"))])
@pytest.mark.parametrize("rows", [1, 7, 101])
@pytest.mark.parametrize("gelu", [False, True])
def test_int8_packed_tiles_equal_the_stored_weight_path(name, rows, gelu):
    """The avx512f int8 GEMM on the weight packed once (K odd: the last pair half padding; 130 outputs: a
    partial tile; 1100 inputs: blocks of 128 pairs) gives linear_int8's outputs bit for bit."""
    x = torch.randn(rows, 1101).bfloat16()
    q, scales = quantize_per_channel(torch.randn(130, 1101))
    scales, bias = scales.bfloat16(), torch.randn(130).bfloat16()
    packed = kernels.pack_tiles(q)
    assert packed.dtype == torch.int8 and packed.shape == (3, 551, 64, 2)
    out = kernel(name).linear_int8_tiles(x, packed, 130, scales, bias, gelu)
    assert torch.equal(out, kernel(name).linear_int8(x, q, scales, bias, gelu))


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="one int8 kernel runs here: nothing to compare")
def test_int8_kernels_compute_the_same_integer_sums():
    """Every int8 kernel holds the activations in the same fixed point and sums exactly, so with unit
    scales and no bias (one rounding of the same sum) they agree bit for bit, one row and many."""
    x = (torch.randn(9, 1100) * torch.logspace(-3, 1, 1100)).bfloat16()
    q = torch.randint(-128, 128, (130, 1100), dtype=torch.int8)
    ones = torch.ones(130).bfloat16()
    for rows in (x[:1], x):
        outs = {name: kernel(name).linear_int8(rows, q, ones, None, False) for name in RUNNABLE}
        first = outs[RUNNABLE[0]]
        assert all(torch.equal(out, first) for out in outs.values()), list(outs)


@per_kernel
def test_kernel_nan_input_gives_nan_not_garbage(name):
    x = torch.randn(2, 64).bfloat16()
    x[1, 3] = float("nan")
    q, scales = quantize_per_channel(torch.randn(8, 64))
    out = kernel(name).linear_int8(x, q, scales.bfloat16(), None, False)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


# --- the dispatcher, at whatever rung this process runs (native or forced) ---------------------------

@pytest.mark.parametrize("rows", [1, 2, KERNEL_ROWS, KERNEL_ROWS + 1, 17, 40])
def test_linear_runs_the_probes_choice(rows):
    """kernels.linear gives exactly the output of the implementation the probe names for this many rows."""
    w, b = torch.randn(40, 72).bfloat16(), torch.randn(40).bfloat16()
    x = torch.randn(1, rows, 72).bfloat16()
    packs = PackedWeights()
    impl = kernels.probe().bf16(rows)
    out = kernels.linear(x, w, b, True, packs)
    if impl in kernels.ROW_INVARIANT:
        want = bf16_linear(impl, x[0].contiguous(), w, b, True)[None]
    elif impl == "onednn":
        want = torch.ops.mkldnn._linear_pointwise(x, packs.get(w), b, "gelu", [], "tanh")
    elif impl == "fp32" and kernels.probe().modules:  # tiles converted per thread, fp32 GEMM
        want = next(iter(kernels.probe().modules.values())).linear_fp32(x[0].contiguous(), w, b, True)[None]
    elif impl == "fp32":
        want = nn.functional.gelu(nn.functional.linear(x.float(), w.float(), b.float()), approximate="tanh").bfloat16()
    else:
        want = nn.functional.gelu(nn.functional.linear(x, w, b), approximate="tanh")
    assert torch.equal(out, want), impl
    ref = nn.functional.gelu(nn.functional.linear(x.float(), w.float(), b.float()), approximate="tanh")
    assert torch.all((out.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2)


def test_int8_linear_one_row_agrees_with_torch_int8_kernel():
    lin = nn.Linear(256, 72).to(torch.bfloat16)
    q, scales = quantize_per_channel(lin.weight)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    rows = torch.cat([int8_linear(x[i:i + 1], q, scales.to(torch.bfloat16), lin.bias) for i in range(4)])
    batch = torch.ops.aten._weight_int8pack_mm(x, q, scales.to(torch.bfloat16)) + lin.bias
    assert (rows.float() - batch.float()).abs().max() <= 2 ** -7 * batch.float().abs().max()


def test_injected_linear_is_the_dispatcher_on_the_stored_weight():
    from injection.layer import linear

    w = torch.randn(40, 64).bfloat16().t()  # [in, out] as DeepSpeed names it, stored [out, in]
    b = torch.randn(40).bfloat16()
    for rows in (1, 3, 40):
        x = torch.randn(1, rows, 64).bfloat16()
        packs = PackedWeights()
        assert torch.equal(linear(x, w, b, packs, gelu=True), kernels.linear(x, w.t(), b, True, packs))


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_decode_steps_match_fp32_hf(name, batch, ckpt_factory, padded_batch):
    """bf16 decode steps of the injected model (weights stored [out, in], no extra copy) on this rung's
    path for `batch` rows stay within the bf16 tolerance of HF's fp32 forward."""
    path = ckpt_factory(name)
    ds = load_backend("deepspeed", path, dtype="bfloat16")
    hf = load_backend("hf", path)
    _, ids, mask = padded_batch
    ids, mask = ids[-batch:], mask[-batch:]
    dec = ds.decoder(batch, ids.shape[1] + 3)
    pos = position_ids(mask)
    dec.prefill(ids, mask, pos)
    layer = ds.model.transformer.h[0]
    for owner, attr in (("attention", "attn_qkvw"), ("attention", "attn_ow"), ("mlp", "inter_w"), ("mlp", "output_w")):
        assert getattr(getattr(layer, owner), attr).t().is_contiguous()
    nxt = torch.tensor([5, 7, 11]).repeat(batch, 1)
    steps = []
    for i in range(3):
        full = torch.cat([mask, torch.ones(batch, i + 1, dtype=mask.dtype)], 1)
        steps.append(dec.decode(nxt[:, i:i + 1], full, pos[:, -1:] + 1 + i).float())
    want = hf.logits(torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(batch, 3, dtype=mask.dtype)], 1))[:, -3:]
    err = (torch.stack(steps, 1) - want).abs().max().item()
    assert err <= 1e-2, err


def test_backends_name_the_path_their_linears_take(ckpt_factory):
    path = ckpt_factory("tiny")
    p = kernels.probe()
    ds = load_backend("deepspeed", path, dtype="bfloat16")
    assert ds.linear_paths(4, 32) == {"decode": p.bf16(4), "prefill": p.bf16(128)}
    q = load_backend("deepspeed", path, dtype="bfloat16", quantize="int8")
    assert q.linear_paths(1, 32) == {"decode": f"int8 {p.int8(1)}", "prefill": f"int8 {p.int8(32)}"}
    assert load_backend("deepspeed", path).linear_paths(1, 32) == {"decode": "torch", "prefill": "torch"}  # fp32
    assert load_backend("hf", path, dtype="bfloat16").linear_paths(1, 32) == {"decode": "torch", "prefill": "torch"}


def test_linear_bench_times_every_quantized_kind():
    from plugins.kernels.bench import bench

    table = bench(rows=(1, 3), layers=1, reps=1, layer=[(70, 130), (64, 256)])
    assert [row["rows"] for row in table] == [1, 3]
    p = kernels.probe()
    for row in table:
        kinds = {key.split()[0]: key.split()[1] for key in row if key != "rows"}
        assert kinds["bf16"] == p.bf16(row["rows"]) and kinds["int8"] == p.int8(row["rows"])
        assert kinds["int4"] == p.int4() and all(v > 0 for k, v in row.items() if k != "rows")
