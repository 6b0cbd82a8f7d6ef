"""One request of the serving engine: what it asks (`Request`, checked once, where it enters the engine:
`Request.check`) and the row that generates it (its sampler, logit rules and output so far)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugins.core.config import ConfigError
from plugins.engine.sampling import LogitRules, Sampler, top_logprobs


class RequestRefused(ConfigError):
    """A request the engine cannot take, naming the field at fault. A front end that calls the field
    otherwise (TGI's `max_new_tokens`) asks for the message with its own name."""

    def __init__(self, field: str, template: str):
        self.field, self.template = field, template
        super().__init__(template.format(name=field))

    def message(self, name: str | None = None) -> str:
        return self.template.format(name=name or self.field)


@dataclass
class Request:
    """What a slot generates for one request; `id` is the caller's. Token counts are OpenAI's names:
    `max_tokens` new tokens at most, EOS and stop tokens held back before `min_tokens`."""

    id: int
    prompt: list[int]
    max_tokens: int
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
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # stop at any of these too (returned)
    logprobs: int | None = None    # with each token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (one extra forward)
    arrival: float = 0.0           # time.monotonic() it arrived at (its time to first token counts from it)

    def check(self, capacity: int) -> None:
        """Everything a request must satisfy to be served in slots of `capacity` tokens: the engine's one
        check of it (RequestRefused), made where requests enter (ServingEngine.submit)."""
        if not self.prompt:
            raise RequestRefused("prompt", "`{name}` has no tokens")
        if self.max_tokens < 1:
            raise RequestRefused("max_tokens", f"`{{name}}` must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestRefused("min_tokens", f"`{{name}}` ({self.min_tokens}) is below 0 or above max_tokens "
                                               f"({self.max_tokens})")
        if len(self.prompt) + self.max_tokens > capacity:
            raise RequestRefused("max_tokens", f"prompt ({len(self.prompt)} tokens) + {{name}} ({self.max_tokens}) "
                                               f"exceeds this model's context of {capacity} tokens")

    def rules(self) -> LogitRules:
        stops = set(self.stop_token_ids) | ({self.eos_token_id} - {None})
        return LogitRules(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias,
                          self.min_tokens, stops)


def failure_message(exc: BaseException) -> str:
    """One short line for whoever waits on what failed (no traceback, no internals)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class Row:
    request: Request
    sampler: Sampler
    rules: LogitRules
    output: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, r: Request) -> "Row":
        return cls(r, Sampler(r.do_sample, r.temperature, r.top_k, r.top_p, r.seed, r.min_p), r.rules())

    @property
    def greedy(self) -> bool:
        """The argmax of the raw logits (log-probabilities may be asked too)."""
        return not (self.request.do_sample or self.rules.active)

    @property
    def plain(self) -> bool:
        """Greedy, nothing else asked: the batch's one argmax serves it."""
        return self.greedy and self.request.logprobs is None

    @property
    def left(self) -> int:
        """Tokens it may still make."""
        return self.request.max_tokens - len(self.output)

    def emit(self, token: int) -> str | None:
        """Take a token; the finish reason it brings ("stop": EOS or a stop token, "length"), or None."""
        self.output.append(token)
        if token in self.rules.stop_ids:
            return "stop"
        return "length" if self.left <= 0 else None

    def choose(self, logits: torch.Tensor, logprobs: dict) -> int:
        """This row's next token from its logits [1, V]; its log-probabilities (of the raw logits, as
        vLLM reports them) into `logprobs`."""
        token = int(self.sampler(self.rules(logits, self.request.prompt, self.output) if self.rules.active
                                 else logits)[0])
        if self.request.logprobs is not None:
            logprobs.setdefault(self.request.id, []).append(top_logprobs(logits[0], token, self.request.logprobs))
        return token
