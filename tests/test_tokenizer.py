"""The tokenizer and prompts (plugins.core.tokenizer): real BPE, reproducible training, exact-length code prompts."""


import pytest

from plugins.core.config import load_model_config
from plugins.core.tokenizer import PROMPTS_FILE, VOCAB_SIZE, make_batch, prompt_token_ids, train_tokenizer


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
