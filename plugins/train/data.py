"""Training data: the Python standard library sources the tokenizer was trained on, split by whole file.

A file is held out when a hash of its path relative to the stdlib root falls in the first
HELDOUT_PERMILLE of 1000 buckets: the same files on every machine with the same Python, whatever
order they are listed in, and never a file cut in two. Each split is one token stream: every file's
tokens, cut with the tokenizer of the model at hand (cached per tokenizer), followed by <|endoftext|>.
Training windows are non-overlapping slices of seq_len + 1 tokens of the train stream, visited in a
seeded permutation per epoch; the position in that order (epoch, index) is all a resumed run needs
to continue exactly.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from plugins.core.tokenizer import EOS_ID, load_tokenizer, training_files

HELDOUT_PERMILLE = 30  # ~3 % of the files


def relative_name(path: str) -> str:
    return Path(path).relative_to(sysconfig.get_paths()["stdlib"]).as_posix()


def is_heldout(relative: str) -> bool:
    bucket = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big") % 1000
    return bucket < HELDOUT_PERMILLE


def split_files() -> tuple[list[str], list[str]]:
    """(train files, held-out files), both sorted, as absolute paths."""
    files = training_files()
    held = [f for f in files if is_heldout(relative_name(f))]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


_STREAMS: dict[tuple[str, str], torch.Tensor] = {}


def token_stream(split: str, tok: Tokenizer | None = None) -> torch.Tensor:
    """Every file of the split, tokenized with `tok` (default: the project's tokenizer), each followed
    by <|endoftext|>: one int64 tensor, cached per split and tokenizer content."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    tok = tok or load_tokenizer()
    key = (split, hashlib.sha256(tok.to_str().encode()).hexdigest())
    if key not in _STREAMS:
        files = split_files()[0 if split == "train" else 1]
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(EOS_ID)
        if len(_STREAMS) >= 4:  # two tokenizers' splits at most: the train split is ~10M tokens
            _STREAMS.pop(next(iter(_STREAMS)))
        _STREAMS[key] = torch.tensor(ids, dtype=torch.long)
    return _STREAMS[key]


def heldout_windows(count: int, length: int, tok: Tokenizer | None = None) -> torch.Tensor:
    """`count` fixed windows of `length` held-out tokens, spread evenly over the held-out stream."""
    stream = token_stream("heldout", tok)
    if count < 1 or length < 2:
        raise ValueError(f"need count >= 1 and length >= 2, got {count} windows of {length}")
    if length > len(stream):
        raise ValueError(f"window length {length} exceeds the held-out stream ({len(stream)} tokens)")
    last = len(stream) - length
    starts = [round(i * last / max(1, count - 1)) for i in range(count)]
    return torch.stack([stream[s:s + length] for s in starts])


def unigram_baseline(tok: Tokenizer | None = None) -> dict:
    """Cross-entropy (nats/token) of held-out tokens under the train split's unigram distribution
    (add-one smoothed, so unseen tokens cost a finite amount): the loss a model that ignores context gets."""
    train, held = token_stream("train", tok), token_stream("heldout", tok)
    counts = torch.bincount(train, minlength=int(max(train.max(), held.max())) + 1).double() + 1.0
    logp = counts.log() - math.log(float(counts.sum()))
    return {"unigram_heldout_nats": float(-logp[held].mean()), "train_tokens": len(train), "heldout_tokens": len(held)}


@dataclass
class Batches:
    """Seeded, resumable order over the train windows: `position` = (epoch, index of the next window)."""
    seq_len: int
    batch: int
    seed: int
    epoch: int = 0
    index: int = 0
    tok: Tokenizer | None = field(default=None, repr=False)

    def __post_init__(self):
        stream = token_stream("train", self.tok)
        n = len(stream) // (self.seq_len + 1)
        if n < self.batch:
            raise ValueError(f"the train split holds {n} windows of {self.seq_len + 1} tokens, fewer than a batch")
        self.windows = stream[: n * (self.seq_len + 1)].view(n, self.seq_len + 1)
        self._order = None

    def order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = (self.epoch, torch.randperm(len(self.windows), generator=gen))
        return self._order[1]

    def next(self) -> torch.Tensor:
        """LongTensor [batch, seq_len + 1]; an epoch's tail shorter than a batch is skipped."""
        if self.index + self.batch > len(self.windows):
            self.epoch, self.index = self.epoch + 1, 0
        rows = self.order()[self.index:self.index + self.batch]
        self.index += self.batch
        return self.windows[rows]

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}
