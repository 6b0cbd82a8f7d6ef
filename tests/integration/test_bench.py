"""The comparison (plugins.bench, scripts/compare.py): strict bench configs, and one tiny grid end to end
whose every row is checked against HF."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from plugins import kernels
from plugins.bench.config import load_bench_config, parse_bench_config
from plugins.core.config import REPO_ROOT, ConfigError
from plugins.engine.registry import BACKENDS

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
    ({"new_tokens": [3, 7]}, "new_tokens must be one integer"),
    ({"models": ["tiny-mha"],
      "backends": ["hf", {"name": "deepspeed", "tp_size": 2, "options": {"kv_layout": "batch"}}]},
     "model tiny-mha, backend deepspeed tp2: kv_layout='batch' is for multi-query attention"),
    ({"backends": ["hf", {"name": "deepspeed", "options": {"quantize": "int2"}}]}, "quantize must be"),
    ({"workload": "chat"}, "workload must be one of code, edit"),
    ({"backends": ["hf", {"name": "hf", "label": "hf2", "options": {"colour": 1}}]}, "unknown option.* colour"),
    ({"models": [{"config": "tiny", "label": "../../victim"}]}, "model label '../../victim' is not a plain name"),
    ({"models": [{"config": "tiny", "label": ".."}]}, "not a plain name"),
    ({"backends": ["hf", {"name": "megatron", "label": "a/b"}]}, "backend label 'a/b' is not a plain name"),
])
def test_bench_config_is_strict(change, message):
    if "float16" in message and __import__("torch").cuda.is_available():
        pytest.skip("float16 is valid on CUDA")
    with pytest.raises(ConfigError, match=message):
        parse_bench_config({**BASE, **change})


def test_shipped_bench_configs_parse():
    default = load_bench_config("default")
    ours = {name for name, where in BACKENDS.items() if not where.startswith("plugins.peers.")}
    assert {b.name for b in default.backends} == ours  # peers (MQA-only converters) have configs/bench/peers.yaml
    peers = load_bench_config("peers")
    assert {b.name for b in peers.backends} >= set(BACKENDS) - ours | {"hf", "deepspeed"}
    assert {m.label for m in default.models} == {"small", "small-mha"}
    assert any(b.tp_size == 2 for b in default.backends)
    sc = load_bench_config("santacoder-1b")
    assert {m.config for m in sc.models} == {"santacoder-1b", "santacoder-1b-mha"} and sc.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="unknown bench config 'nope'; known: "):
        load_bench_config("nope")
    with pytest.raises(ConfigError, match="bench config file 'my.yaml' not found"):
        load_bench_config("my.yaml")
    assert parse_bench_config({**BASE, "project": "h200"}).project == ("h200",)
    for name in ("speed", "lookup"):
        assert any("speculative" in b.options for b in load_bench_config(name).backends)
    assert load_bench_config("lookup").workload == "edit"


def test_bad_config_fails_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "checkpoint_dir": str(tmp_path / "ckpt"), "cycels": 2}))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "compare.py"), str(bad), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key(s) cycels" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()

def test_a_run_where_every_row_fails_exits_nonzero(tmp_path, monkeypatch):
    """compare.py's own decision, on the rows a run where nothing worked returns (every load failed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_script", REPO_ROOT / "scripts" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    cfg = {**BASE, "checkpoint_dir": str(tmp_path / "ckpt"), "warmup": 0, "cycles": 1}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(cfg))
    machine = {"mem_bw": 1e10, "peak_flops": 1e11, "mem_bytes": 1e10, "link_bw": 1e10, "gemv_bw": 1e10,
               "gemm_dtype": "float32"}
    from plugins.bench import grid, probes

    monkeypatch.setattr(probes, "measure_machine", lambda dtype: machine)
    failed = [{"model": "tiny", "attention": "MQA", "backend": "hf", "backend_name": "hf", "tp_size": 1, "batch": 1,
               "prompt_len": 8, "options": {}, "dtype": "float32", "new_tokens": 4, "error": "load failed: boom"}]
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: (failed, []))
    assert compare.main([str(tmp_path / "b.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: ([], []))
    assert compare.main([str(tmp_path / "b.yaml"), "--out", str(tmp_path / "out2"), "--no-progress"]) == 0


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
    assert env["cpu_kernels"]["rung"] in kernels.RUNGS
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
