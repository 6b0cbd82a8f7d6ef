"""A draft model beside the target in a continuous batch (speculative decoding with a model draft).

`DraftedDecoder` is the target's `BatchDecoder` with the draft's K and V among its pool tensors, so
the pool moves, compacts and packs them with the target's. Everything else is the target's: prompts
and chunks are prefilled by the target alone, and the draft runs only when the batch speculates
(`propose`): it first computes the prompt of each row placed since it last ran (one prefill per row,
so a batch that never speculates never pays for the draft), then catches up on the columns of the
plain steps since it last proposed (`RowPool.drafted`, from `RowPool.ids`), then drafts k tokens one
by one. The catching up stays out of the verify steps' measured rate (plugins.serving.speculation):
it is what probing costs. What the draft computes decides only how many proposals the target
accepts; every kept token is the target's own choice.
"""

from __future__ import annotations

import time

import torch

from plugins.core.config import ConfigError


class DraftedDecoder:
    def __init__(self, target, draft):
        if (target.batch_dim, target.time_dim) != (draft.batch_dim, draft.time_dim):
            raise ConfigError("the draft model's KV pool layout differs from the target's")
        self.target, self.draft = target, draft
        self.batch_dim, self.time_dim = target.batch_dim, target.time_dim
        self.fuses_chunks = getattr(target, "fuses_chunks", False)
        self.prefill_alone, self.decode, self.verify = target.prefill_alone, target.decode, target.verify
        if self.fuses_chunks:
            self.mixed = target.mixed

    def pool_tensors(self):
        return self.target.pool_tensors() + self.draft.pool_tensors()


@torch.inference_mode()
def propose(draft, pool, k: int) -> tuple[list[list[int]], float]:
    """k tokens per active row of `pool` from the draft (its greedy continuation), written at the
    columns [t, t + k) of its own K and V; the caller keeps room for them (and the verify column).
    Also returns the seconds it spent catching up (the prompts of new rows, the columns of plain
    steps): what probing costs, not what speculating costs, as the batch only then falls behind."""
    n, t = pool.n, pool.t
    mask = pool.mask[:n]
    start = time.perf_counter()
    for r in pool.undrafted[:n].nonzero().flatten().tolist():  # its columns before `drafted`, alone
        cols = mask[r, :pool.drafted].nonzero().squeeze(-1)
        if len(cols):
            _, kv = draft.prefill_alone(pool.ids[r, cols][None])
            for pooled, part in zip(draft.pool_tensors(), kv):
                pooled.narrow(draft.batch_dim, r, 1).index_copy_(draft.time_dim, cols, part)
        pool.undrafted[r] = False
    mask[:, t:t + k] = 1
    try:
        positions = (mask[:, :t + 1].cumsum(-1) - 1).clamp(min=0)  # a token's position: unmasked columns before it
        # after speculative steps the draft is one column behind (the last accepted proposal): that
        # column rides along with the first proposal; after plain steps it catches up first
        seen = pool.drafted
        if seen < t - 1:
            draft.verify(pool.ids[:n, seen:t - 1], mask[:, :t - 1], positions[:, seen:t - 1])
            seen = t - 1
        catch_up_s = time.perf_counter() - start
        tokens = torch.cat([pool.ids[:n, seen:t], pool.last[:n]], 1)
        logits = draft.verify(tokens, mask[:, :t + 1], positions[:, seen:t + 1])
        token = logits[:, -1].float().argmax(-1, keepdim=True)
        drafted = [token]
        for i in range(1, k):
            token = draft.decode(token, mask[:, :t + i + 1], pool.pos[:n] + i).float().argmax(-1, keepdim=True)
            drafted.append(token)
    finally:
        mask[:, t:t + k] = 0
    pool.drafted = t + k
    return torch.cat(drafted, 1).tolist(), catch_up_s
