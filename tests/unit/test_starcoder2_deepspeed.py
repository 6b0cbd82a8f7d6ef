"""StarCoder2 under DeepSpeed's kernel injection (injection/starcoder2.py): `injection.register()` plugs a
policy for `Starcoder2DecoderLayer`, so `deepspeed.init_inference(..., replace_with_kernel_inject=True)`
injects it: fused GQA projection on a preallocated cache of the KV heads, RoPE in the injected layer, the
sliding window honoured (tiny-starcoder2: window 16, sequences to 80 tokens). fp32 parity with
Starcoder2ForCausalLM (TP 2 and 4, and AutoTP at TP 2: tests/integration/test_starcoder2_tp.py)."""

import deepspeed
import pytest
import torch
from batch_driver import alone, requests, run

import injection
from injection.kv_shard import KVLayoutError
from injection.starcoder2 import DeepSpeedStarcoder2Inference
from injection.tp import qkv_rows
from plugins.core.checkpoint import load_hf_model
from plugins.core.config import ConfigError, load_model_config
from plugins.core.tensors import position_ids
from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.kv_cache import SingleHeadCache
from plugins.engine.registry import load_backend
from plugins.serving.request import Request

TOL = 1e-5


@pytest.fixture(scope="module")
def hf(sc2):
    return load_backend("hf", sc2, dtype="float32")


def test_init_inference_injects_starcoder2(sc2, window_batch):
    ids, mask = window_batch
    ref = load_hf_model(sc2)
    injection.register()
    model = load_hf_model(sc2)
    engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    layers = engine.module.model.layers
    assert all(type(layer) is DeepSpeedStarcoder2Inference for layer in layers)
    assert layers[0].kv_heads == 2 and layers[0].attention.attn_qkvw.shape == (64, (4 + 2 * 2) * 16)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        got = engine.module(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert (got - want)[mask.bool()].abs().max() <= TOL
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **kw)
    assert torch.equal(engine.module.generate(ids, **kw), expected)  # HF's default cache, taken over
    cache = SingleHeadCache(model.config, 80, batch=3, dtype=torch.float32)
    assert torch.equal(engine.module.generate(ids, cache=cache, **kw), expected)
    assert cache.nbytes() == 2 * 2 * 3 * 80 * 2 * 16 * 4  # K and V x layers x batch x tokens x 2 KV heads x d


def test_backend_matches_hf_past_the_window(sc2, hf, window_batch):
    ids, mask = window_batch
    ds = load_backend("deepspeed", sc2, dtype="float32")
    assert (ds.logits(ids, mask) - hf.logits(ids, mask))[mask.bool()].abs().max() <= TOL
    ours = ds.generate(ids, mask, 40)
    assert torch.equal(ours.tokens, hf.generate(ids, mask, 40).tokens)
    for i in range(3):  # alone, unpadded: the fast step's mask-free path applies the window itself
        one = ids[i:i + 1, mask[i].bool()]
        assert torch.equal(ds.generate(one, torch.ones_like(one), 40).tokens[0, -40:], ours.tokens[i, -40:])


def test_continuous_batching_and_chunks_in_one_forward(sc2, hf, tokenizer):
    ds = load_backend("deepspeed", sc2, dtype="float32")
    schedule = requests(tokenizer)
    head = schedule[6][1].prompt
    schedule.append((13, Request(id=200, prompt=head[:35] + prompt_token_ids(tokenizer, 5, 50), max_tokens=7)))
    steps = []
    _, out, _ = run(ds, schedule, budget=12, prefix_cache_bytes=1 << 20, steps=steps)
    for _, request in schedule:
        assert out[request.id] == alone(hf, request), f"request {request.id}"
    assert any("mixed" in phases for _, _, phases, _ in steps)  # decode rows and prompt chunks in one forward


def test_prompt_lookup_speculation_with_holes_in_the_pool(sc2, hf, tokenizer, monkeypatch):
    """Rejected proposals leave masked columns inside rows: the window counts positions, not columns."""
    monkeypatch.setenv("PLUGINS_SPECULATION", "always")
    spec = load_backend("deepspeed", sc2, dtype="float32", speculative={"draft": "prompt-lookup", "k": 4})
    snippet = prompt_token_ids(tokenizer, 10, 60)
    edit = torch.tensor([snippet * 3 + snippet[:4]])
    result = spec.generate(edit, torch.ones_like(edit), 30)
    assert torch.equal(result.tokens, hf.generate(edit, torch.ones_like(edit), 30).tokens)
    assert result.stats["acceptance_rate"] > 0
    schedule = requests(tokenizer) + [(4, Request(id=300, prompt=edit[0].tolist(), max_tokens=20))]
    steps = []
    _, out, _ = run(spec, schedule, steps=steps)
    for _, request in schedule:
        assert out[request.id] == alone(hf, request), f"request {request.id}"
    assert steps[-1][3]["accepted"] > 0


def test_tp_shards_hold_their_query_and_kv_heads():
    config = load_model_config("tiny-starcoder2")  # fused rows: Q 0-63, K 64-95, V 96-127 (2 heads of 16)
    rank1 = qkv_rows(config, 1, 2)  # KV heads split: head 1 of K and V
    assert rank1.tolist() == list(range(32, 64)) + list(range(80, 96)) + list(range(112, 128))
    rank1 = qkv_rows(config, 1, 4)  # 4 ranks, 2 KV heads: rank 1's query head is in group 0, replicated
    assert rank1.tolist() == list(range(16, 32)) + list(range(64, 80)) + list(range(96, 112))


def test_what_starcoder2_cannot_take_is_refused(sc2):
    with pytest.raises(KVLayoutError, match="multi-query"):
        load_backend("deepspeed", sc2, tp_size=2, kv_layout="batch")
    # AutoTP at TP 4 on 2 KV heads would give ranks 2 and 3 no head (below): refused before any rank starts
    with pytest.raises(ConfigError, match="tp_size 4 does not divide them"):
        load_backend("deepspeed-autotp", sc2, tp_size=4)


def test_upstream_autotp_shards_starcoder2_by_its_kv_heads(sc2):
    """What injection.autotp relies on for StarCoder2 (no patch); fails if upstream changes it: the KV-head
    count is the grain, so q / k / v_proj rows and o_proj columns split in whole heads, the MLP evenly, and
    o_proj and mlp.c_proj are the all-reduced linears (TP 2 parity: tests/integration/test_starcoder2_tp.py)."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
    from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2DecoderLayer

    model = load_hf_model(sc2)
    meta = AutoTPMeta.from_model_config(model.config)
    assert meta.num_kv_heads == 2
    assert get_shard_size_list(64, 2, meta, name="model.layers.0.self_attn.q_proj") == [32, 32]  # 2 of 4 heads
    assert get_shard_size_list(32, 2, meta, name="model.layers.0.self_attn.k_proj") == [16, 16]  # 1 of 2
    assert get_shard_size_list(256, 2, meta, name="model.layers.0.mlp.c_fc") == [128, 128]
    assert get_shard_size_list(64, 4, meta, name="model.layers.0.self_attn.q_proj") == [32, 32, 0, 0]
    [(layer, allreduce)] = AutoTP.tp_parser(model)
    assert layer is Starcoder2DecoderLayer and set(allreduce) == {"self_attn.o_proj", "mlp.c_proj"}
