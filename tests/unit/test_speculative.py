"""Greedy speculative decoding (plugins.engine.speculative): exactly the target's greedy output, whatever
the draft, at every k."""

import copy

import pytest
import torch

from plugins.core.checkpoint import init_model
from plugins.core.config import load_model_config
from plugins.engine.generation import generate
from plugins.engine.hf_model import HFDecoder
from plugins.engine.sampling import Sampler
from plugins.engine.speculative import ModelDraft, PromptLookupDraft, speculative_generate
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
        res, stats = speculative_generate(HFDecoder(target), ModelDraft(HFDecoder(draft)), ids, mask, 40, k=k)
        assert torch.equal(res.tokens, plain.tokens)
        assert stats.acceptance_rate >= min_rate and stats.drafted == k * stats.rounds
        assert len(res.step_s) == 39


def test_prompt_lookup_proposes_the_continuation_of_the_first_match():
    draft = PromptLookupDraft(ngram=2)
    pad = 0
    tokens = torch.tensor([[pad, 5, 6, 7, 8, 9, 5, 6, 0, 0, 0],     # "5 6" -> 7 8 9
                           [1, 2, 3, 4, 3, 9, 2, 9, 0, 0, 0]])      # "2 9": none; "9" -> 2 9 (first 9)
    mask = torch.ones_like(tokens)
    mask[0, 0] = 0
    draft.prefill(tokens[:, :1], mask[:, :1], None)
    lengths = draft.propose(tokens, mask, 8, None, 3)
    assert lengths.tolist() == [3, 2]
    assert tokens[0, 8:].tolist() == [7, 8, 9] and tokens[1, 8:10].tolist() == [2, 9]
    no_match = torch.tensor([[1, 2, 3, 0, 0]])
    draft.prefill(no_match[:, :1], torch.ones(1, 1, dtype=torch.long), None)
    assert draft.propose(no_match, torch.ones_like(no_match), 3, None, 2).tolist() == [0]


@pytest.mark.parametrize("k", [2, 6])
def test_prompt_lookup_equals_plain_greedy(k, padded_batch):
    _, ids, mask = padded_batch
    target = init_model(load_model_config("tiny"), seed=0)
    plain = generate(HFDecoder(target), ids, mask, 40, Sampler())
    res, stats = speculative_generate(HFDecoder(target), PromptLookupDraft(), ids, mask, 40, k=k)
    assert torch.equal(res.tokens, plain.tokens)
    assert stats.drafted <= k * stats.rounds and len(res.step_s) == 39
