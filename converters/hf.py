"""HF format: a directory with `config.json` + `model.safetensors` that `from_pretrained` loads, written
complete (plugins.core.hf_files): an HF source's tokenizer and generation files travel with the weights;
from a Megatron source, the project's tokenizer (what such a directory was served with before) when it fits
the vocabulary."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file
from transformers import GPTBigCodeConfig

from converters.mapping import ConversionError, check_hf_state
from plugins.core.checkpoint import WEIGHTS_NAME, read_hf_config, read_hf_state
from plugins.core.arch import ARCHITECTURES
from plugins.core.config import ConfigError, arch, kv_heads
from plugins.core.hf_files import write_generation_config, write_tokenizer_files

# what transformers' tokenizers and generate() read from a model directory
CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
           "merges.txt", "chat_template.jinja", "generation_config.json")


def read(src: str | Path, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    src = Path(src)
    try:
        config = read_hf_config(src)
        state = read_hf_state(src, config)  # names and shapes checked from the headers before reading
    except ConversionError:
        raise
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_hf_state(state, config, what=str(src))
    return config, state


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1) -> None:
    """Everything `write` would refuse, checked before any work."""
    if tp_size != 1:
        raise ConversionError(f"the HF format has no tensor parallelism (got tp_size={tp_size}); use --tp 1")
    groups = kv_heads(config)
    if arch(config).family == "gpt_bigcode" and groups not in (1, config.n_head):
        raise ConversionError(f"HF gpt_bigcode supports only MQA (1 KV head) or MHA ({config.n_head} KV heads), "
                              f"not {groups} KV heads; write GQA to a Megatron format instead")


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, progress=None,
          source: str | Path | None = None) -> None:
    """`source`: the checkpoint converted, whose tokenizer files (if any) are copied."""
    check_writable(config, tp_size)
    check_hf_state(hf_state, config)
    dst = Path(dst)
    for name in CARRIED:
        if source is not None and (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, dst / name)
    try:
        write_tokenizer_files(dst, config)
    except ValueError:  # a vocabulary the project's tokenizer does not fit (a Megatron source's own): none is guessed
        pass
    write_generation_config(dst, config)
    config.architectures = [ARCHITECTURES[arch(config).family]]
    config.save_pretrained(dst)
    state = {k: v.contiguous() for k, v in hf_state.items()}
    save_file(state, dst / WEIGHTS_NAME, metadata={"format": "pt"})


def check_loadable(dst: str | Path, config: GPTBigCodeConfig) -> None:
    """The weights file holds exactly the HF model's tensors and shapes (GPTBigCodeForCausalLM or
    Starcoder2ForCausalLM; the tied head aside)."""
    from safetensors import safe_open

    from converters import consumers

    with safe_open(Path(dst) / WEIGHTS_NAME, framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    consumers.check_strict(WEIGHTS_NAME, got, consumers.hf_keys(config),
                           f"transformers' {ARCHITECTURES[arch(config).family]}")
