"""Greedy and seeded sampling, shared by the generate loop, speculative decoding and the batch."""

from __future__ import annotations

import math

import torch

from plugins.core.config import ConfigError


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


SEED_SPAN = 2 ** 63  # any integer seed is reduced into [0, 2^63) (torch's generator takes 64 bits)


class Sampler:
    """Greedy, or temperature / top-k / top-p sampling from a seeded generator.

    Sampling runs in float64 on logits minus their maximum, so no temperature > 0 (down to 5e-324) or
    top_p > 0 can make inf or NaN probabilities: the most likely token's scaled logit stays 0, the
    others fall to -inf at worst, and top-p always keeps the most likely token."""

    def __init__(self, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0):
        if not isinstance(do_sample, bool):
            raise ConfigError(f"do_sample must be True or False, got {do_sample!r}")
        if not _number(temperature) or (do_sample and not temperature > 0):
            raise ConfigError(f"temperature must be a finite number > 0 when sampling, got {temperature!r}")
        if not _number(top_p) or not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0, got {top_k!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.generator = torch.Generator().manual_seed(seed % SEED_SPAN)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.float().argmax(-1)
        device = logits.device
        logits = logits.double().cpu()
        logits = (logits - logits.amax(-1, keepdim=True)) / float(self.temperature)
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # keep the smallest set reaching top_p
            drop[:, 0] = False  # and the most likely token, however small top_p is
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).to(device)
