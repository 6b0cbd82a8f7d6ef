"""CTranslate2 as a peer backend: converted by its own converter from our checkpoint, it reproduces HF
fp32 (logits, greedy tokens on a left-padded batch); int8 runs; MHA is refused before any work."""

import pytest
import torch

from plugins.core.config import ConfigError
from plugins.engine.registry import load_backend
from plugins.peers.ctranslate2 import converted_dir

pytest.importorskip("ctranslate2")


@pytest.fixture(scope="module")
def mqa_dir(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def pair(mqa_dir):
    return load_backend("hf", mqa_dir), load_backend("ctranslate2", mqa_dir, dtype="float32")


def test_fp32_logits_and_greedy_tokens_match_hf_on_a_padded_batch(pair, padded_batch):
    hf, ct2 = pair
    _, ids, mask = padded_batch
    real = mask.bool()
    diff = (ct2.logits(ids, mask) - hf.logits(ids, mask))[real].abs().max().item()
    assert diff < 1e-5, diff
    want = hf.generate(ids, mask, 24)
    got = ct2.generate(ids, mask, 24)
    assert torch.equal(got.tokens, want.tokens)
    assert len(got.step_s) == 23 and got.prefill_s > 0 and all(s >= 0 for s in got.step_s)


def test_converted_once_beside_the_checkpoint(pair, mqa_dir):
    model = converted_dir(mqa_dir, "float32") / "model.bin"
    stamp = model.stat().st_mtime_ns
    load_backend("ctranslate2", mqa_dir, dtype="float32")
    assert model.stat().st_mtime_ns == stamp


def test_int8_runs_and_sampling_is_refused(mqa_dir, padded_batch, pair):
    _, ids, mask = padded_batch
    ct2 = load_backend("ctranslate2", mqa_dir, compute_type="int8")
    assert ct2.compute_type == "int8_float32"
    greedy = ct2.generate(ids, mask, 8)
    assert greedy.tokens.shape == (ids.shape[0], ids.shape[1] + 8)
    assert torch.equal(greedy.tokens[:, :ids.shape[1]], ids)
    # int8 moves the logits by quantization error only. CTranslate2's int8 GEMM depends on the CPU: with
    # VNNI the largest error was < 0.05, on AVX512 without VNNI 0.25 (mean 0.008, logits' std 0.16), so
    # the check is on the error's mean against the logits' spread, and their correlation.
    got, want = ct2.logits(ids, mask)[mask.bool()], pair[0].logits(ids, mask)[mask.bool()]
    assert (got - want).abs().mean() < 0.1 * want.std()
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99
    with pytest.raises(ConfigError, match="greedily only"):
        ct2.generate(ids, mask, 8, do_sample=True, seed=5)


def test_mha_and_unknown_options_are_refused_before_any_work(ckpt_factory, tmp_path):
    with pytest.raises(ConfigError, match="multi-query attention only"):
        load_backend("ctranslate2", ckpt_factory("tiny-mha"))
    with pytest.raises(ConfigError, match="compute_type"):
        load_backend("ctranslate2", ckpt_factory("tiny"), compute_type="int3")
    assert not converted_dir(ckpt_factory("tiny-mha"), "float32").exists()


def test_a_peer_killed_by_a_signal_is_one_error_row_and_the_bench_goes_on(tmp_path):
    """The peer runs in a worker process of its own: a native crash (here SIGSEGV sent to that worker
    as soon as it starts) fails that backend's rows with one clear error; the other backends run."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    import yaml

    from plugins.core.config import REPO_ROOT

    cfg = {"models": ["tiny"], "dtype": "float32", "backends": ["hf", "ctranslate2", "deepspeed"], "batch_sizes": [1],
           "prompt_lengths": [6], "new_tokens": 2, "warmup": 0, "cycles": 1, "logit_batch": 1,
           "checkpoint_dir": str(tmp_path / "ckpt")}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "compare.py"), str(tmp_path / "bench.yaml"),
                             "--out", str(tmp_path / "out"), "--no-progress"], cwd=REPO_ROOT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = None, time.monotonic() + 300
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "plugins.launch.worker" in child.cmdline():
                    child.send_signal(signal.SIGSEGV)
                    killed = child.pid
                    break
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=600)
    assert killed is not None, "the peer never started a worker process"
    assert proc.returncode == 0, out[-3000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    by_backend = {r["backend"]: r for r in rows}
    assert set(by_backend) == {"hf", "ctranslate2", "deepspeed"}
    assert "ctranslate2 died with SIGSEGV" in by_backend["ctranslate2"]["error"], by_backend["ctranslate2"]["error"]
    assert by_backend["hf"]["error"] is None and by_backend["deepspeed"]["error"] is None
    assert by_backend["deepspeed"]["token_agreement_pct"] == 100.0
