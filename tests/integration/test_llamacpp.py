"""llama.cpp as a peer backend: converted by its own converter from our checkpoint, it reproduces HF fp32
(logits to GGML's GELU approximation, greedy tokens on a left-padded batch decoded as one batch); q8_0
runs; MHA is refused before any work; without `make peers` the bench lists it as skipped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from plugins.core.config import ConfigError
from plugins.engine.registry import load_backend

REPO = Path(__file__).resolve().parents[2]
# ggml's GELU (a table in f16 on CPU) moves fp32 logits by ~2e-4 on the tiny model
F32_LOGIT_BOUND = 2e-3


@pytest.fixture(scope="module")
def llamacpp():
    # the module's own ImportError says why (no build, and where it was looked for)
    return pytest.importorskip("plugins.peers.llamacpp", exc_type=ImportError)


@pytest.fixture(scope="module")
def mqa_dir(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def pair(llamacpp, mqa_dir):
    return load_backend("hf", mqa_dir), load_backend("llama.cpp", mqa_dir, dtype="float32")


def test_f32_logits_and_greedy_tokens_match_hf_on_a_padded_batch(pair, padded_batch):
    hf, ll = pair
    _, ids, mask = padded_batch
    real = mask.bool()
    got_logits = ll.logits(ids, mask)
    diff = (got_logits - hf.logits(ids, mask))[real].abs().max().item()
    assert diff < F32_LOGIT_BOUND, diff
    assert not got_logits[~real].any()
    want = hf.generate(ids, mask, 24)
    got = ll.generate(ids, mask, 24)
    assert torch.equal(got.tokens, want.tokens)
    assert len(got.step_s) == 23 and got.prefill_s > 0 and all(s >= 0 for s in got.step_s)
    # the row alone decodes as in the batch: sequences do not see each other's cache
    alone = ll.generate(ids[1:2, -int(mask[1].sum()):], mask[1:2, -int(mask[1].sum()):], 24)
    assert torch.equal(alone.tokens[0, -24:], got.tokens[1, -24:])


def test_converted_once_beside_the_checkpoint(llamacpp, pair, mqa_dir):
    model = llamacpp.converted_file(mqa_dir, "f32")
    assert model.parent.parent == mqa_dir.parent
    stamp = model.stat().st_mtime_ns
    load_backend("llama.cpp", mqa_dir, dtype="float32").close()
    assert model.stat().st_mtime_ns == stamp


def test_q8_0_runs_and_sampling_is_refused(mqa_dir, padded_batch, pair):
    _, ids, mask = padded_batch
    ll = load_backend("llama.cpp", mqa_dir, weights="q8_0")
    greedy = ll.generate(ids, mask, 8)
    assert greedy.tokens.shape == (ids.shape[0], ids.shape[1] + 8)
    assert torch.equal(greedy.tokens[:, :ids.shape[1]], ids)
    # q8_0 weights move the logits by quantization error only
    assert (ll.logits(ids, mask) - pair[0].logits(ids, mask))[mask.bool()].abs().max() < 0.05
    with pytest.raises(ConfigError, match="greedily only"):
        ll.generate(ids, mask, 8, do_sample=True, seed=5)
    ll.close()


def test_mha_and_unknown_weights_are_refused_before_any_work(llamacpp, ckpt_factory):
    with pytest.raises(ConfigError, match="multi-query attention only"):
        load_backend("llama.cpp", ckpt_factory("tiny-mha"))
    with pytest.raises(ConfigError, match="unknown weights"):
        load_backend("llama.cpp", ckpt_factory("tiny"), weights="q3")
    assert not llamacpp.converted_file(ckpt_factory("tiny-mha"), "f32").parent.exists()


def test_without_the_build_the_bench_skips_it(tmp_path):
    cfg = {"models": ["tiny"], "dtype": "float32", "backends": ["hf", "llama.cpp"], "batch_sizes": [1],
           "prompt_lengths": [6], "new_tokens": 2, "warmup": 0, "cycles": 1, "logit_batch": 1,
           "checkpoint_dir": str(tmp_path / "ckpt")}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PLUGINS_LLAMACPP_DIR": str(tmp_path / "empty")}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare.py"), str(tmp_path / "bench.yaml"),
                           "--out", str(tmp_path / "out"), "--no-progress"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["backend"] for s in result["skipped"]] == ["llama.cpp"]
    assert "run `make peers`" in result["skipped"][0]["reason"]
    assert {r["backend"] for r in result["rows"]} == {"hf"}
