"""The checks every backend shares (plugins.core.backend), before any compute."""


import pytest
import torch

from plugins.core.backend import ConfigError, load_backend, resolve_dtype
from plugins.hf import HFBackend


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
