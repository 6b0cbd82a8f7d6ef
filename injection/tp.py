"""Tensor-parallel shard rule for gpt_bigcode's fused c_attn (the one place it is written).

Each rank takes n_head / tp query heads. MQA: the single K/V head is replicated on every rank,
so a rank's c_attn rows are [its Q heads | K | V] (the same layout as the whole, with fewer
heads). MHA: c_attn rows are per head [q_h, k_h, v_h], so a rank's rows are one contiguous run.
Attention c_proj and MLP c_proj are split on their input dim (all-reduce after), c_fc on its
output dim: DeepSpeed's own container steps already do those.
"""

from __future__ import annotations

import torch

from plugins.core.config import check_tp, head_dim


def qkv_rows(config, rank: int, tp: int) -> torch.Tensor:
    """Indices of the c_attn output rows (HF layout) that rank `rank` of `tp` holds."""
    check_tp(config, tp)
    d, per_rank = head_dim(config), config.n_head // tp
    if config.multi_query:
        q = torch.arange(rank * per_rank * d, (rank + 1) * per_rank * d)
        return torch.cat([q, torch.arange(config.n_embd, config.n_embd + 2 * d)])
    width = 3 * d * per_rank
    return torch.arange(rank * width, (rank + 1) * width)
