"""How many prompt tokens an engine step computes: the scheduler's strategy object. Whole prompts, a
fixed budget (vLLM's max_num_batched_tokens), or the default: the budget that maximizes goodput
(requests that meet their time-to-first-token and inter-token-latency targets), from measured step
times.

`GoodputBudget`. A step that decodes `rows` rows and computes C prompt tokens takes about

    T(C) = D + F + C * tau

D: a plain decode step (moving average of the steps that only decode), tau: seconds per prompt token,
F: what a chunk costs before its first token. Where the engine runs the chunks inside the decode
step's forward (DeepSpeed's injected layers at TP 1) the weights are read once for both and F = 0;
where each chunk is a forward of its own (hf, megatron, TP 2) F is about a decode step (that forward
reads every weight too). tau is measured from the steps that carry chunks: (T - D - F) / C.

While prompts wait for their first token the step takes

    C = min(most, max(C_eff, C_itl, C_ttft))

- C_eff = e / (1 - e) * (D + F) / tau, e = 0.8: the chunk that amortizes the step's fixed cost, so
  prompt tokens per second while prefilling stay >= 80 % of a prefill alone (never smaller chunks:
  a step that reads every weight to compute 8 tokens starves the prompts).
- C_itl = (itl_slo - D - F) / tau: the most the running rows' inter-token target allows.
- C_ttft: the least that gets every waiting prompt its first token within ttft_slo of its arrival.
  Prompts are served first come first served, so prompt i finishes after the R_i prompt tokens ahead
  of it and its own are computed: R_i / C steps of T(C) each, within its slack s_i = ttft_slo - age_i:
  R_i * (D + F) / C + R_i * tau <= s_i, i.e. C >= R_i * (D + F) / (s_i - R_i * tau); a prompt already
  past saving (s_i <= R_i * tau) asks for `most`.
With no row decoding, nobody's tokens wait on the chunk: `most`. Before D is known, the first step
with rows is a plain decode step (it measures D); before tau is known, a chunk of `first` tokens. A
step of prompts alone (at least first / 2 tokens) gives tau's first reading, (T - D) / C, so a burst of
prompts arriving while the first ones are computed is not held to `first` tokens the next step.
A prompt's short tail (under half the budget) is not a reading: its fixed costs would inflate tau.

The decision is the scheduler's (one process), handed to the runner with each step, so tensor-parallel
ranks all run the same chunks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # a light module: the command-line tools read its defaults without importing torch
    from plugins.serving.step import StepResult

# defaults of the goodput targets (seconds): a completion shows its first token within 2 s of the
# request, and streams get a token at least every 0.5 s while prompts are prefilled beside them
TTFT_SLO_S = 2.0
ITL_SLO_S = 0.5
EFFICIENCY = 0.8  # prompt tokens/s while prefilling, as a share of a prefill alone


class TokenBudget(Protocol):
    """The scheduler's strategy for prompt tokens per step."""

    def next(self, rows: int, pending: list[tuple[float, int]], now: float) -> float:
        """Prompt tokens the next step may compute; `rows`: rows decoding in it, `pending`: the requests
        waiting for their first token in the order they are served, (arrival time, prompt tokens left)."""

    def observe(self, result: StepResult) -> None:
        """The step's result: its phases' seconds and prompt tokens."""


class WholePrompts:
    """No limit: every admitted prompt is prefilled whole, in the step it is admitted."""

    def next(self, rows: int, pending: list[tuple[float, int]], now: float) -> float:
        return math.inf

    def observe(self, result: StepResult) -> None:
        pass


