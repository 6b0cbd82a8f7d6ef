"""Seeded HF checkpoints (plugins.core.checkpoint): deterministic weights, bit-exact save and load."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPTBigCodeForCausalLM

from plugins.core.backend import ConfigError
from plugins.core.checkpoint import create_checkpoint, init_model, load_hf_model
from plugins.core.config import load_model_config
from plugins.hf import HFBackend


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
