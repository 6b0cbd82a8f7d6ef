"""`mqa-serve --backend hf` on a StarCoder2 checkpoint (tiny-starcoder2: GQA with 2 KV heads, RoPE, a
sliding window of 16), live on 127.0.0.1: concurrent greedy completions that run past the window are,
token for token, what `generate` gives each alone (fp32), and `suffix` builds the fill-in-the-middle
prompt from StarCoder2's own FIM tokens (`<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`), which this
checkpoint's tokenizer spells as StarCoder2's does."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from live_server import SLOTS, Server
from tokenizers import Tokenizer

from plugins.core.checkpoint import create_checkpoint
from plugins.core.config import load_model_config
from plugins.core.paths import TOKENIZER_FILE
from plugins.core.tokenizer import prompt_token_ids
from plugins.engine.registry import load_backend
from plugins.http.text import encode_prompt

STARCODER2_FIM = {f"<fim-{role}>": f"<fim_{role}>" for role in ("prefix", "middle", "suffix", "pad")}


@pytest.fixture(scope="module")
def sc2(tmp_path_factory):
    """A seeded tiny-starcoder2 checkpoint whose tokenizer names its FIM tokens as StarCoder2's does."""
    root = tmp_path_factory.mktemp("sc2")
    text = TOKENIZER_FILE.read_text()
    for ours, theirs in STARCODER2_FIM.items():
        text = text.replace(f'"{ours}"', f'"{theirs}"')
    (root / "tokenizer.json").write_text(text)
    return create_checkpoint(load_model_config("tiny-starcoder2"), root / "tiny-starcoder2",
                             tokenizer=root / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(sc2):
    return Tokenizer.from_file(str(sc2 / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(sc2):
    return load_backend("hf", sc2, dtype="float32")


@pytest.fixture(scope="module")
def server(sc2):
    # tiny-starcoder2: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes x 256 positions per slot
    s = Server(sc2, "--backend", "hf", "--kv-budget", str(SLOTS * 2 * 2 * 2 * 16 * 4 * 256))
    yield s
    s.stop()


def alone(engine, tok, ids, max_tokens):
    """What `generate` alone gives, cut after EOS as the server stops there: (text, tokens)."""
    t = torch.tensor([ids])
    new = engine.generate(t, torch.ones_like(t), max_tokens).tokens[0, len(ids):].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    if eos in new:
        new = new[:new.index(eos) + 1]
    return tok.decode(new, skip_special_tokens=True), len(new)


def test_concurrent_greedy_completions_match_generate_alone(server, engine, tok, sc2):
    prompts = [(6 + 7 * i, 10 + 4 * i) for i in range(7)]  # up to 48 prompt + 34 new tokens: past the window

    def ask(i):
        time.sleep(0.05 * i)  # arrivals spread over the running batch's steps
        length, max_tokens = prompts[i]
        return server.client.completions.create(model=Path(sc2).name, prompt=prompt_token_ids(tok, length, i),
                                                max_tokens=max_tokens, temperature=0)

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    for i, answer in enumerate(answers):
        length, max_tokens = prompts[i]
        text, n = alone(engine, tok, prompt_token_ids(tok, length, i), max_tokens)
        assert (answer.choices[0].text, answer.usage.completion_tokens) == (text, n), f"request {i}"
    assert server.metric("mqa_requests_running") == 0


def test_suffix_uses_starcoder2_fim_tokens(server, engine, tok, sc2):
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    ids = encode_prompt(tok, prefix, suffix)
    assert ids[0] == tok.token_to_id("<fim_prefix>") and ids[-1] == tok.token_to_id("<fim_middle>")
    assert tok.token_to_id("<fim_suffix>") in ids and tok.token_to_id("<fim-prefix>") is None
    answer = server.client.completions.create(model=Path(sc2).name, prompt=prefix, suffix=suffix, max_tokens=12,
                                              temperature=0)
    assert answer.usage.prompt_tokens == len(ids)
    assert (answer.choices[0].text, answer.usage.completion_tokens) == alone(engine, tok, ids, 12)
    assert json.loads((sc2 / "config.json").read_text())["architectures"] == ["Starcoder2ForCausalLM"]