class FixedTokenBudget:
    """vLLM's `max_num_batched_tokens`: a step computes at most `tokens`, its decode rows included (a
    step with more rows still computes one prompt token)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def next(self, rows: int, pending: list[tuple[float, int]], now: float) -> float:
        return max(self.tokens - rows, 1)

    def observe(self, result: StepResult) -> None:
        pass


class GoodputBudget:
    def __init__(self, ttft_slo: float = TTFT_SLO_S, itl_slo: float = ITL_SLO_S, most: int = 2048,
                 first: int = 256, efficiency: float = EFFICIENCY):
        if not (ttft_slo > 0 and itl_slo > 0 and 1 <= first <= most and 0 < efficiency < 1):
            raise ValueError(f"need ttft_slo > 0, itl_slo > 0, 1 <= first <= most and 0 < efficiency < 1, got "
                             f"{ttft_slo}, {itl_slo}, {first}, {most}, {efficiency}")
        self.ttft_slo, self.itl_slo, self.most, self.first = ttft_slo, itl_slo, most, first
        self.efficiency = efficiency
        self.decode_s: float | None = None  # D: a step that only decodes (moving average)
        self.token_s: float | None = None   # tau: seconds per prompt token in steps that carry chunks
        self.own_forward = False            # chunks run in forwards of their own (F = D), else F = 0
        self.rows = 0                       # rows decoding in the step being planned
        self.tokens = 0                     # this step's budget (the last `next()`)

    @property
    def chunk_s(self) -> float:
        """F: a chunk's cost before its first token."""
        return (self.decode_s or 0.0) if self.own_forward else 0.0

    def next(self, rows: int, pending: list[tuple[float, int]], now: float) -> float:
        self.rows = rows
        if not rows or not pending:
            self.tokens = self.most
        elif self.decode_s is None:
            self.tokens = 0  # one plain decode step: D is measured on it
        elif self.token_s is None:
            self.tokens = self.first
        else:
            fixed, tau = self.decode_s + self.chunk_s, self.token_s
            c_eff = self.efficiency / (1 - self.efficiency) * fixed / tau
            c_itl = (self.itl_slo - fixed) / tau
            c = max(c_eff, c_itl, self._ttft_tokens(pending, now, fixed, tau))
            self.tokens = int(min(max(c, 1), self.most))
        return self.tokens

    def _ttft_tokens(self, pending: list[tuple[float, int]], now: float, fixed: float, tau: float) -> float:
        need, ahead = 0.0, 0
        for arrival, left in pending:
            ahead += left
            slack = self.ttft_slo - (now - arrival)
            if slack <= ahead * tau:
                return math.inf  # past saving within the target: as fast as the step allows
            need = max(need, ahead * fixed / (slack - ahead * tau))
        return need

    def observe(self, result: StepResult) -> None:
        phases, chunk = result.seconds, result.prompt_tokens
        if not self.rows:  # prompts alone: a first reading of tau, their forward's fixed cost taken as D's
            if self.token_s is None and self.decode_s is not None and chunk >= self.first / 2:
                spent = sum(phases.values()) - self.decode_s
                self.token_s = max(spent, 0.01 * self.decode_s) / chunk
            return
        if chunk:
            self.own_forward = "prefill" in phases and "decode" in phases
        if "decode" in phases and (not chunk or self.own_forward):  # the decode phase alone
            self.decode_s = _average(self.decode_s, phases["decode"], 0.2)
        if not chunk or chunk < self.tokens / 2 or self.decode_s is None:
            return
        spent = phases["prefill"] - self.chunk_s if self.own_forward else phases.get("mixed", 0.0) - self.decode_s
        self.token_s = _average(self.token_s, max(spent, 0.01 * self.decode_s) / chunk, 0.5)


def token_budget(max_batched_tokens: int | str | None, ttft_slo: float = TTFT_SLO_S,
                 itl_slo: float = ITL_SLO_S) -> TokenBudget:
    """The strategy for a `--max-num-batched-tokens` value: "auto" (goodput, with these targets), a token
    count, or None (whole prompts)."""
    if isinstance(max_batched_tokens, str):
        if max_batched_tokens != "auto":
            raise ValueError(f"a token budget is a count, None or 'auto', got {max_batched_tokens!r}")
        return GoodputBudget(ttft_slo, itl_slo)
    return WholePrompts() if max_batched_tokens is None else FixedTokenBudget(max_batched_tokens)


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
