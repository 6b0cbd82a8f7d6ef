"""The rows of a continuous batch on a preallocated KV pool, on one shared time axis.

The pool is `slots` rows x `capacity` columns per layer, allocated once by the engine's
`BatchDecoder`. Active rows are [0, n); every decode step writes each row's new token at column `t`,
and a row's tokens sit in columns [start, t) (left padding, masked). So each engine decodes the batch
exactly as it decodes a static left-padded batch: a dense [n, .., t + 1, ..] cache and a [n, t + 1]
mask, no per-row lengths, no gathers.

- A new row's prompt KV is copied in at columns [t - P, t); a prompt longer than `t` shifts the
  running rows right first.
- Release: the last active row moves into the freed row, so rows stay packed.
- Room: when the next step's columns do not fit (or half of every row is waste) the rows move left
  by their common padding; after speculative steps, whose rejected columns stay masked (holes), each
  row's tokens are packed to the right instead (a gather per row). Every request fits (prompt +
  max_new_tokens <= capacity), so a decode step always finds its column.
- A speculative draft model's K and V are pool tensors too (plugins.serving.draft), so every move
  above moves them alike. The draft runs only when it proposes: `drafted` says up to which column
  every row holds its K and V (but rows `undrafted`, placed since, whose prompt it has not seen), and
  `ids` keeps each column's token for it to catch up from.
"""

from __future__ import annotations

import torch

from plugins.core.tensors import tensor_bytes
from plugins.engine.contract import BatchDecoder


class RowPool:
    def __init__(self, decoder: BatchDecoder, slots: int, capacity: int, device="cpu"):
        self.decoder, self.capacity = decoder, capacity
        self.mask = torch.zeros((slots, capacity), dtype=torch.long, device=device)
        self.last = torch.zeros((slots, 1), dtype=torch.long, device=device)  # each row's token not yet cached
        self.pos = torch.zeros((slots, 1), dtype=torch.long, device=device)   # ... and its position
        self.n = 0      # active rows
        self.t = 0      # columns in use
        self.holes = False  # masked columns inside rows (rejected speculative tokens)
        self.ids = torch.zeros((slots, capacity), dtype=torch.long, device=device)  # each column's token
        self.drafted = 0    # columns [0, drafted) hold the draft model's K and V in every active row ...
        self.undrafted = torch.zeros(slots, dtype=torch.bool, device=device)  # ... but these

    def add(self, kv: list[torch.Tensor], token: int, prompt: list[int]) -> int:
        """A new row: the K and V of its prompt's columns (`pool_tensors` order; the target's only: a
        draft's come when it runs) and its next token."""
        length = len(prompt)
        if length > self.t:
            self._shift(length - self.t)  # (n == 0: nothing moves, t becomes length)
        i = self.n
        for pool, part in zip(self.decoder.pool_tensors(), kv):
            self._cols(self._row(pool, i), self.t - length, self.t).copy_(part)
        self.mask[i].zero_()
        self.mask[i, self.t - length:self.t] = 1
        self.ids[i, self.t - length:self.t] = torch.tensor(prompt, dtype=torch.long)
        self.last[i, 0] = token
        self.pos[i, 0] = length
        self.undrafted[i] = True
        self.n += 1
        return i

    def remove(self, r: int) -> None:
        """Drop row r: the last row moves into it (the caller moves its own per-row state the same way)."""
        last = self.n - 1
        if r != last:
            for pool in self.decoder.pool_tensors():
                self._cols(self._row(pool, r), 0, self.t).copy_(self._cols(self._row(pool, last), 0, self.t))
            for buf in (self.mask, self.ids, self.last, self.pos, self.undrafted):
                buf[r] = buf[last]
        self.n -= 1
        if not self.n:
            self.t, self.holes, self.drafted = 0, False, 0

    def room(self, columns: int) -> int:
        """Make room for `columns` more columns where it can; returns how many fit now."""
        if self.t + columns > self.capacity:
            self._pack() if self.holes else self._shift(-self._padding())
        return self.capacity - self.t

    def tidy(self) -> None:
        """After a step: move left once half of the columns in use are waste."""
        if not self.n:
            return
        if self.holes:
            if (self.t - int(self.mask[:self.n, :self.t].sum(-1).max())) * 2 >= self.t:
                self._pack()
        elif self._padding() * 2 >= self.t:
            self._shift(-self._padding())

    def _padding(self) -> int:
        """Columns before the first token of every active row."""
        n, t = self.n, self.t
        return int(self.mask[:n, :t].argmax(-1).min()) if n else 0

    def _shift(self, by: int) -> None:
        """Move the columns of every active row `by` to the right (left when negative)."""
        n, t = self.n, self.t
        if by == 0:
            return
        if n:
            lo = max(0, -by)  # columns [lo, t) move to [lo + by, t + by)
            for pool in self.decoder.pool_tensors() + [self.mask, self.ids]:
                rows = pool.narrow(self._batch_dim(pool), 0, n)
                src = self._cols(rows, lo, t).clone()
                self._cols(rows, lo + by, t + by).copy_(src)
            if by > 0:
                self.mask[:n, :by] = 0
        self.t = t + by
        self.drafted = max(0, self.drafted + by)

    def _pack(self) -> None:
        """Every row's unmasked columns, in order, moved to the right end of [0, t'), t' the most any
        row holds: padding and holes go."""
        n, t = self.n, self.t
        keep = [self.mask[r, :t].nonzero().squeeze(-1) for r in range(n)]
        end = max(len(k) for k in keep)
        drafted = end
        for r, cols in enumerate(keep):
            for pool in self.decoder.pool_tensors():
                row = self._row(pool, r)
                self._cols(row, end - len(cols), end).copy_(row.index_select(self.decoder.time_dim, cols))
            self.ids[r, end - len(cols):end] = self.ids[r, cols]
            self.mask[r, :t] = 0
            self.mask[r, end - len(cols):end] = 1
            # the row's columns the draft had computed stay in front of those it had not
            drafted = min(drafted, end - len(cols) + int((cols < self.drafted).sum()))
        self.t, self.holes, self.drafted = end, False, drafted

    def _batch_dim(self, tensor) -> int:
        return 0 if tensor is self.mask or tensor is self.ids else self.decoder.batch_dim

    def _row(self, tensor, i: int) -> torch.Tensor:
        return tensor.narrow(self._batch_dim(tensor), i, 1)

    def _cols(self, tensor, start: int, end: int) -> torch.Tensor:
        dim = 1 if tensor.dim() == 2 else self.decoder.time_dim  # the mask is [rows, columns]
        return tensor.narrow(dim, start, end - start)

    def nbytes(self) -> int:
        return tensor_bytes(self.decoder.pool_tensors())
