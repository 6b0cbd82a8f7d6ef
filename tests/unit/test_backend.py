"""The checks every backend shares (plugins.core.tensors, plugins.engine), before any compute."""


import pytest
import torch

from plugins.core.config import ConfigError
from plugins.core.tensors import resolve_dtype
from plugins.engine.registry import load_backend
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


@pytest.mark.parametrize("call, message", [
    (lambda b: b.generate(torch.zeros((1, 0), dtype=torch.long), torch.zeros((1, 0), dtype=torch.long), 4),
     "at least one prompt of at least one token"),
    (lambda b: b.generate(torch.zeros((0, 3), dtype=torch.long), torch.zeros((0, 3), dtype=torch.long), 4),
     "at least one prompt"),
    (lambda b: b.generate(torch.ones((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.long), 2.5),
     "max_new_tokens must be an integer"),
    (lambda b: b.generate(torch.ones((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.long), True),
     "max_new_tokens must be an integer"),
    (lambda b: b.generate(torch.ones((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.long), 2,
                          do_sample=True, temperature=float("nan")), "temperature must be a finite number"),
    (lambda b: b.generate(torch.ones((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.long), 2,
                          top_k=1.5), "top_k must be an integer"),
    (lambda b: b.logits(torch.ones((1, 3), dtype=torch.long), torch.tensor([[0, 2, 1]])), "only 0 .* and 1"),
    (lambda b: b.logits(torch.ones((1, 3), dtype=torch.long), torch.tensor([[0.0, 0.5, 1.0]])), "only 0 .* and 1"),
    (lambda b: b.logits(torch.ones((1, 3)), torch.ones((1, 3))), "integer tensor"),
])
def test_bad_requests_are_one_clear_error_before_any_compute(call, message, ckpt_factory):
    with pytest.raises(ConfigError, match=message):
        call(HFBackend.from_hf(ckpt_factory("tiny")))


@pytest.mark.parametrize("name", ["hf", "deepspeed"])
def test_unknown_backend_option_is_a_clear_error(name, ckpt_factory):
    with pytest.raises(ConfigError, match=f"unknown option.* colour for backend '{name}'; known: "):
        load_backend(name, ckpt_factory("tiny"), colour="red")
