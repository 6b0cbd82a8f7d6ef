"""[compare]: the roofline math against hand-computed numbers, strict bench configs, and one tiny grid
run end to end through scripts/compare.py with every backend that is present."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from plugins import roofline
from plugins.backend import BACKENDS
from plugins.bench import load_bench_config, parse_bench_config
from plugins.checkpoint import init_model
from plugins.config import REPO_ROOT, ConfigError, load_model_config
from plugins.roofline import Hardware, Shape

TINY = Shape.from_config(load_model_config("tiny"))          # 2 layers, 64 wide, 4 heads of 16, 1 KV head
TINY_MHA = Shape.from_config(load_model_config("tiny-mha"))
HW = Hardware("unit", mem_bw=1e9, peak_flops=1e12, mem_bytes=1e9, link_bw=1e8)


# --- roofline math ------------------------------------------------------------------------------

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


# --- bench configs ------------------------------------------------------------------------------

BASE = {"models": ["tiny"], "backends": ["hf"], "batch_sizes": [1], "prompt_lengths": [8], "new_tokens": 4}


@pytest.mark.parametrize("change, message", [
    ({"batch_size": [1]}, "unknown key.*batch_size"),
    ({"backends": ["hf", "vllm"]}, "unknown backend 'vllm'"),
    ({"backends": ["hf", {"name": "megatron", "tp": 2}]}, "unknown key.*tp"),
    ({"backends": ["megatron"]}, "must include 'hf'"),
    ({"backends": ["hf", {"name": "megatron", "tp_size": 3}]}, "does not divide n_head"),
    ({"backends": ["hf", "megatron", "megatron"]}, "duplicate backend label"),
    ({"models": [{"config": "tiny", "overides": {}}]}, "unknown key.*overides"),
    ({"models": [{"config": "tiny", "overrides": {"n_heads": 2}}]}, "unknown key.*n_heads"),
    ({"models": ["nope"]}, "unknown model config"),
    ({"prompt_lengths": [254]}, "exceeds n_positions"),
    ({"new_tokens": 1}, "new_tokens must be >= 2"),
    ({"batch_sizes": [0]}, "batch_sizes must be a positive"),
    ({"dtype": "float16"}, "float16 is not supported on CPU"),
    ({"project": ["tpu-v4"]}, "unknown hardware"),
    ({"project": "h100-80gb", "project_models": [3]}, "project_models must be a name"),
])
def test_bench_config_is_strict(change, message):
    if "float16" in message and __import__("torch").cuda.is_available():
        pytest.skip("float16 is valid on CUDA")
    with pytest.raises(ConfigError, match=message):
        parse_bench_config({**BASE, **change})


def test_shipped_bench_configs_parse():
    default = load_bench_config("default")
    assert {b.name for b in default.backends} == set(BACKENDS)
    assert {m.label for m in default.models} == {"small", "small-mha"}
    assert any(b.tp_size == 2 for b in default.backends)
    sc = load_bench_config("santacoder-1b")
    assert {m.config for m in sc.models} == {"santacoder-1b", "santacoder-1b-mha"} and sc.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="unknown bench config"):
        load_bench_config("nope")
    assert parse_bench_config({**BASE, "project": "h200"}).project == ("h200",)


def test_bad_config_fails_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "checkpoint_dir": str(tmp_path / "ckpt"), "cycels": 2}))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "compare.py"), str(bad), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key(s) cycels" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


# --- one tiny grid, end to end ------------------------------------------------------------------

def _module(name):
    return BACKENDS[name].split(":")[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    backends = ["hf", "deepspeed", {"name": "deepspeed-autotp", "tp_size": 2}, "megatron",
                {"name": "megatron", "tp_size": 2},
                {"name": "hf", "tp_size": 2, "label": "hf-tp2"}]  # HF refuses TP: a recorded load failure
    cfg = {"models": ["tiny", "tiny-mha"], "dtype": "float32", "backends": backends, "batch_sizes": [1, 3],
           "prompt_lengths": [6, 12], "new_tokens": 4, "warmup": 0, "cycles": 2, "logit_batch": 2,
           "checkpoint_dir": str(tmp / "ckpt"), "project": ["h100-80gb"], "project_models": ["tiny"],
           "project_context": 64}
    (tmp / "bench.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "out"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "compare.py"), str(tmp / "bench.yaml"),
                           "--out", str(out), "--no-progress"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_every_row_is_sane(run):
    _, result = run
    skipped = {s["backend"] for s in result["skipped"]}
    for s in result["skipped"]:  # only a backend whose plugin is not there (yet) may be skipped
        assert s["reason"].startswith((f"ModuleNotFoundError: No module named '{_module(s['backend_name'])}'",
                                       f"AttributeError: module '{_module(s['backend_name'])}' has no attribute")), s
    assert "hf" not in skipped
    rows = [r for r in result["rows"] if r["backend"] != "hf-tp2"]
    ran = {r["backend"] for r in rows}
    assert ran | skipped == {"hf", "deepspeed", "deepspeed-autotp tp2", "megatron", "megatron tp2"}
    assert len(rows) == len(ran) * 2 * 2 * 2  # backends x models x batches x prompt lengths
    for r in rows:
        where = (r["model"], r["backend"], r["batch"], r["prompt_len"])
        assert r["error"] is None, (where, r["error"])
        for key in ("load_s", "prefill_ms", "decode_ms_median", "decode_ms_p90", "tokens_per_s", "tokenize_ms",
                    "detokenize_ms", "peak_mem_bytes", "mem_ms", "compute_ms", "predicted_decode_ms",
                    "predicted_prefill_ms", "measured_over_predicted", "mbu_pct", "mfu_pct", "prefill_mfu_pct",
                    "weight_bytes_per_rank", "decode_bytes", "decode_flops", "read_bw"):
            assert r[key] > 0, (where, key, r[key])
        assert r["decode_ms_p90"] >= r["decode_ms_median"]
        assert r["token_agreement_pct"] == 100.0, where
        assert r["max_logit_diff"] <= 1e-5, where
        assert r["kv_bytes"] == r["kv_bytes_theory"] > 0, where
        assert r["attention"] == ("MHA" if r["model"] == "tiny-mha" else "MQA")
    failed = [r for r in result["rows"] if r["backend"] == "hf-tp2"]
    assert len(failed) == 8 and all(r["error"].startswith("load failed: ConfigError") for r in failed)


def test_environment_and_reports(run):
    out, result = run
    machine, env = result["machine"], result["environment"]
    assert machine["mem_bw"] > 0 and machine["peak_flops"] > 0 and machine["mem_bytes"] > 0
    assert env["versions"]["torch"] and env["torch_threads"] >= 1 and env["cpu"]
    assert env["cpu_kernels"]["rung"] in ("avx512", "onednn", "avx2", "torch")
    assert all(r["linear_paths"] == {"decode": "torch", "prefill": "torch"} for r in result["rows"] if not r["error"])
    assert result["prediction"]["min"] > 0
    assert {p["attention"] for p in result["projection"]} == {"MQA", "MHA"}
    md = (out / "results.md").read_text()
    for text in ("## Speed and memory", "## Correctness", "## MQA vs MHA", "Projection: tiny on h100-80gb",
                 "## Failures", "hf-tp2"):
        assert text in md
    for r in result["rows"]:
        if r["error"] is None:
            assert f"| {r['backend']} |" in md
    assert result["plots"] == ["decode_vs_batch.png", "latency_vs_context.png", "mqa_vs_mha.png", "memory.png"]
    for name in result["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
