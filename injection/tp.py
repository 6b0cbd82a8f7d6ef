"""Tensor-parallel shard rules for gpt_bigcode's fused c_attn (the one place they are written).

Each rank takes n_head / tp query heads. MQA: the single K/V head is replicated on every rank,
so a rank's c_attn rows are [its Q heads | K | V] (the same layout as the whole, with fewer
heads). MHA: c_attn rows are per head [q_h, k_h, v_h], so a rank's rows are one contiguous run.
Attention c_proj and MLP c_proj are split on their input dim (all-reduce after), c_fc on its
output dim: DeepSpeed's own container steps already do those.
"""

from __future__ import annotations

import torch


def check_tp(n_head: int, tp: int) -> None:
    if tp < 1 or n_head % tp:
        raise ValueError(f"tensor parallel size {tp} does not divide n_head {n_head}: "
                         f"each rank must hold a whole number of query heads")


def qkv_rows(n_embd: int, n_head: int, multi_query: bool, rank: int, tp: int) -> torch.Tensor:
    """Indices of the c_attn output rows (HF layout) that rank `rank` of `tp` holds."""
    check_tp(n_head, tp)
    head_dim, per_rank = n_embd // n_head, n_head // tp
    if multi_query:
        q = torch.arange(rank * per_rank * head_dim, (rank + 1) * per_rank * head_dim)
        return torch.cat([q, torch.arange(n_embd, n_embd + 2 * head_dim)])
    width = 3 * head_dim * per_rank
    return torch.arange(rank * width, (rank + 1) * width)
