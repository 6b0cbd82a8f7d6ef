"""Speculative decoding in the continuous batch, per row: prompt lookup proposes, one forward verifies.

Each greedy row proposes up to k tokens: the continuation of the last match of its trailing n-gram in
its prompt and output (plugins.engine.speculative.lookup_continuation, as `generate` does offline).
The step feeds every row [its next token, its proposals], padded to the longest proposal, through
the engine's verify forward, and keeps per row the proposals the model itself picks plus the
model's next token: 1 to k + 1 tokens per row per step (with log-probabilities from the same logits
where asked). A row that proposes nothing, or samples, gets its one token as in a plain step.
Rejected and padding columns stay in the pool, masked (`RowPool.holes`).

Whether a step speculates is measured, not tabled: a verify of k + 1 tokens per row costs more as
the batch grows, and pays only with enough accepted tokens. Per batch size (rounded up to a power of
two) the batch keeps the tokens/s its plain steps and its verify steps delivered (moving averages),
speculates while that beats plain decoding, and tries again after PROBE_EVERY plain steps (twice as
many after each try that loses, up to MAX_PROBE_EVERY).
`PLUGINS_SPECULATION=always` speculates at every step (the tests use it to exercise that path
whatever this machine measures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from plugins.engine.speculative import lookup_continuation

PROBE_EVERY = 16  # plain steps of one batch size before speculation is measured again ...
MAX_PROBE_EVERY = 256  # ... doubling while it keeps losing
SMOOTHING = 0.3   # weight of the newest step in the moving averages


@dataclass
class _Rates:
    plain: float | None = None   # tokens/s of plain steps
    verify: float | None = None  # tokens/s of verify steps
    plain_steps: int = 0         # since the last verify step
    probe_every: int = PROBE_EVERY


@dataclass
class RowSpeculation:
    k: int = 10
    ngram: int = 2
    steps: int = 0      # verify steps
    drafted: int = 0    # proposed tokens
    accepted: int = 0   # of them, kept
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

    def observe(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` rows (a verify step or a plain one) made `tokens` tokens in `seconds`."""
        r = self.rates.setdefault(self._bucket(rows), _Rates())
        rate = tokens / max(seconds, 1e-9)
        old = r.verify if verified else r.plain
        new = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        if verified:
            r.verify, r.plain_steps = new, 0
            if r.plain is not None:  # a try that loses waits twice as long for the next
                r.probe_every = PROBE_EVERY if new >= r.plain else min(2 * r.probe_every, MAX_PROBE_EVERY)
        else:
            r.plain, r.plain_steps = new, r.plain_steps + 1

    def proposals(self, rows) -> list[list[int]] | None:
        """Each row's proposal (empty for a row that samples or has logit rules, or has no match);
        None when this step decodes plainly (speculating does not pay at this batch size, or nothing
        is proposed)."""
        if not self.wanted(len(rows)):
            return None
        out = []
        for row in rows:
            room = row.request.max_new_tokens - len(row.output) - 1  # the model's own token always comes
            if not row.greedy or room < 1:
                out.append([])
                continue
            seq = torch.tensor(row.request.prompt + row.output)
            found = lookup_continuation(seq, min(self.k, room), self.ngram)
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
