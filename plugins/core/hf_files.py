"""The files beside config.json + weights that make a checkpoint a complete HF model directory.

`AutoTokenizer.from_pretrained(dir)`, lm-evaluation-harness's `hf` model, vLLM and OpenVINO's
exporter read the tokenizer from the model directory itself, and `generate()` its stop token:

  tokenizer.json          the tokenizer the model is built for (a byte copy of the shipped file)
  tokenizer_config.json   how transformers wraps it: PreTrainedTokenizerFast, the named special tokens,
                          model_max_length = n_positions, a chat template only when one is given
  generation_config.json  bos / eos ids, as transformers derives them from config.json
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer
from transformers import GenerationConfig

from plugins.core.arch import arch
from plugins.core.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILE, TOKENIZERS, check_vocab

TOKENIZER_JSON, TOKENIZER_CONFIG, GENERATION_CONFIG = ("tokenizer.json", "tokenizer_config.json",
                                                       "generation_config.json")
COMPANIONS = (TOKENIZER_JSON, TOKENIZER_CONFIG, GENERATION_CONFIG)
ARCHITECTURES = ["GPTBigCodeForCausalLM"]  # config.json's model class: vLLM picks its implementation by it
# (gpt_bigcode's; each family's: plugins.core.arch.ARCHITECTURES)
EOS = SPECIAL_TOKENS[0]


def tokenizer_path(tokenizer: str | Path | None = None) -> Path:
    """A tokenizer name (plugins.core.tokenizer.TOKENIZERS) or a tokenizer.json path; None: the project's,
    what `checkpoint_tokenizer` gives a directory without its own."""
    if tokenizer is None:
        return TOKENIZER_FILE
    if str(tokenizer) in TOKENIZERS:
        return TOKENIZERS[str(tokenizer)][0]
    if not Path(tokenizer).is_file():
        raise ValueError(f"unknown tokenizer {str(tokenizer)!r}: neither a name ({', '.join(TOKENIZERS)}) nor a file")
    return Path(tokenizer)


def tokenizer_config(tokenizer_json: dict, model_max_length: int, chat_template: str | None = None) -> dict:
    """tokenizer_config.json as transformers 4.x's `PreTrainedTokenizerFast.save_pretrained` writes it.
    Not transformers 5's own save: its `TokenizersBackend` class, list-valued `extra_special_tokens` and
    separate chat_template.jinja do not load in the 4.x that lm-eval, vLLM and optimum run on; this
    layout loads in both."""
    added = tokenizer_json.get("added_tokens") or []
    names = {t["content"] for t in added}
    config = {
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                 "single_word", "special")} for t in added},
        "additional_special_tokens": [t["content"] for t in added if t["special"] and t["content"] != EOS],
        "clean_up_tokenization_spaces": False,  # decode must give back the code exactly
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if EOS in names:  # <|endoftext|> ends, starts and stands in for unknown text, as in SantaCoder
        config.update(bos_token=EOS, eos_token=EOS, unk_token=EOS)
    if chat_template is not None:
        config["chat_template"] = chat_template
    return dict(sorted(config.items()))


def write_companions(directory: str | Path, config, tokenizer: str | Path | None = None,
                     chat_template: str | None = None) -> list[str]:
    """Write into `directory` those of the COMPANIONS it lacks (a directory's own tokenizer is kept:
    `tokenizer` only names what to copy when it has none). Returns the names written. One ValueError,
    before anything is written, when the tokenizer's ids do not fit the model's vocab_size."""
    return write_tokenizer_files(directory, config, tokenizer, chat_template) + write_generation_config(directory,
                                                                                                        config)


def write_tokenizer_files(directory: str | Path, config, tokenizer: str | Path | None = None,
                          chat_template: str | None = None) -> list[str]:
    """tokenizer.json and tokenizer_config.json, each where `directory` lacks it (write_companions)."""
    directory = Path(directory)
    written = []
    own = directory / TOKENIZER_JSON
    # a tokenizer_config.json without tokenizer.json is some other tokenizer (vocab.json + merges.txt)
    if not own.exists() and not (directory / TOKENIZER_CONFIG).exists():
        src = tokenizer_path(tokenizer)
        check_vocab(Tokenizer.from_file(str(src)).get_vocab_size(), config.vocab_size, f"checkpoint with {src}")
        shutil.copyfile(src, own)
        written.append(TOKENIZER_JSON)
    if own.exists() and not (directory / TOKENIZER_CONFIG).exists():
        settings = tokenizer_config(json.loads(own.read_text()), arch(config).n_positions, chat_template)
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
        written.append(TOKENIZER_CONFIG)
    return written


def write_generation_config(directory: str | Path, config) -> list[str]:
    if (Path(directory) / GENERATION_CONFIG).exists():
        return []
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    return [GENERATION_CONFIG]


def is_complete(directory: str | Path) -> bool:
    """Whether other projects load `directory` as it is: every companion and config.json's architectures."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("architectures")) and all((directory / f).is_file() for f in COMPANIONS)
