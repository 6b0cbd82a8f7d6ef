"""How many prompt tokens an engine step computes: the scheduler's strategy object. Whole prompts, a
fixed budget (vLLM's max_num_batched_tokens), or a budget that follows the machine: prompt tokens
per step chosen from measured step times (`AdaptiveTokenBudget`, the default).

A step that carries prompt chunks takes the decode step's time plus a cost per chunk token, and that
cost differs ~20x across the CPUs this runs on (an AMX Xeon against an AVX2-only EPYC), so no fixed
budget bounds the streams' inter-token latency everywhere. This one measures both on the running
server and lets a step's chunks cost at most `stretch - 1` decode steps: a step with chunks takes
about `stretch` times a plain decode step, so ITL p99 stays near `stretch` x p50 while prompts arrive.
Where requests keep arriving, every step may carry a chunk and no plain decode step ever happens:
then the budget asks for one step without chunks (0 tokens) to measure it.

The cost of a chunk is affine in its tokens (weights read once, then compute per token), and its
per-token estimate is remeasured every step: budget <- allowance / (observed extra seconds per
token) converges to the largest chunk that fits the allowance. The budget at most doubles per step
and a prompt's short tail (under half the budget) is not measured: one noisy reading cannot open a
stall. With no row decoding, nobody's tokens wait on the chunk, and the step takes up to `most` tokens.

The stretch bounds the wait of rows that have their first token; requests that wait for theirs wait too.
When more requests wait for a first token (admitted now or mid-prompt) than rows decode, the step
serves the larger group: up to `most` prompt tokens, as vLLM's scheduler does at every step. A burst
whose first request started a step alone is then prefilled in the next step, not a stretch-sized chunk
per step behind the one stream that got ahead (its TTFT p99 grew with the burst's size).

Where the engine runs each chunk as a forward of its own (hf, megatron, TP 2), a chunk of any size
costs a full read of the weights, about a decode step already: no chunk fits the allowance, and the
budget stays at `own_forward_tokens` (the fixed default's 128: a chunk that amortizes its weight read).

The decision is the scheduler's (one process), handed to the engine with each step, so tensor-parallel
ranks all run the same chunks.
"""

from __future__ import annotations

from typing import Protocol

from plugins.serving.step import StepResult


class TokenBudget(Protocol):
    """The scheduler's strategy for prompt tokens per step."""

    def next(self, rows: int, first_pending: int) -> float:
        """Prompt tokens the next step may compute; `rows`: rows decoding in it, `first_pending`:
        requests waiting for their first token (being prefilled or admitted with this step)."""

    def observe(self, result: StepResult) -> None:
        """The step's result: its phases' seconds and prompt tokens."""


class WholePrompts:
    """No limit: every admitted prompt is prefilled whole, in the step it is admitted."""

    def next(self, rows: int, first_pending: int) -> float:
        return float("inf")

    def observe(self, result: StepResult) -> None:
        pass


class FixedTokenBudget:
    """vLLM's `max_num_batched_tokens`: a step computes at most `tokens`, its decode rows included (a
    step with more rows still computes one prompt token)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def next(self, rows: int, first_pending: int) -> float:
        return max(self.tokens - rows, 1)

    def observe(self, result: StepResult) -> None:
        pass


class AdaptiveTokenBudget:
    def __init__(self, first: int = 16, least: int = 8, most: int = 2048, stretch: float = 1.75,
                 own_forward_tokens: int = 128):
        """`first`: the budget while the chunk cost is not known yet (small: the first chunk is a guess)."""
        if not 1 <= least <= first <= most or not 1 <= own_forward_tokens <= most or stretch <= 1:
            raise ValueError(f"need 1 <= least <= first <= most, 1 <= own_forward_tokens <= most and stretch > 1, "
                             f"got {least}, {first}, {most}, {own_forward_tokens}, {stretch}")
        self.first, self.least, self.most, self.stretch = first, least, most, stretch
        self.own_forward_tokens = own_forward_tokens
        self.decode_s: float | None = None     # seconds of a step that only decodes (moving average)
        self.token_s: float | None = None      # extra seconds per chunk token in a step (moving average)
        self.rows = 0                          # rows decoding in the step being planned
        self.queue_first = False               # this step serves the requests waiting for a first token
        self.own_forward = False               # the engine prefills chunks in forwards of their own
        self.tokens = first                    # this step's budget (the last `next()`)
        self._chunked = first                  # the budget of the last step that computed a chunk while rows decoded

    def next(self, rows: int, first_pending: int) -> float:
        self.rows = rows
        self.queue_first = 0 < rows < first_pending
        if not rows or self.queue_first:
            self.tokens = self.most
        elif self.own_forward:
            self.tokens = self.own_forward_tokens
        elif self.decode_s is None:
            self.tokens = 0   # a plain decode step: the allowance is made of its time
        elif self.token_s is None:
            self.tokens = self.first
        else:
            allowance = (self.stretch - 1) * self.decode_s
            self.tokens = int(min(max(allowance / self.token_s, self.least), self.most, 2 * self._chunked))
        return self.tokens

    def observe(self, result: StepResult) -> None:
        phases, chunk = result.seconds, result.prompt_tokens
        if not self.rows:  # no row decoded as the step began: its phases are prompts and newly placed rows
            return
        if self.queue_first:  # a decode step and a stall the stretch did not choose: not a reading of either
            return
        if chunk:
            self._chunked = self.tokens
            self.own_forward = "prefill" in phases and "decode" in phases
        if "decode" in phases:
            self.decode_s = _average(self.decode_s, phases["decode"], 0.2)
        if chunk < self.tokens / 2 or self.decode_s is None:
            return
        if "mixed" in phases:  # the chunk's share is what the step took beyond a decode step
            extra = max(phases["mixed"] - self.decode_s, 0.01 * self.decode_s)
            self.token_s = _average(self.token_s, extra / chunk, 0.5)


def token_budget(max_batched_tokens: int | str | None) -> TokenBudget:
    """The strategy for a `--max-num-batched-tokens` value: "auto", a token count, or None (whole prompts)."""
    if isinstance(max_batched_tokens, str):
        if max_batched_tokens != "auto":
            raise ValueError(f"a token budget is a count, None or 'auto', got {max_batched_tokens!r}")
        return AdaptiveTokenBudget()
    return WholePrompts() if max_batched_tokens is None else FixedTokenBudget(max_batched_tokens)


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
