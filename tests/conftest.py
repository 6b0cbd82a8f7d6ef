"""Shared fixtures: tiny seeded checkpoints written once per session, and left-padded prompts."""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
THREADS = max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(THREADS)

from plugins.core.checkpoint import create_checkpoint  # noqa: E402
from plugins.core.config import load_model_config  # noqa: E402
from plugins.core.tokenizer import left_pad, load_tokenizer, prompt_token_ids  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random inputs whatever ran before it (and on CI as here), on the same
    thread count (a command's main() run in-process may set its own; the kernel timings are per count)."""
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)


PROMPT_LENGTHS = (5, 17, 11)  # three prompts of different lengths -> real left padding


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """(model name, **overrides) -> HF dir with seed-0 weights, made once per session."""
    made = {}

    def make(name="tiny", seed=0, **overrides):
        key = (name, seed, tuple(sorted(overrides.items())))
        if key not in made:
            tag = "-".join([name, str(seed)] + [f"{k}{v}" for k, v in sorted(overrides.items())])
            made[key] = create_checkpoint(load_model_config(name, **overrides),
                                          tmp_path_factory.mktemp("ckpt") / tag, seed=seed)
        return made[key]

    return make


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    """The tiny MQA checkpoint, for tests that need one and no other."""
    return ckpt_factory("tiny")


@pytest.fixture(params=["tiny", "tiny-mha"])
def tiny_dir(request, ckpt_factory):
    return ckpt_factory(request.param)


@pytest.fixture(scope="session")
def padded_batch(tokenizer):
    seqs = [prompt_token_ids(tokenizer, n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    ids, mask = left_pad(seqs)
    return seqs, ids, mask


@pytest.fixture(scope="module")
def sc2(ckpt_factory):
    """The tiny StarCoder2 checkpoint: GQA (2 KV heads), RoPE, a sliding window of 16 tokens."""
    return ckpt_factory("tiny-starcoder2")


@pytest.fixture(scope="session")
def window_batch(tokenizer):
    """Left-padded prompts of 5, 40 and 23 tokens: two of them longer than tiny-starcoder2's window."""
    return left_pad([prompt_token_ids(tokenizer, n, i) for i, n in enumerate((5, 40, 23))])
