"""The tokenizer and prompts (plugins.core.tokenizer): real BPE, reproducible training, exact-length code prompts."""


import pytest

from plugins.core.config import load_model_config
from plugins.core.tokenizer import (PROMPTS_FILE, SPECIAL_TOKENS, TOKENIZERS, VOCAB_SIZE, load_tokenizer, make_batch,
                                    prompt_token_ids, train_tokenizer)


def test_tokenizer_is_real_bpe_sized_to_the_configs(tokenizer):
    assert tokenizer.get_vocab_size() == VOCAB_SIZE <= load_model_config("small").vocab_size
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # merges learnt from code, not byte fallback
    assert tokenizer.token_to_id("<|endoftext|>") == 0


def test_every_shipped_tokenizer_has_its_size_and_the_special_tokens():
    text = "def add(a, b):\n    return a + b\n"
    for name, (path, size) in TOKENIZERS.items():
        tok = load_tokenizer(name)
        assert path.is_file() and tok.get_vocab_size() == size
        assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
        assert tok.decode(tok.encode(text).ids) == text and len(tok.encode(text).ids) < len(text) / 2


@pytest.mark.slow
def test_tokenizer_training_is_deterministic():
    for name, (_, size) in TOKENIZERS.items():  # what `python -m plugins.core.tokenizer --check` does
        assert train_tokenizer(size).to_str() == load_tokenizer(name).to_str(), name


def test_prompts_are_real_code_of_the_requested_length(tokenizer):
    for n in (1, 16, 128, 1000):
        ids = prompt_token_ids(tokenizer, n, index=2)
        assert len(ids) == n
        assert tokenizer.decode(ids) in PROMPTS_FILE.read_text()
    ids, mask = make_batch(tokenizer, 4, 32)
    assert ids.shape == mask.shape == (4, 32) and bool(mask.all())
    assert len({tuple(r.tolist()) for r in ids}) == 4  # different prompts per row


def test_edit_prompts_hold_their_answer(tokenizer):
    from plugins.core.tokenizer import EDIT_HEADER, edit_prompt_ids, make_batch

    ids = edit_prompt_ids(tokenizer, 128, 3)
    assert len(ids) == 128
    header = tokenizer.encode(EDIT_HEADER).ids
    cut = next(i for i in range(128) if ids[i:i + len(header)] == header)
    code, again = ids[:cut], ids[cut + len(header):]
    assert 0 < len(again) < len(code) and code[:len(again)] == again  # the rest of `code` is the answer
    batch, mask = make_batch(tokenizer, 2, 64, "edit")
    assert batch.shape == (2, 64) and bool(mask.all()) and batch[0].tolist() == edit_prompt_ids(tokenizer, 64, 0)
