"""The roofline (plugins.bench.roofline) against hand-computed numbers, published sizes and the hardware specs."""


import pytest

from plugins.bench import roofline
from plugins.bench.roofline import Hardware, Shape
from plugins.core.checkpoint import init_model
from plugins.core.config import ConfigError, load_model_config

TINY = Shape.from_config(load_model_config("tiny"))          # 2 layers, 64 wide, 4 heads of 16, 1 KV head
TINY_MHA = Shape.from_config(load_model_config("tiny-mha"))
HW = Hardware("unit", mem_bw=1e9, peak_flops=1e12, mem_bytes=1e9, link_bw=1e8)


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_param_count_matches_the_hf_model(name):
    config = load_model_config(name)
    assert roofline.param_count(Shape.from_config(config)) == sum(p.numel() for p in init_model(config).parameters())


def test_published_sizes():
    assert round(roofline.param_count(Shape.from_config(load_model_config("starcoder-15b"))) / 1e9, 1) == 15.5
    assert round(roofline.param_count(Shape.from_config(load_model_config("santacoder-1b"))) / 1e9, 1) == 1.1


def test_weights_by_hand():
    # Q 64x64 + K/V 64x(2x16) + proj 64x64 + MLP 2x64x256 = 43008; MHA K/V is 64x128.
    assert roofline.layer_matmul_params(TINY) == 4096 + 2048 + 4096 + 32768
    assert roofline.layer_matmul_params(TINY_MHA) == 4096 + 8192 + 4096 + 32768
    # TP=2: Q, proj, MLP halve; MQA's single K/V head stays whole on each rank, MHA's splits.
    assert roofline.layer_matmul_params(TINY, tp=2) == 2048 + 2048 + 2048 + 16384
    assert roofline.layer_matmul_params(TINY_MHA, tp=2) == 2048 + 4096 + 2048 + 16384
    # A decode step reads every weight but the position table (256 x 64).
    assert roofline.decode_weight_bytes(TINY, 2) == (3249728 - 256 * 64) * 2


def test_kv_bytes_by_hand():
    # 2 (K,V) x 2 layers x B 3 x S 10 x heads x 16 x 4 bytes
    assert roofline.kv_bytes(TINY, 3, 10, 4) == 2 * 2 * 3 * 10 * 1 * 16 * 4 == 7680
    assert roofline.kv_bytes(TINY_MHA, 3, 10, 4) == 4 * 7680
    assert roofline.kv_bytes(TINY_MHA, 3, 10, 4, tp=2) == 2 * 7680          # heads split
    assert roofline.kv_bytes(TINY, 3, 10, 4, tp=2) == 7680                  # MQA head replicated
    assert roofline.kv_bytes(TINY, 3, 10, 4, tp=2, layout="batch") == 2 * 2 * 2 * 10 * 16 * 4  # ceil(3/2) seqs
    assert roofline.kv_bytes(TINY, 4, 10, 4, tp=2, layout="batch") == 7680 * 4 // 3 // 2
    with pytest.raises(ConfigError, match="unknown KV layout"):
        roofline.kv_bytes(TINY, 1, 1, 4, layout="rows")


def test_flops_by_hand():
    matmul = 2 * 43008 + 49152 * 64        # layers + lm_head
    # decode, B=1, 10 keys: 2 x matmul + 4 x layers x width x keys
    assert roofline.decode_flops(TINY, 1, 10) == 2 * matmul + 4 * 2 * 64 * 10 == 6468608
    assert roofline.decode_flops(TINY, 3, 10) == 3 * 2 * matmul + 3 * 4 * 2 * 64 * 10
    # prefill, B=1, T=4: layers on every position, lm_head on the last, 10 causal (query, key) pairs
    assert roofline.prefill_flops(TINY, 1, 4) == 2 * 4 * 2 * 43008 + 2 * 49152 * 64 + 4 * 2 * 64 * 10


