"""Speculative decoding in the continuous batch, per row: prompt lookup proposes, one forward verifies.

Each greedy row proposes up to k tokens: the continuation of the last match of its trailing n-gram in
its prompt and output (plugins.engine.speculative.lookup_continuation, as `generate` does offline).
The step feeds every row [its next token, its proposals], padded to the longest proposal, through
the engine's verify forward (each token with the arithmetic of a one-token step), and keeps per row
the proposals the model itself would have picked plus the model's next token: 1 to k + 1 tokens per
row per step, exactly the greedy output (with log-probabilities from the same logits where asked).
A row that proposes nothing, or samples, gets its one token as in a plain step. Rejected and padding columns stay in the pool, masked (`RowPool.holes`).

Verifying costs more than a plain step as the batch grows (k + 1 tokens per row): past `max_rows`
rows the batch decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.engine.speculative import lookup_continuation

# Rows up to which a verify forward pays on the 2-core machines (SantaCoder-1B, edit-shaped
# requests: docs/results/2026-12-02-chunked-prefill.md).
MAX_ROWS = 4


@dataclass
class RowSpeculation:
    k: int = 10
    ngram: int = 2
    max_rows: int = MAX_ROWS
    steps: int = 0      # verify steps
    drafted: int = 0    # proposed tokens
    accepted: int = 0   # of them, kept

    def proposals(self, rows) -> list[list[int]] | None:
        """Each row's proposal (empty for a row that samples or has logit rules, or has no match);
        None when this step decodes plainly (too many rows, or nothing proposed)."""
        if len(rows) > self.max_rows:
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
