"""StarCoder2 (HF `starcoder2`: GQA, RoPE, sliding-window attention) on the HF engine: the configs of the
published shapes, seeded checkpoints that transformers loads as they are, fp32 parity with
`Starcoder2ForCausalLM` itself, and continuous batching that honours the window (tiny-starcoder2: window
16 over 256 positions, so prompts and generations run past it)."""

import json

import pytest
import torch
from batch_driver import CAPACITY, SLOTS, alone, requests, run
from transformers import Starcoder2Config, Starcoder2ForCausalLM

from plugins.core.arch import arch, hf_shapes
from plugins.core.checkpoint import load_hf_model, read_hf_config
from plugins.core.config import ConfigError, check_tp, load_model_config, load_spec
from plugins.core.tensors import kv_bytes_per_token, position_ids
from plugins.core.tokenizer import left_pad, prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.serving.request import Request

LENGTHS = (5, 40, 23)  # left padding, and two prompts longer than the window


@pytest.fixture(scope="module")
def sc2(ckpt_factory):
    return ckpt_factory("tiny-starcoder2")


@pytest.fixture(scope="module")
def reference(sc2):
    """transformers' own model, loaded by transformers from our directory."""
    return Starcoder2ForCausalLM.from_pretrained(sc2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(tokenizer):
    seqs = [prompt_token_ids(tokenizer, n, i) for i, n in enumerate(LENGTHS)]
    return (seqs, *left_pad(seqs))


def test_configs_have_the_published_shapes():
    expect = {  # bigcode/starcoder2-*/config.json
        "starcoder2-3b": (30, 3072, 24, 2, 12288, 999999.4420358813, True),
        "starcoder2-7b": (32, 4608, 36, 4, 18432, 1000000.0, True),
        "starcoder2-15b": (40, 6144, 48, 4, 24576, 100000.0, False),
    }
    for name, (layers, hidden, heads, kv, inner, theta, tied) in expect.items():
        cfg = load_model_config(name)
        assert isinstance(cfg, Starcoder2Config)
        a = arch(cfg)
        assert (a.n_layer, a.hidden, a.n_head, a.kv_heads, a.inner, a.rope_theta, a.tied) == \
            (layers, hidden, heads, kv, inner, theta, tied)
        assert (a.vocab_size, a.n_positions, a.sliding_window, a.eps, a.activation) == \
            (49152, 16384, 4096, 1e-5, "gelu_pytorch_tanh")
        assert cfg.use_bias and cfg.rope_parameters["rope_type"] == "default"
    tiny = arch(load_model_config("tiny-starcoder2"))
    assert (tiny.n_layer, tiny.hidden, tiny.n_head, tiny.kv_heads, tiny.sliding_window, tiny.n_positions) == \
        (2, 64, 4, 2, 16, 256)
    params = sum(torch.Size(s).numel() for s in hf_shapes(load_model_config("starcoder2-3b")).values())
    assert 3.0e9 < params < 3.1e9  # StarCoder2-3B: 3.03B


def test_starcoder2_configs_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="unknown key.*n_head"):
        load_model_config("tiny-starcoder2", n_head=4)
    with pytest.raises(ConfigError, match="KV heads do not divide num_attention_heads"):
        load_model_config("tiny-starcoder2", num_key_value_heads=3)
    with pytest.raises(ConfigError, match="sliding_window must be null or a positive integer"):
        load_model_config("tiny-starcoder2", sliding_window=0)
    with pytest.raises(ConfigError, match="rope_theta must be a positive number"):
        load_model_config("tiny-starcoder2", rope_theta=-1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_type: starcoder2\nnum_hidden_layers: 2\n")
    with pytest.raises(ConfigError, match="missing key"):
        load_spec(bad)
    bad.write_text("model_type: llama\n")
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_spec(bad)
    cfg = load_model_config("tiny-starcoder2")
    check_tp(cfg, 2)
    check_tp(cfg, 4)  # 2 KV heads over 4 ranks: each replicated on 2
    with pytest.raises(ConfigError, match="does not divide n_head"):
        check_tp(cfg, 3)
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(cfg, torch.float32, tp_size=2) == 2 * 2 * 1 * 16 * 4


def test_seeded_checkpoint_loads_in_transformers_bit_exact(sc2, reference):
    config = json.loads((sc2 / "config.json").read_text())
    assert config["architectures"] == ["Starcoder2ForCausalLM"] and config["model_type"] == "starcoder2"
    assert (sc2 / "tokenizer.json").is_file() and json.loads((sc2 / "tokenizer_config.json").read_text())[
        "model_max_length"] == 256
    ours = load_hf_model(sc2)
    theirs = reference.state_dict()
    assert set(ours.state_dict()) == set(theirs)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, theirs[k]), k
    assert torch.equal(ours.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert read_hf_config(sc2).sliding_window == 16


def test_hf_engine_matches_starcoder2_itself(sc2, reference, batch):
    seqs, ids, mask = batch
    backend = load_backend("hf", sc2, dtype="float32")
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    logits = backend.logits(ids, mask)
    real = mask.bool()
    assert (logits - ref)[real].abs().max() <= 1e-5
    ours = backend.generate(ids, mask, max_new_tokens=24)  # to 64 tokens: four windows
    theirs = reference.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.tokens, theirs)
    for i, seq in enumerate(seqs):
        one = torch.tensor([seq])
        assert torch.equal(backend.generate(one, torch.ones_like(one), 24).tokens[0, -24:], ours.tokens[i, -24:])
        alone_logits = backend.logits(one, torch.ones_like(one))[0]
        assert (alone_logits - logits[i, -len(seq):]).abs().max() <= 1e-5


def test_the_window_changes_the_numbers(sc2, reference, batch):
    """The tests above would pass on a model that ignores the window only if the window never mattered."""
    _, ids, mask = batch
    wide = Starcoder2ForCausalLM.from_pretrained(sc2, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        a = reference(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        b = wide(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert (a[:, :16] - b[:, :16]).abs().max() == 0  # the first 16 columns: inside the window either way
    assert (a[1, 16:] - b[1, 16:]).abs().max() > 1e-3


def test_continuous_batching_matches_generate_alone(sc2, tokenizer):
    """Requests joining and leaving a pool of 64 columns (prompts up to 40 tokens, generations to 44:
    past the window of 16 in prefill and decode), whole prompts, then chunks of 12 with a prefix-cache hit."""
    backend = load_backend("hf", sc2, dtype="float32")
    schedule = requests(tokenizer)
    state, out, finished = run(backend, schedule)
    for _, request in schedule:
        assert out[request.id] == alone(backend, request), f"request {request.id} differs from generate alone"
        assert finished[request.id] == "length"
    a = arch(backend.config)  # the pool: SLOTS x CAPACITY tokens of the 2 KV heads
    assert state["kv_pool_bytes"] == a.n_layer * 2 * SLOTS * CAPACITY * a.kv_heads * a.head_dim * 4
    head = schedule[6][1].prompt
    schedule.append((13, Request(id=200, prompt=head[:35] + prompt_token_ids(tokenizer, 5, 50), max_tokens=7)))
    _, out, _ = run(backend, schedule, budget=12, prefix_cache_bytes=1 << 20)
    for _, request in schedule:
        assert out[request.id] == alone(backend, request), f"request {request.id} differs (chunked)"
