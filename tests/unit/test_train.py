"""Training (plugins.train) on a tiny config: loss goes down, resume is bit-exact, the split holds out
whole files, the checkpoint loads as a backend, perplexity is exp(mean NLL) of HF's own logits."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from plugins.core.checkpoint import WEIGHTS_NAME, load_hf_model
from plugins.core.config import ConfigError, load_model_config, load_train_spec
from plugins.core.tokenizer import checkpoint_tokenizer, load_tokenizer, tokenizer_file
from plugins.engine.registry import load_backend
from plugins.train import data, perplexity, train
from plugins.train.cache import ensure_trained, is_trained
from plugins.train.loop import LOG_FILE, PLOT_FILE

# trained with the small tokenizer, like the code-* models
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 8192, "n_positions": 32, "multi_query": True,
        "tokenizer": "code-8k"}
TRAIN = {"steps": 12, "seq_len": 32, "batch": 4, "lr": 3.0e-3, "warmup": 2, "seed": 1, "checkpoint_every": 4,
         "eval_windows": 4}


def write_config(path, **train):
    path.write_text(yaml.safe_dump({**TINY, "train": {**TRAIN, **train}}))
    return path


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("cfg") / "tiny-train.yaml")


@pytest.fixture(scope="module")
def trained(tiny_yaml, tmp_path_factory):
    """One uninterrupted run: (checkpoint dir, its log)."""
    dst = tmp_path_factory.mktemp("run") / "tiny-train-trained"  # where the bench looks for it
    log = train(load_model_config(tiny_yaml), load_train_spec(tiny_yaml), dst, name="tiny", progress=False,
                tokenizer="code-8k")
    return dst, log


@pytest.fixture(scope="module")
def tok8k():
    return load_tokenizer("code-8k")


def test_loss_goes_down_and_the_run_is_logged(trained):
    dst, log = trained
    assert len(log["loss"]) == TRAIN["steps"] and log["tokens_seen"] == 12 * 4 * 32
    assert sum(log["loss"][-3:]) / 3 < sum(log["loss"][:3]) / 3 - 0.5
    assert log["heldout_loss"] < log["heldout"][0][1] or len(log["heldout"]) == 1
    assert log["unigram_heldout_nats"] > 0 and math.isfinite(log["heldout_loss"])
    assert json.loads((dst / LOG_FILE).read_text())["loss"] == log["loss"]
    assert (dst / PLOT_FILE).stat().st_size > 1000
    assert not dst.with_name(dst.name + ".state").exists()  # removed once the checkpoint is written


def test_the_checkpoint_carries_its_tokenizer(trained, tok8k):
    dst, log = trained
    assert (dst / "tokenizer.json").read_bytes() == tokenizer_file("code-8k").read_bytes()
    tok, path = checkpoint_tokenizer(dst)
    assert path == dst / "tokenizer.json" and tok.get_vocab_size() == 8192 and log["tokenizer"]["name"] == "code-8k"
    stream = data.token_stream("heldout", tok8k)
    assert int(stream.max()) < 8192 and len(stream) > len(data.token_stream("heldout"))  # fewer merges, more tokens


def test_resume_gives_the_same_weights(trained, tiny_yaml, tmp_path):
    config, spec = load_model_config(tiny_yaml), load_train_spec(tiny_yaml)
    dst, state = tmp_path / "resumed", tmp_path / "state"
    assert train(config, spec, dst, state_dir=state, progress=False, stop_at=4,
                 tokenizer="code-8k") is None  # "interrupted" at step 4
    assert (state / "optimizer.safetensors").is_file() and not dst.exists()
    assert not list(state.glob("*.pt")) and not list(state.glob("*.bin"))  # no pickle anywhere
    log = train(config, spec, dst, state_dir=state, progress=False, tokenizer="code-8k")
    assert (dst / WEIGHTS_NAME).read_bytes() == (trained[0] / WEIGHTS_NAME).read_bytes()
    assert log["loss"] == trained[1]["loss"]


def test_heldout_split_is_whole_files_and_disjoint():
    train_files, held = data.split_files()
    assert held and not set(train_files) & set(held)
    assert 0.01 < len(held) / (len(held) + len(train_files)) < 0.06
    assert all(data.is_heldout(data.relative_name(f)) for f in held)
    windows = data.heldout_windows(3, 16)
    assert windows.shape == (3, 16) and torch.equal(windows, data.heldout_windows(3, 16))


def test_checkpoint_loads_as_a_backend(trained, tok8k):
    backend = load_backend("hf", trained[0])
    ids = data.heldout_windows(1, 8, tok8k)
    assert torch.isfinite(backend.logits(ids, torch.ones_like(ids))).all()
    assert backend.generate(ids, torch.ones_like(ids), 4).tokens.shape == (1, 12)


def test_perplexity_is_exp_mean_nll_of_hf_logits(trained, tok8k):
    backend = load_backend("hf", trained[0])
    with pytest.raises(ValueError, match="49152 tokens but the model's vocab_size is 8192"):
        perplexity(backend, windows=3, length=24)  # the project's tokenizer does not fit this model
    got = perplexity(backend, windows=3, length=24, chunk=2, tok=tok8k)
    ids = data.heldout_windows(3, 24, tok8k)
    with torch.no_grad():
        logits = load_hf_model(trained[0])(input_ids=ids).logits
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert got["heldout_tokens"] == 3 * 23
    assert got["heldout_ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)


def test_trained_checkpoints_are_made_once(trained, tiny_yaml):
    config, spec = load_model_config(tiny_yaml), load_train_spec(tiny_yaml)
    assert is_trained(trained[0], config, spec, "code-8k")
    assert not is_trained(trained[0], config, spec, "code-49k")  # another tokenizer: trained again
    mtime = (trained[0] / WEIGHTS_NAME).stat().st_mtime_ns
    assert ensure_trained(tiny_yaml, trained[0], progress=False) == trained[0]
    assert (trained[0] / WEIGHTS_NAME).stat().st_mtime_ns == mtime


def test_tokenizer_keys_are_checked(tmp_path):
    from plugins.core.config import load_tokenizer_name

    assert load_tokenizer_name("tiny") == "code-49k" and load_tokenizer_name("code-mqa") == "code-8k"
    assert all(load_model_config(m).vocab_size == 8192 for m in ("code-mqa", "code-mha", "code-draft"))
    for bad, message in (({"tokenizer": "gpt2"}, "unknown tokenizer"),
                         ({"tokenizer": "code-49k"}, "49152 tokens but vocab_size is 8192")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**TINY, **bad}))
        with pytest.raises(ConfigError, match=message):
            load_model_config(path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    (ckpt / "tokenizer.json").write_bytes(tokenizer_file("code-8k").read_bytes())
    with pytest.raises(ValueError, match="8192 tokens but the model's vocab_size is 1000"):
        checkpoint_tokenizer(ckpt)


def test_train_sections_are_checked(tmp_path):
    assert load_train_spec("tiny") is None
    assert load_train_spec("code-mqa").seq_len == load_model_config("code-mqa").n_positions
    assert load_model_config("code-mha").multi_query is False
    for bad, message in (({"stpes": 3}, "unknown train key"), ({"lr": -1}, "lr must be"),
                         ({"seq_len": 512}, "exceeds n_positions"),
                         ({"seq_len": 16}, "position embeddings past it"), ({"precision": "fp16"}, "precision")):
        with pytest.raises(ConfigError, match=message):
            load_train_spec(write_config(tmp_path / "bad.yaml", **bad))


def test_bench_rows_carry_quality(trained, tiny_yaml):
    """Per-backend dtype, the fp32 HF row as reference, held-out perplexity per row, a draft named by
    its model config resolved to its (cached) trained checkpoint, acceptance in the quality table."""
    from plugins.bench import report, roofline
    from plugins.bench.config import parse_bench_config
    from plugins.bench.grid import run_grid

    cfg = parse_bench_config({
        "models": [str(tiny_yaml)], "dtype": "float32", "batch_sizes": [2], "prompt_lengths": [8],
        "new_tokens": 6, "warmup": 0, "cycles": 1, "checkpoint_dir": str(trained[0].parent),
        "perplexity": {"windows": 2, "length": 16},
        "backends": [{"name": "hf", "label": "hf bf16", "dtype": "bfloat16"}, {"name": "hf", "label": "hf fp32"},
                     {"name": "deepspeed", "label": "spec",
                      "options": {"speculative": {"k": 2, "draft": str(tiny_yaml)}}}]})
    machine = {"mem_bw": 1e10, "peak_flops": 1e11, "mem_bytes": 1e10, "link_bw": 1e10, "gemv_bw": 1e10,
               "gemm_dtype": "float32"}
    rows, skipped = run_grid(cfg, roofline.load_hardware("cpu-measured", machine), trained[0].parent, progress=False)
    by = {r["backend"]: r for r in rows}
    assert not skipped and all(r["error"] is None for r in rows), rows
    assert by["hf fp32"]["dtype"] == "float32" and by["hf bf16"]["dtype"] == "bfloat16"
    assert by["hf fp32"]["max_logit_diff"] == 0.0 and by["spec"]["token_agreement_pct"] == 100.0
    assert by["spec"]["heldout_ppl"] == pytest.approx(by["hf fp32"]["heldout_ppl"], rel=1e-4)
    assert by["hf bf16"]["heldout_ppl"] == pytest.approx(by["hf fp32"]["heldout_ppl"], rel=0.05)
    assert by["spec"]["stats"]["acceptance_rate"] == 1.0  # the draft is the target itself
    table = "\n".join(report.quality_markdown(rows))
    assert "| tiny-train | spec | float32 | 2 | 8 |" in table and "100.0 | " in table
