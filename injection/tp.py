"""Tensor-parallel shard rule for the fused QKV projection (the one place it is written).

Each rank takes n_head / tp query heads. gpt_bigcode MQA (`c_attn` [Q | K | V]) and StarCoder2 (q_proj,
k_proj, v_proj fused by the policy as [Q | K (kv heads) | V (kv heads)]) share one layout: a rank's rows
are [its Q heads | its K heads | its V heads], where its KV heads are its share when the KV heads split
evenly over the ranks, else the one KV head of its query heads' group, replicated on the ranks of that
group (MQA: the single K/V head on every rank). gpt_bigcode MHA: c_attn rows are per head [q_h, k_h,
v_h], so a rank's rows are one contiguous run. Attention c_proj and MLP c_proj are split on their input
dim (all-reduce after), c_fc on its output dim: DeepSpeed's own container steps already do those.
"""

from __future__ import annotations

import torch

from plugins.core.config import ConfigError, arch, check_tp


def kv_heads_of_rank(config, rank: int, tp: int) -> list[int]:
    """The KV heads (of the whole model) rank `rank` of `tp` holds."""
    g = arch(config).kv_heads
    if g % tp == 0:
        return list(range(rank * g // tp, (rank + 1) * g // tp))
    return [rank // (tp // g)]


def qkv_rows(config, rank: int, tp: int) -> torch.Tensor:
    """Indices of the fused QKV output rows (the layout above) that rank `rank` of `tp` holds."""
    check_tp(config, tp)
    a = arch(config)
    d, per_rank = a.head_dim, a.n_head // tp
    if a.family == "gpt_bigcode" and a.kv_heads == a.n_head > 1:  # MHA: per head [q, k, v]
        width = 3 * d * per_rank
        return torch.arange(rank * width, (rank + 1) * width)
    q_end = a.n_head * d
    heads = kv_heads_of_rank(config, rank, tp)
    k = [torch.arange(q_end + h * d, q_end + (h + 1) * d) for h in heads]
    v = [torch.arange(q_end + (a.kv_heads + h) * d, q_end + (a.kv_heads + h + 1) * d) for h in heads]
    return torch.cat([torch.arange(rank * per_rank * d, (rank + 1) * per_rank * d), *k, *v])


def check_autotp(config, tp_size: int) -> None:
    """What DeepSpeed AutoTP can shard (injection.autotp): `check_tp`, and for StarCoder2 KV heads that split
    evenly over the ranks (upstream's grain is the KV head: it would cut heads apart otherwise)."""
    check_tp(config, tp_size)
    a = arch(config)
    if a.family == "starcoder2" and a.kv_heads % tp_size:
        raise ConfigError(f"deepspeed-autotp splits StarCoder2's {a.kv_heads} KV heads over the ranks: tp_size "
                          f"{tp_size} does not divide them (the deepspeed backend replicates KV heads: use it)")
