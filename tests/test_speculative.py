"""Greedy speculative decoding (plugins.core.speculative): exactly the target's greedy output, whatever
the draft, at every k."""

import copy

import pytest
import torch

from plugins.core.checkpoint import init_model
from plugins.core.config import load_model_config
from plugins.core.generation import Sampler, generate
from plugins.core.speculative import speculative_generate
from plugins.hf import HFDecoder
from plugins.kernels.quant import quantize_linears


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_plain_greedy(name, k, padded_batch):
    _, ids, mask = padded_batch
    cfg = load_model_config(name)
    target = init_model(cfg, seed=0)
    plain = generate(HFDecoder(target), ids, mask, 40, Sampler())
    # A good draft (the target in int8) and a useless one (other weights): output must not change.
    for draft, min_rate in ((quantize_linears(copy.deepcopy(target)), 0.8), (init_model(cfg, seed=9), 0.0)):
        res, stats = speculative_generate(HFDecoder(target), HFDecoder(draft), ids, mask, 40, k=k)
        assert torch.equal(res.tokens, plain.tokens)
        assert stats.acceptance_rate >= min_rate and stats.drafted == k * stats.rounds
        assert len(res.step_s) == 39
