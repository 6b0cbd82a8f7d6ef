"""One request of a continuous batch: what it asks (BatchRequest, checked against a slot's capacity
before admission) and the row that generates it (its sampler, logit rules and output so far)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.core.config import ConfigError
from plugins.engine.sampling import LogitRules, Sampler, top_logprobs


@dataclass
class BatchRequest:
    """What a slot needs to generate for one request; `id` is the caller's."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None  # stop at this token (it is returned)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0        # EOS and stop_token_ids cannot come before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # stop at any of these too (returned)
    logprobs: int | None = None    # with each token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (one extra forward)

    def rules(self) -> LogitRules:
        stops = set(self.stop_token_ids) | ({self.eos_token_id} - {None})
        return LogitRules(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias,
                          self.min_new_tokens, stops)


def check_request(request: BatchRequest, capacity: int) -> None:
    """What a KV slot of `capacity` columns can take (checked before a request is admitted)."""
    if not request.prompt:
        raise ConfigError("a request needs at least one prompt token")
    if request.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if not 0 <= request.min_new_tokens <= request.max_new_tokens:
        raise ConfigError(f"min_new_tokens must be in [0, max_new_tokens], got {request.min_new_tokens}")
    if len(request.prompt) + request.max_new_tokens > capacity:
        raise ConfigError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                          f"exceeds the context of {capacity} tokens")


def failure_message(exc: BaseException) -> str:
    """One short line for the client whose request failed (no traceback, no internals)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class Row:
    request: BatchRequest
    sampler: Sampler
    rules: LogitRules
    output: list[int]

    @property
    def greedy(self) -> bool:
        """The argmax of the raw logits (log-probabilities may be asked too)."""
        return not (self.request.do_sample or self.rules.active)

    @property
    def plain(self) -> bool:
        """Greedy, nothing else asked: the batch's one argmax serves it."""
        return self.greedy and self.request.logprobs is None

    def choose(self, logits: torch.Tensor, logprobs: dict) -> int:
        """This row's next token from its logits [1, V]; its log-probabilities (of the raw logits, as
        vLLM reports them) into `logprobs`."""
        token = int(self.sampler(self.rules(logits, self.request.prompt, self.output) if self.rules.active
                                 else logits)[0])
        if self.request.logprobs is not None:
            logprobs.setdefault(self.request.id, []).append(top_logprobs(logits[0], token, self.request.logprobs))
        return token
