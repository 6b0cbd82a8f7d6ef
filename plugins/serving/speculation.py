"""Speculative decoding in the continuous batch, per row: prompt lookup or a draft model proposes, one
forward verifies.

Each greedy row proposes up to k tokens: the continuation of the last match of its trailing n-gram in
its prompt and output (plugins.engine.speculative.lookup_continuation, as `generate` does offline), or
the draft model's greedy continuation (plugins.serving.draft: every greedy row proposes).
The step feeds every row [its next token, its proposals], padded to the longest proposal, through
the engine's verify forward, and keeps per row the proposals the model itself picks plus the
model's next token: 1 to k + 1 tokens per row per step (with log-probabilities from the same logits
where asked). A row that proposes nothing, or samples, gets its one token as in a plain step.
Rejected and padding columns stay in the pool, masked (`RowPool.holes`).

Whether a step speculates is the scheduler's decision (`SpeculationPolicy`), measured, not tabled: a
verify of k + 1 tokens per row costs more as the batch grows, and pays only with enough accepted
tokens. Per batch size (rounded up to a power of two) the batch keeps the tokens/s its plain steps
and its verify steps delivered (moving averages), speculates while that beats plain decoding, and
tries again after PROBE_EVERY plain steps (twice as many after each try that loses, up to
MAX_PROBE_EVERY).
`PLUGINS_SPECULATION=always` speculates at every step (the tests use it to exercise that path
whatever this machine measures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from plugins.engine.contract import BatchDecoder
from plugins.engine.speculative import lookup_continuation
from plugins.serving.draft import propose
from plugins.serving.step import DecodeReading

PROBE_EVERY = 16  # plain steps of one batch size before speculation is measured again ...
MAX_PROBE_EVERY = 256  # ... doubling while it keeps losing
SMOOTHING = 0.3   # weight of the newest step in the moving averages


@dataclass
class _Rates:
    plain: float | None = None   # tokens/s of plain steps
    verify: float | None = None  # tokens/s of verify steps
    plain_steps: int = 0         # since the last verify step
    probe_every: int = PROBE_EVERY
    readings: dict = field(default_factory=lambda: {True: 0, False: 0})  # per kind (verified or not)


@dataclass
class SpeculationPolicy:
    """Whether the next decode step verifies proposals (the scheduler's decision), from the rates its
    readings (`StepResult.decode`) show."""

    rates: dict[int, _Rates] = field(default_factory=dict)
    always: bool = field(default_factory=lambda: os.environ.get("PLUGINS_SPECULATION", "measured") == "always")

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << (rows - 1).bit_length()

    def wanted(self, rows: int) -> bool:
        if self.always:
            return True
        r = self.rates.setdefault(self._bucket(rows), _Rates())
        if r.verify is None or r.plain is None:
            return r.verify is None  # measure each kind once
        return r.verify >= r.plain or r.plain_steps >= r.probe_every

    def observe(self, reading: DecodeReading) -> None:
        """A decode step of `rows` rows (a verify step or a plain one) made `tokens` tokens in `seconds`."""
        verified = reading.verified
        r = self.rates.setdefault(self._bucket(reading.rows), _Rates())
        rate = reading.tokens / max(reading.seconds, 1e-9)
        old = r.verify if verified else r.plain
        r.readings[verified] += 1
        # a kind's first step at a batch size runs its shapes for the first time: its second replaces it
        new = rate if old is None or r.readings[verified] <= 2 else (1 - SMOOTHING) * old + SMOOTHING * rate
        if verified:
            r.verify, r.plain_steps = new, 0
            if r.plain is not None:  # a try that loses waits twice as long for the next
                r.probe_every = PROBE_EVERY if new >= r.plain else min(2 * r.probe_every, MAX_PROBE_EVERY)
        else:
            r.plain, r.plain_steps = new, r.plain_steps + 1


@dataclass
class Proposer:
    """The runner's side: each row's proposal and what it keeps of it."""

    k: int = 10
    ngram: int = 2
    draft: BatchDecoder | None = None  # the draft model's (None: prompt lookup)
    steps: int = 0      # verify steps
    drafted: int = 0    # proposed tokens
    accepted: int = 0   # of them, kept
    catch_up_s: float = 0.0  # seconds of this step's proposals the draft spent catching up

    def proposals(self, rows, pool, fits: int) -> list[list[int]] | None:
        """Each row's proposal, at most `fits` tokens (empty for a row that samples or has logit rules,
        or has no match); None when nothing is proposed."""
        # the model's own token always comes
        rooms = [min(self.k, fits, row.left - 1) if row.greedy else 0 for row in rows]
        if max(rooms) < 1:
            return None
        if self.draft is not None:
            drafted, self.catch_up_s = propose(self.draft, pool, max(rooms))
            return [p[:room] for p, room in zip(drafted, rooms)]
        out = []
        for row, room in zip(rows, rooms):
            found = (lookup_continuation(torch.tensor(row.request.prompt + row.output), room, self.ngram)
                     if room > 0 else None)
            out.append([] if found is None else found.tolist())
        return out if any(out) else None

    def accept(self, proposal: list[int], greedy: list[int]) -> list[int]:
        """The tokens a row keeps: its leading proposals equal to the model's choice, then the model's next."""
        a = 0
        while a < len(proposal) and proposal[a] == greedy[a]:
            a += 1
        self.drafted += len(proposal)
        self.accepted += a
        return proposal[:a] + [greedy[a]]

    def stats(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted}
