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
                 seed: int = 0, min_p: float = 0.0):
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
        if not _number(min_p) or not 0.0 <= min_p <= 1.0:
            raise ConfigError(f"min_p must be a number in [0, 1], got {min_p!r}")
        self.do_sample, self.temperature, self.top_k, self.top_p, self.min_p = (do_sample, temperature, top_k,
                                                                                top_p, min_p)
        self.generator = torch.Generator().manual_seed(seed % SEED_SPAN)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.float().argmax(-1)
        device = logits.device
        logits = logits.double().cpu()
        logits = (logits - logits.amax(-1, keepdim=True)) / float(self.temperature)
        if self.min_p > 0.0:  # vLLM's min_p: drop tokens under min_p x the top token's probability
            logits = logits.masked_fill(logits < math.log(self.min_p), float("-inf"))
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # keep the smallest set reaching top_p
            drop[:, 0] = False  # and the most likely token, however small top_p is
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        # One uniform number per row, at the inverse of the cumulative distribution: torch.multinomial
        # draws an exponential number per vocabulary entry (1.1 ms a row at 49k tokens, 20 ms of a
        # served decode step of 16 sampling rows; this: 0.25 ms). A token of probability 0 is never
        # chosen: u < the total, and the first entry whose cumulative sum passes u adds to it.
        cdf = logits.softmax(-1).cumsum(-1)
        u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, generator=self.generator) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1).to(device)


class LogitRules:
    """What a request asks of the logits before sampling (vLLM's order): the stop tokens suppressed
    until `min_tokens` are out, `logit_bias`, HF's `repetition_penalty` over prompt and output,
    OpenAI's `frequency_penalty` and `presence_penalty` over the output."""

    def __init__(self, repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, min_tokens: int = 0, stop_ids=()):
        for name, value in (("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                            ("frequency_penalty", frequency_penalty)):
            if not _number(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if not repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
        self.repetition, self.presence, self.frequency = float(repetition_penalty), presence_penalty, frequency_penalty
        self.bias = dict(logit_bias or {})
        # built once, not per decode step
        self._bias_ids = torch.tensor(list(self.bias), dtype=torch.long)
        self._bias_values = torch.tensor(list(self.bias.values()), dtype=torch.float32)
        self.min_tokens, self.stop_ids = min_tokens, sorted(set(stop_ids))

    @property
    def active(self) -> bool:
        return bool(self.repetition != 1.0 or self.presence or self.frequency or self.bias
                    or (self.min_tokens and self.stop_ids))

    def __call__(self, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        """logits [1, V] -> adjusted fp32 logits [1, V]."""
        logits = logits.float().clone()
        row = logits[0]
        if len(output) < self.min_tokens and self.stop_ids:
            row[self.stop_ids] = float("-inf")
        if self.bias:
            row[self._bias_ids] += self._bias_values
        if self.repetition != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
            score = row[seen]
            row[seen] = torch.where(score < 0, score * self.repetition, score / self.repetition)
        if output and (self.presence or self.frequency):
            ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
            row[ids] -= counts.to(row.dtype) * self.frequency + self.presence
        return logits


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under `logits` [V] (fp32 log-softmax) and the `k` most likely
    tokens with theirs."""
    logp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(logp, k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(logp[token]), pairs
