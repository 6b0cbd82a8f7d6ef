"""Seeded HF checkpoints (plugins.core.checkpoint): deterministic weights, bit-exact save and load, and
complete HF directories (plugins.core.hf_files) that transformers' Auto classes load as they are."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPTBigCodeForCausalLM

from plugins.core.checkpoint import create_checkpoint, init_model, load_hf_model
from plugins.core.config import ConfigError, load_model_config
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
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
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
    with pytest.raises(ConfigError, match="already exists"):
        create_checkpoint(cfg, tmp_path / "m", seed=2)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dir left behind


def test_non_gpt_bigcode_directory_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="'gpt2' model, not gpt_bigcode"):
        HFBackend.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        HFBackend.from_hf(tmp_path / "missing")


# --- the files users have: sharded safetensors, pytorch_model.bin, and bad ones ------------------

def _weights(path):
    return load_file(path / "model.safetensors")


def test_sharded_safetensors_and_pytorch_bin_load_like_the_single_file(ckpt_factory, tmp_path, padded_batch):
    """transformers' own sharded save (index + shards), and pytorch_model.bin as transformers 4.x wrote it
    (torch.save of the state dict; 5.x writes safetensors only), both load (the .bin weights-only)."""
    src = ckpt_factory("tiny")
    hf = GPTBigCodeForCausalLM.from_pretrained(src)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    hf.config.save_pretrained(tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    want = load_hf_model(src).state_dict()
    _, ids, mask = padded_batch
    ref = HFBackend.from_hf(src).logits(ids, mask)
    for d in ("sharded", "bin"):
        got = load_hf_model(tmp_path / d).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), d
        assert torch.equal(HFBackend.from_hf(tmp_path / d).logits(ids, mask), ref), d


def test_pytorch_bin_that_runs_code_is_refused(ckpt_factory, tmp_path):
    import os

    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_bytes((ckpt_factory("tiny") / "config.json").read_bytes())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"transformer.wte.weight": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin: refusing to load posix.system"):
        load_hf_model(d)
    assert not marker.exists()


def test_duplicate_non_float_and_misshapen_weights_are_refused_before_allocating(ckpt_factory, tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = ckpt_factory("tiny")
    w = _weights(src)
    d = tmp_path / "dup"
    shutil.copytree(src, d)
    save_file({"transformer.wte.weight": w["transformer.wte.weight"]}, d / "extra.safetensors")
    with pytest.raises(ConfigError, match="transformer.wte.weight is stored twice"):
        load_hf_model(d)
    d = tmp_path / "int"
    shutil.copytree(src, d)
    save_file({**w, "transformer.ln_f.bias": torch.zeros(64, dtype=torch.int32)}, d / "model.safetensors")
    from plugins.core.checkpoint import read_hf_state

    with pytest.raises(ConfigError, match="transformer.ln_f.bias is torch.int32"):
        read_hf_state(d)
    # a config.json claiming a model far larger than its files: refused from the headers, nothing allocated
    d = tmp_path / "huge"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(n_embd=65536, n_head=4)  # ~100 GB of weights by config; the file holds 13 MB
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="has shape .* config.json says"):
        load_hf_model(d)


@pytest.mark.parametrize("edit, message", [
    (lambda c: "{not json", "not valid JSON"),
    (lambda c: {**c, "n_head": "4"}, "not a valid gpt_bigcode config .*n_head"),
    (lambda c: {**c, "n_head": 0}, "n_head must be a positive integer, got 0"),
    (lambda c: {**c, "n_embd": 63}, "n_embd \\(63\\) is not divisible by n_head \\(4\\)"),
    (lambda c: {**c, "layer_norm_epsilon": -1.0}, "layer_norm_epsilon must be a number"),
])
def test_bad_config_json_is_one_clear_error(edit, message, ckpt_factory, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpt_factory("tiny"), d)
    cfg = json.loads((d / "config.json").read_text())
    new = edit(cfg)
    (d / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(ConfigError, match=message):
        HFBackend.from_hf(d)


def test_hub_id_gets_a_hint():
    with pytest.raises(ConfigError, match="looks like a hub id: nothing is downloaded"):
        load_hf_model("bigcode/santacoder")


def test_not_enough_memory_is_refused_before_allocating(ckpt_factory, monkeypatch):
    import psutil

    class Tiny:
        available = 1000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(ConfigError, match=r"the model needs .* GiB in float32, 0.0 GiB of memory is available"):
        load_hf_model(ckpt_factory("tiny"))


# --- complete HF directories: tokenizer and generation files beside the weights ------------------

CODE = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
FIM = ["<fim-prefix>", "<fim-middle>", "<fim-suffix>", "<fim-pad>"]


def test_checkpoint_loads_in_transformers_auto_classes(ckpt_factory, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from plugins.engine.registry import load_backend

    d = ckpt_factory("tiny")
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok(CODE).input_ids
    assert ids == tokenizer.encode(CODE).ids and tok.decode(ids) == CODE
    assert tok.eos_token_id == tok.bos_token_id == 0 and tok.model_max_length == 256
    assert [tok(t).input_ids for t in FIM] == [[1], [2], [3], [4]]  # each one id, never split
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    assert GenerationConfig.from_pretrained(d).eos_token_id == 0
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(input_ids=x).logits
    ours = load_backend("hf", d, dtype="float32").logits(x, torch.ones_like(x))
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_chat_template_and_the_model_s_own_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from plugins.core.tokenizer import tokenizer_file

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    create_checkpoint(load_model_config("tiny"), tmp_path / "chat", chat_template=template)
    tok = AutoTokenizer.from_pretrained(tmp_path / "chat")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|user|>hi<|endoftext|><|assistant|>"
    cfg = load_model_config("code-mqa")  # built for code-8k: 8192 rows
    create_checkpoint(cfg, tmp_path / "8k", tokenizer="code-8k")
    assert (tmp_path / "8k" / "tokenizer.json").read_bytes() == tokenizer_file("code-8k").read_bytes()
    with pytest.raises(ValueError, match="49152 tokens but the model's vocab_size is 8192"):
        create_checkpoint(cfg, tmp_path / "bad")  # the project's default does not fit: nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["8k", "chat"]


def test_older_directories_still_stage_for_the_peers_and_are_remade(ckpt_factory, tmp_path):
    import shutil

    from plugins.core.checkpoint import ensure_checkpoint
    from plugins.core.hf_files import COMPANIONS, is_complete
    from plugins.peers import staged_checkpoint

    new = ckpt_factory("tiny")
    with staged_checkpoint(new, tmp_path) as staged:
        assert staged == new  # complete: read where it is
    old = tmp_path / "old"  # what a checkpoint was before: config.json (no architectures) + weights
    old.mkdir()
    shutil.copyfile(new / "model.safetensors", old / "model.safetensors")
    cfg = json.loads((new / "config.json").read_text())
    del cfg["architectures"]
    (old / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "work").mkdir()
    with staged_checkpoint(old, tmp_path / "work") as staged:
        assert is_complete(staged)
        assert all((staged / f).read_bytes() == (new / f).read_bytes() for f in COMPANIONS)
    assert not (tmp_path / "work" / "hf").exists() and not is_complete(old)
    ensure_checkpoint(load_model_config("tiny"), old)
    assert is_complete(old)


def test_conversions_to_hf_carry_the_tokenizer(tmp_path):
    from converters import convert
    from plugins.core.hf_files import COMPANIONS, is_complete

    create_checkpoint(load_model_config("tiny"), tmp_path / "src", chat_template="{{ messages[0]['content'] }}")
    convert(tmp_path / "src", tmp_path / "hf", "hf", "hf", dtype="bfloat16")
    convert(tmp_path / "src", tmp_path / "legacy", "hf", "megatron-legacy")
    convert(tmp_path / "legacy", tmp_path / "back", "megatron-legacy", "hf")
    for d in ("hf", "back"):
        assert is_complete(tmp_path / d), d
    assert all((tmp_path / "hf" / f).read_bytes() == (tmp_path / "src" / f).read_bytes() for f in COMPANIONS)
    # from Megatron (no tokenizer there) the project's, as a directory without one was served before
    assert "chat_template" not in json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