def test_estimates_by_hand():
    est = roofline.decode_estimate(TINY, HW, 1, 10, 4)
    nbytes = roofline.decode_weight_bytes(TINY, 4) + roofline.kv_bytes(TINY, 1, 10, 4)
    assert est.bytes == nbytes and est.memory_s == pytest.approx(nbytes / 1e9)
    assert est.compute_s == pytest.approx(6468608 / 1e12) and est.comm_s == 0
    assert est.bound == "memory" and est.total_s == est.memory_s
    assert est.mbu(2 * est.total_s, HW) == pytest.approx(0.5)
    assert est.mfu(est.compute_s, HW) == pytest.approx(1.0)
    # TP=2: two ring all-reduces per layer of B x E x bytes, each moving 2(N-1)/N of it.
    assert roofline.comm_seconds(TINY, 1, 4, 2, 1e8) == pytest.approx(2 * 2 * 2 * 0.5 * 256 / 1e8)
    assert roofline.comm_seconds(TINY, 1, 4, 2, 1e8, "batch") == pytest.approx(
        1.024e-5 + 2 * 2 * 0.5 * 256 / 2 / 1e8)
    # A batch big enough to be compute-bound.
    assert roofline.decode_estimate(TINY, HW, 4096, 10, 4).bound == "compute"


def test_starcoder_on_h100_is_weight_bound_at_batch_1():
    s = Shape.from_config(load_model_config("starcoder-15b"))
    h100 = roofline.load_hardware("h100-80gb")
    est = roofline.decode_estimate(s, h100, 1, 2048, 2)
    assert est.bound == "memory"
    assert est.total_s == pytest.approx(roofline.decode_weight_bytes(s, 2) / 3.35e12, rel=0.01)  # ~9.2 ms
    assert 9.0e-3 < est.total_s < 9.5e-3


def test_capacity_by_hand():
    w = roofline.weight_bytes(TINY, 4)
    per_seq = roofline.kv_bytes(TINY, 1, 100, 4)
    hw = Hardware("fit", 1e9, 1e12, w + 10.5 * per_seq, 1e9)
    assert roofline.max_batch(TINY, hw, 100, 4) == 10
    assert roofline.max_kv_tokens(TINY, hw, 4) == 1050
    # Batch-sharded KV under TP=2: each rank has more room (half the weights) and holds half the batch.
    w2 = roofline.weight_bytes(TINY, 4, tp=2)
    hw2 = Hardware("fit2", 1e9, 1e12, w2 + 10.5 * per_seq, 1e9)
    assert roofline.max_batch(TINY, hw2, 100, 4, tp=2) == 10
    assert roofline.max_batch(TINY, hw2, 100, 4, tp=2, layout="batch") == 20
    assert roofline.max_batch(TINY, Hardware("small", 1e9, 1e12, w / 2, 1e9), 100, 4) == 0


def test_projection_rows():
    rows = roofline.project(["tiny"], HW, context=16, batches=[1, 2], dtype_bytes=4)
    layouts = [(r["attention"], r["tp"], r["kv_layout"]) for r in rows]
    assert layouts == [("MQA", 1, "head"), ("MQA", 2, "head"), ("MQA", 2, "batch"), ("MQA", 4, "head"),
                       ("MQA", 4, "batch"), ("MHA", 1, "head"), ("MHA", 2, "head"), ("MHA", 4, "head")]
    mqa4 = {r["kv_layout"]: r for r in rows if r["attention"] == "MQA" and r["tp"] == 4}
    assert mqa4["batch"]["decode"][2]["kv_bytes_per_rank"] * 2 == mqa4["head"]["decode"][2]["kv_bytes_per_rank"]


def test_hardware_specs():
    for name in ("a100-80gb", "h100-80gb", "h200"):
        hw = roofline.load_hardware(name)
        assert hw.mem_bw > 1e12 and hw.peak_flops > 1e14 and hw.mem_bytes >= 80e9 and hw.link_bw > 1e11
    with pytest.raises(ConfigError, match="measured on this machine"):
        roofline.load_hardware("cpu-measured")
    cpu = roofline.load_hardware("cpu-measured", {"mem_bw": 2e10, "peak_flops": 1e11, "mem_bytes": 2e10,
                                                  "link_bw": 2e10})
    assert cpu.split(2).mem_bw == 1e10
    with pytest.raises(ConfigError, match="unknown hardware"):
        roofline.load_hardware("tpu-v4")
