"""A real byte-level BPE tokenizer and real code prompts, with no download.

The tokenizers are trained with the `tokenizers` library on the Python standard library sources of
this interpreter (present on every machine) and shipped under `configs/tokenizer/`: the project's
49152-token one (`code-49k`, `tokenizer.json`, what every config without a `tokenizer:` key uses) and
a smaller one for the models trained here (`code-8k`, `code-8k/tokenizer.json`: at width 256 a
49152-row LM head is most of the training compute). `python -m plugins.core.tokenizer --check`
retrains both and asserts the results are identical to the shipped files.
Prompts are windows of exactly the requested token length cut from `configs/prompts/code.py.txt`,
a fixed file of real code, so benchmark inputs do not change when the machine does.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plugins.core.paths import CONFIGS_DIR, DEFAULT_TOKENIZER, TOKENIZER_FILE, TOKENIZERS, VOCAB_SIZE  # noqa: F401

PROMPTS_FILE = CONFIGS_DIR / "prompts" / "code.py.txt"
# SantaCoder's special tokens, so ids 0.. are the same kind of thing as upstream.
SPECIAL_TOKENS = ["<|endoftext|>", "<fim-prefix>", "<fim-middle>", "<fim-suffix>", "<fim-pad>"]
EOS_ID = 0
PAD_ID = 0
_SKIP = {"site-packages", "test", "tests", "idle_test", "lib2to3", "__pycache__"}


def training_files() -> list[str]:
    """Every stdlib .py file but tests and installed packages, sorted (training is order-dependent)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in stdlib.rglob("*.py") if not _SKIP & set(p.relative_to(stdlib).parts))


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(training_files(), trainer)
    return tok


def tokenizer_file(name: str = DEFAULT_TOKENIZER) -> Path:
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name][0]


def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    path = tokenizer_file(name)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m plugins.core.tokenizer --write`")
    return Tokenizer.from_file(str(path))


def checkpoint_tokenizer(checkpoint_dir: str | Path) -> tuple[Tokenizer, Path]:
    """A checkpoint's own `tokenizer.json`, else the project's (what our seeded checkpoints are built
    for). One ValueError when its ids do not fit the checkpoint's vocab_size."""
    own = Path(checkpoint_dir) / "tokenizer.json"
    path = own if own.is_file() else TOKENIZER_FILE
    tok = Tokenizer.from_file(str(path))
    check_vocab(tok.get_vocab_size(), _config_vocab(checkpoint_dir), f"{checkpoint_dir} with {path}")
    return tok, path


def _config_vocab(checkpoint_dir: str | Path) -> int | None:
    import json

    try:
        return json.loads((Path(checkpoint_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None


def check_vocab(tokenizer_size: int, vocab_size: int | None, where: str) -> None:
    """A tokenizer fits a model when each of its ids has an embedding row (seeded configs may have
    more rows than tokens, like SantaCoder's padded 49280)."""
    if vocab_size is not None and tokenizer_size > vocab_size:
        raise ValueError(f"{where}: the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
                         f"{vocab_size}: token ids would index past the embedding")


def prompt_token_ids(tok: Tokenizer, length: int, index: int = 0) -> list[int]:
    """Real code, exactly `length` tokens: the `index`-th window of the prompt corpus."""
    ids = tok.encode(PROMPTS_FILE.read_text()).ids
    if length > len(ids):
        raise ValueError(f"prompt length {length} exceeds the prompt corpus ({len(ids)} tokens)")
    stride = max(1, (len(ids) - length) // 97)  # 97 distinct, well-spread windows
    start = (index * stride) % (len(ids) - length + 1)
    return ids[start:start + length]


def left_pad(seqs: list[list[int]], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch sequences of different lengths, padding on the left (what decoder-only generation wants)."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            input_ids[i, width - len(s):] = torch.tensor(s)
            attention_mask[i, width - len(s):] = 1
    return input_ids, attention_mask


EDIT_HEADER = "\n# The same code, rewritten:\n"
WORKLOADS = ("code", "edit")


def edit_prompt_ids(tok: Tokenizer, length: int, index: int = 0) -> list[int]:
    """A code-editing prompt of exactly `length` tokens: a piece of code, a header asking for it again,
    and the first half of it again; the answer copies the rest (what prompt-lookup decoding is for)."""
    header = tok.encode(EDIT_HEADER).ids
    code_len = (length - len(header)) * 2 // 3
    if code_len < 2:
        raise ValueError(f"prompt length {length} is too short for a code-editing prompt")
    code = prompt_token_ids(tok, code_len, index)
    return code + header + code[:length - len(header) - code_len]


def make_batch(tok: Tokenizer, batch_size: int, prompt_len: int, workload: str = "code") -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """`batch_size` different real-code prompts of `prompt_len` tokens each (no padding needed); workload
    "edit": code-editing prompts (`edit_prompt_ids`)."""
    ids = edit_prompt_ids if workload == "edit" else prompt_token_ids
    return left_pad([ids(tok, prompt_len, i) for i in range(batch_size)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="train and write every tokenizer under configs/tokenizer/")
    ap.add_argument("--check", action="store_true", help="retrain and check the shipped files are identical")
    ap.add_argument("--only", choices=sorted(TOKENIZERS), help="just this tokenizer")
    args = ap.parse_args(argv)
    differ = 0
    for name in [args.only] if args.only else TOKENIZERS:
        path, size = TOKENIZERS[name]
        tok = train_tokenizer(size)
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tok.save(str(tmp))
            tmp.replace(path)
            print(f"wrote {path} ({tok.get_vocab_size()} tokens)")
        if args.check:
            same = tok.to_str() == load_tokenizer(name).to_str()
            print(f"{name}: tokenizer identical" if same else f"{name}: tokenizer DIFFERS from {path}")
            differ += not same
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
