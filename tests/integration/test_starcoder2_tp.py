"""StarCoder2 (tiny-starcoder2: 4 query heads, 2 KV heads, RoPE, window 16) tensor-parallel in real processes
(torchrun ranks over gloo): megatron-core at TP 2 and DeepSpeed's injected layers at TP 2 (one KV head per
rank) and TP 4 (each KV head replicated on two ranks), and DeepSpeed AutoTP at TP 2 (HF's own layers, one
KV head per rank) give HF's logits (fp32) and greedy tokens on a left-padded batch past the window, and their
continuous batching equals `generate` alone."""

import pytest
import torch
from batch_driver import alone, requests, run
from checkpoint_variants import biased_copy

from injection.tp import qkv_rows
from plugins.core.tokenizer import left_pad, prompt_token_ids
from plugins.engine.registry import load_backend

TOL = 1e-5


@pytest.fixture(scope="module")
def sc2_biased(sc2, tmp_path_factory):
    """tiny-starcoder2 with random biases and norms (seeded ones are zero / one): TP must add each all-reduced
    linear's bias once."""
    return biased_copy(sc2, tmp_path_factory.mktemp("sc2") / "biased")


@pytest.mark.parametrize("tp", [2, 4])
def test_deepspeed_tp_matches_hf(sc2, window_batch, tokenizer, tp):
    ids, mask = window_batch
    hf = load_backend("hf", sc2, dtype="float32")
    ref_logits, ref = hf.logits(ids, mask), hf.generate(ids, mask, 40)
    with load_backend("deepspeed", sc2, dtype="float32", tp_size=tp) as ds:
        assert (ds.logits(ids, mask) - ref_logits)[mask.bool()].abs().max() <= TOL
        res = ds.generate(ids, mask, 40)
        assert torch.equal(res.tokens, ref.tokens)
        # every rank: its 4 / tp query heads and one KV head (its share at TP 2, its group's copy at TP 4)
        assert [info["attn_qkvw"] for info in ds.shard_info()] == [(64, (4 // tp + 2) * 16)] * tp
        assert res.kv_cache_bytes == 2 * 2 * 3 * 79 * 1 * 16 * 4
        if tp == 2:
            schedule = requests(tokenizer)[:6]
            _, out, _ = run(ds, schedule, budget=16)
            for _, request in schedule:
                assert out[request.id] == alone(hf, request), f"request {request.id}"


def test_megatron_tp2_matches_hf(sc2, tokenizer):
    ids, mask = left_pad([prompt_token_ids(tokenizer, n, i) for i, n in enumerate((5, 40, 23))])
    hf = load_backend("hf", sc2, dtype="float32")
    ref_logits, ref = hf.logits(ids, mask), hf.generate(ids, mask, 40)
    with load_backend("megatron", sc2, dtype="float32", tp_size=2) as tp2:
        assert tp2.tp_size == 2
        assert (tp2.logits(ids, mask) - ref_logits)[mask.bool()].abs().max() <= TOL
        res = tp2.generate(ids, mask, 40)
        assert torch.equal(res.tokens, ref.tokens)
        one = load_backend("megatron", sc2, dtype="float32").generate(ids, mask, 40)
        assert res.kv_cache_bytes == one.kv_cache_bytes // 2  # the 2 KV heads split: one per rank
        schedule = requests(tokenizer)[:6]
        _, out, _ = run(tp2, schedule, budget=16)
        for _, request in schedule:
            assert out[request.id] == alone(hf, request), f"request {request.id}"


def test_autotp_tp2_matches_hf(sc2_biased, window_batch, tokenizer):
    """Real `deepspeed.init_inference(..., replace_with_kernel_inject=False, tensor_parallel={"tp_size": 2})`."""
    ids, mask = window_batch
    hf = load_backend("hf", sc2_biased, dtype="float32")
    ref_logits, ref = hf.logits(ids, mask), hf.generate(ids, mask, 40)
    attn = hf.model.model.layers[0].self_attn
    ref_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().t()  # [in, out]
    with load_backend("deepspeed-autotp", sc2_biased, dtype="float32", tp_size=2) as tp2:
        shards = tp2.shard_info()
        diff = (tp2.logits(ids, mask) - ref_logits)[mask.bool()].abs().max()
        res = tp2.generate(ids, mask, 40)
        schedule = requests(tokenizer)[:6]
        _, out, _ = run(tp2, schedule, budget=16)
    assert diff <= TOL
    assert torch.equal(res.tokens, ref.tokens)
    assert res.kv_cache_bytes == 2 * 2 * 3 * 79 * 1 * 16 * 4  # one KV head per rank
    for _, request in schedule:
        assert out[request.id] == alone(hf, request), f"request {request.id}"
    for rank, s in enumerate(shards):  # half the query heads (2 of 4) and half the KV heads (1 of 2) each
        assert s["attn_qkvw"] == (64, (2 + 1 + 1) * 16) and s["attn_ow"] == (32, 64)
        assert s["inter_w"] == (64, 128) and s["output_w"] == (128, 64)
        assert torch.equal(s["qkv_cols"], ref_qkv[:, qkv_rows(hf.config, rank, 2)])
        assert torch.equal(s["kv_cols"], ref_qkv[:, qkv_rows(hf.config, rank, 2)[-32:]])
