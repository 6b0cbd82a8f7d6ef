"""[foundation]: configs, seeded checkpoints, tokenizer and prompts, the HF baseline backend."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from plugins.backend import Backend, ConfigError, load_backend, resolve_dtype
from plugins.checkpoint import create_checkpoint, init_model, load_hf_model
from plugins.config import load_model_config, load_spec, model_names
from plugins.hf import HFBackend
from plugins.tokenizer import (PROMPTS_FILE, VOCAB_SIZE, load_tokenizer, make_batch, prompt_token_ids,
                               train_tokenizer)


# --- configs -----------------------------------------------------------------------------------

def test_model_configs_match_the_named_architectures():
    assert {"santacoder-1b", "santacoder-1b-mha", "starcoder-15b", "small", "tiny", "tiny-mha"} <= set(model_names())
    sc = load_model_config("santacoder-1b")
    assert isinstance(sc, GPTBigCodeConfig)
    assert (sc.n_layer, sc.n_embd, sc.n_head, sc.vocab_size, sc.n_positions) == (24, 2048, 16, 49280, 2048)
    assert sc.multi_query and sc.activation_function == "gelu_pytorch_tanh" and sc.layer_norm_epsilon == 1e-5
    assert not load_model_config("santacoder-1b-mha").multi_query
    st = load_model_config("starcoder-15b")
    assert (st.n_layer, st.n_embd, st.n_head, st.vocab_size, st.n_positions, st.multi_query) == \
        (40, 6144, 48, 49152, 8192, True)
    assert not load_model_config("tiny-mha").multi_query and load_model_config("tiny").multi_query


def test_unknown_config_key_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: 2\nn_embd: 64\nn_head: 4\nvocab_size: 100\nn_positions: 64\nn_layers: 3\n")
    with pytest.raises(ConfigError, match="unknown key.*n_layers"):
        load_spec(bad)


def test_invalid_yaml_is_one_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: [2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_spec(bad)


def test_unknown_model_name_is_an_error():
    with pytest.raises(ConfigError, match="unknown model config 'nope'"):
        load_model_config("nope")


def test_config_rejects_heads_not_dividing_width():
    with pytest.raises(ConfigError, match="not divisible by n_head"):
        load_model_config("tiny", n_head=5)


# --- checkpoints -------------------------------------------------------------------------------

def test_same_seed_gives_identical_weights_and_other_seed_differs():
    cfg = load_model_config("tiny")
    a, b, c = init_model(cfg, seed=3), init_model(cfg, seed=3), init_model(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    # GPT-2 init scheme: biases zero, layernorm weight one, c_proj scaled by depth.
    assert torch.count_nonzero(a.transformer.h[0].attn.c_attn.bias) == 0
    assert torch.all(a.transformer.h[0].ln_1.weight == 1)
    std = a.transformer.h[0].mlp.c_proj.weight.std().item()
    assert 0.5 * 0.02 / 2 < std < 1.5 * 0.02 / 2  # 0.02 / sqrt(2 * n_layer), n_layer = 2


def test_save_load_round_trip_is_bit_exact_and_loads_in_hf(tmp_path):
    cfg = load_model_config("tiny")
    model = init_model(cfg, seed=1)
    create_checkpoint(cfg, tmp_path / "m", seed=1)
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "gpt_bigcode"
    ours = load_hf_model(tmp_path / "m")
    theirs = GPTBigCodeForCausalLM.from_pretrained(tmp_path / "m")
    for name, ref in model.state_dict().items():
        assert torch.equal(ours.state_dict()[name], ref), name
        assert torch.equal(theirs.state_dict()[name], ref), name
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert "lm_head.weight" not in load_file(tmp_path / "m" / "model.safetensors")  # tied, stored once


def test_existing_checkpoint_is_not_overwritten(tmp_path):
    cfg = load_model_config("tiny")
    create_checkpoint(cfg, tmp_path / "m", seed=1)
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        create_checkpoint(cfg, tmp_path / "m", seed=2)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dir left behind


def test_non_gpt_bigcode_directory_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="'gpt2' model, not gpt_bigcode"):
        HFBackend.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        HFBackend.from_hf(tmp_path / "missing")


# --- tokenizer and prompts -------------------------------------------------------------------

def test_tokenizer_is_real_bpe_sized_to_the_configs(tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB_SIZE <= load_model_config("small").vocab_size
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # merges learnt from code, not byte fallback
    assert tokenizer.token_to_id("<|endoftext|>") == 0


@pytest.mark.slow
def test_tokenizer_training_is_deterministic(tokenizer):
    assert train_tokenizer().to_str() == tokenizer.to_str()


def test_prompts_are_real_code_of_the_requested_length(tokenizer):
    for n in (1, 16, 128, 1000):
        ids = prompt_token_ids(tokenizer, n, index=2)
        assert len(ids) == n
        assert tokenizer.decode(ids) in PROMPTS_FILE.read_text()
    ids, mask = make_batch(tokenizer, 4, 32)
    assert ids.shape == mask.shape == (4, 32) and bool(mask.all())
    assert len({tuple(r.tolist()) for r in ids}) == 4  # different prompts per row


# --- HF backend --------------------------------------------------------------------------------

def test_hf_backend_implements_the_protocol(ckpt_factory):
    backend = load_backend("hf", ckpt_factory("tiny"))
    assert isinstance(backend, Backend)


def test_left_padded_batch_equals_each_prompt_alone(tiny_dir, padded_batch):
    seqs, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    batch = backend.generate(ids, mask, max_new_tokens=16)
    logits = backend.logits(ids, mask)
    for i, seq in enumerate(seqs):
        one = torch.tensor([seq])
        alone = backend.generate(one, torch.ones_like(one), max_new_tokens=16)
        assert torch.equal(alone.tokens[0, -16:], batch.tokens[i, -16:])
        alone_logits = backend.logits(one, torch.ones_like(one))
        assert (alone_logits[0] - logits[i, -len(seq):]).abs().max() < 1e-5
    assert batch.tokens.shape == (3, ids.shape[1] + 16) and len(batch.step_s) == 15 and batch.prefill_s > 0


def test_our_loop_matches_hf_generate_greedy(tiny_dir, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    ours = backend.generate(ids, mask, max_new_tokens=12)
    ref = backend.model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.tokens, ref)


def test_cached_decode_equals_full_recompute(tiny_dir, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(tiny_dir)
    res = backend.generate(ids, mask, max_new_tokens=8)
    full_mask = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], 1)
    recomputed = backend.logits(res.tokens, full_mask)[:, ids.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(recomputed, res.tokens[:, ids.shape[1]:])


def test_sampling_is_seeded(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    backend = HFBackend.from_hf(ckpt_factory("tiny"))
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=50, top_p=0.9)
    a = backend.generate(ids, mask, seed=7, **kw)
    b = backend.generate(ids, mask, seed=7, **kw)
    c = backend.generate(ids, mask, seed=8, **kw)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_kv_cache_bytes_reported(ckpt_factory, padded_batch):
    _, ids, mask = padded_batch
    for name, kv_heads in (("tiny", 1), ("tiny-mha", 4)):
        cfg = load_model_config(name)
        res = HFBackend.from_hf(ckpt_factory(name)).generate(ids, mask, max_new_tokens=5)
        seq = ids.shape[1] + 4  # the last token is sampled, never fed back
        assert res.kv_cache_bytes == 2 * cfg.n_layer * 3 * seq * kv_heads * (cfg.n_embd // cfg.n_head) * 4


# --- bad input ---------------------------------------------------------------------------------

def test_prompt_longer_than_n_positions_is_rejected(ckpt_factory):
    backend = HFBackend.from_hf(ckpt_factory("tiny"))
    ids = torch.zeros((1, 250), dtype=torch.long)
    with pytest.raises(ConfigError, match="exceeds n_positions 256"):
        backend.generate(ids, torch.ones_like(ids), max_new_tokens=10)


def test_fp16_on_cpu_is_rejected():
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", "cpu")


def test_tp_not_dividing_heads_is_rejected(ckpt_factory):
    with pytest.raises(ConfigError, match="tp_size 3 does not divide n_head 4"):
        load_backend("hf", ckpt_factory("tiny"), tp_size=3)


def test_right_padding_is_rejected(ckpt_factory):
    backend = HFBackend.from_hf(ckpt_factory("tiny"))
    ids = torch.ones((1, 4), dtype=torch.long)
    with pytest.raises(ConfigError, match="left-padded"):
        backend.logits(ids, torch.tensor([[1, 1, 1, 0]]))
