"""Held-out perplexity of any Backend: teacher-forced over fixed windows of held-out stdlib tokens,
through `backend.logits` only, so every engine and precision is measured by the same code."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plugins.core.tokenizer import check_vocab, load_tokenizer
from plugins.train.data import heldout_windows


def perplexity(backend, windows: int = 8, length: int = 256, chunk: int = 4, tok=None) -> dict:
    """exp(mean next-token NLL) over `windows` held-out windows of `length` tokens (no padding), cut
    with `tok`, the model's tokenizer (default: the project's; `checkpoint_tokenizer` finds a
    checkpoint's own)."""
    tok = tok or load_tokenizer()
    check_vocab(tok.get_vocab_size(), backend.config.vocab_size, "perplexity")
    ids = heldout_windows(windows, length, tok)
    total, count = 0.0, 0
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        logits = backend.logits(part, torch.ones_like(part)).float()
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), part[:, 1:].flatten(), reduction="sum"))
        count += part[:, 1:].numel()
    nll = total / count
    return {"heldout_ppl": math.exp(nll), "heldout_nll": nll, "heldout_tokens": count}
