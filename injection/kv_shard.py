"""Batch-sharded MQA attention under injected tensor parallelism (Pope et al. 2022, "Efficiently
Scaling Transformer Inference", multiquery attention partitioning).

Replicated layout ("head", the default and what every engine does): each of N ranks holds
n_head / N query heads for all B sequences and, MQA having one KV head, caches K/V of all B
sequences: the cache per rank does not shrink with N.

Batch layout ("batch"): the projections stay head-sharded (c_attn gives each rank its query heads
and the replicated K/V rows, for all B sequences), then
  1. an all-to-all moves the queries to batch-sharded: each rank gets all heads of B/N sequences;
  2. each rank attends over the KV cache of only its B/N sequences (1/N of the replicated cache);
  3. an all-to-all moves the attention output back to head-sharded, for the row-parallel c_proj
     and its all-reduce, which the layer does as before.
K/V need no communication: every rank computes them for all B and keeps its own rows.

B not divisible by N: padded internally to N * ceil(B / N) by repeating the last sequence (so
every padding row is a real, finite attention problem); the padding is dropped after step 3.
Each rank caches ceil(B / N) sequences.

    engine = deepspeed.init_inference(model, replace_with_kernel_inject=True, tensor_parallel={"tp_size": 2}, ...)
    injection.kv_shard.shard_kv_by_batch(engine.module)
    # or: plugins.load_backend("deepspeed", hf_dir, tp_size=2, kv_layout="batch")

torch.distributed's gloo backend supports `all_to_all_single` (bf16 and fp32 included), used here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plugins.core.config import KV_LAYOUTS, ConfigError


class KVLayoutError(ConfigError):
    """A KV layout that cannot apply to this model or TP size."""


def check_kv_layout(kv_layout: str, multi_query: bool, tp_size: int) -> None:
    """Raise KVLayoutError before any work when `kv_layout` cannot apply to this model / TP size."""
    if kv_layout not in KV_LAYOUTS:
        raise KVLayoutError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if kv_layout == "batch" and not multi_query:
        raise KVLayoutError("kv_layout='batch' is for multi-query attention (one KV head); an MHA model's "
                            "KV cache is already head-sharded over the TP ranks")
    if kv_layout == "batch" and tp_size < 2:
        raise KVLayoutError("kv_layout='batch' shards the KV cache over tensor-parallel ranks: needs tp_size >= 2")


def rank_batch(batch: int, tp_size: int) -> int:
    """Sequences each rank caches in the batch layout (the batch is padded up to a multiple of tp_size)."""
    return -(-batch // tp_size)


class BatchShardedContext(torch.nn.Module):
    """Wraps the layer's MQA attention op (`MQASoftmaxContextOp`, same call) with the two all-to-alls.

    In: the fused c_attn output of this rank [B, T, heads*d + 2d] (its `heads` query heads, K, V).
    Out: the attention output of its heads for all B sequences [B, T, heads*d], as the replicated op.
    """

    def __init__(self, attend: torch.nn.Module, group, head_dim: int):
        super().__init__()
        self.attend = attend
        self.group = group
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.head_dim = head_dim

    def forward(self, qkv, mask, kv, heads: int, kv_heads: int, scale: float):
        batch, q_len, _ = qkv.shape
        tp, per, width = self.tp, rank_batch(batch, self.tp), heads * self.head_dim
        padded = per * tp
        if padded != batch:  # repeat the last sequence; dropped at the end
            rows = torch.arange(padded, device=qkv.device).clamp_(max=batch - 1)
            qkv = qkv[rows]
            mask = mask[rows] if mask is not None and mask.shape[0] != 1 else mask
        mine = slice(self.rank * per, (self.rank + 1) * per)
        if kv is not None:
            if kv.is_initialized and kv.keys.shape[0] != per:
                raise ValueError(f"batch-sharded KV: this rank caches {per} of {batch} sequences but its cache holds "
                                 f"{kv.keys.shape[0]}; size it with batch=injection.kv_shard.rank_batch(B, tp_size)")
            kv.reorder_cache = _no_beam_search  # beam indices address all B rows; this cache holds B / N of them
        # 1. queries head-sharded [tp x per, T, my heads] -> batch-sharded [per, T, tp x heads] (rank i: heads i*h..)
        q_send = qkv[..., :width].reshape(tp, per, q_len, width).contiguous()
        q_recv = torch.empty_like(q_send)
        dist.all_to_all_single(q_recv, q_send, group=self.group)
        query = q_recv.permute(1, 2, 0, 3).reshape(per, q_len, tp * width)
        # 2. attention of my sequences over my cache: K/V rows were computed for every sequence on every rank
        local = torch.cat([query, qkv[mine, :, width:]], dim=-1)
        local_mask = mask[mine] if mask is not None and mask.shape[0] != 1 else mask
        out = self.attend(local, local_mask, kv, tp * heads, kv_heads, scale)  # [per, T, tp x heads x d]
        # 3. back to head-sharded: rank i gets its heads for every sequence
        o_send = out.view(per, q_len, tp, width).permute(2, 0, 1, 3).contiguous()
        o_recv = torch.empty_like(o_send)
        dist.all_to_all_single(o_recv, o_send, group=self.group)
        return o_recv.view(padded, q_len, width)[:batch]


def _no_beam_search(beam_idx):
    raise NotImplementedError("beam search is not supported with kv_layout='batch' (a rank caches only its own "
                              "sequences); use greedy or sampling, or kv_layout='head'")


def shard_kv_by_batch(model) -> None:
    """Switch every injected gpt_bigcode layer of `model` (after `deepspeed.init_inference(...,
    replace_with_kernel_inject=True, tensor_parallel={"tp_size": N})`, N >= 2) to batch-sharded KV."""
    from deepspeed.comm import pg_utils

    from injection.layer import DeepSpeedGPTBigCodeInference

    layers = [m for m in model.modules() if isinstance(m, DeepSpeedGPTBigCodeInference)]
    if not layers:
        raise KVLayoutError("kv_layout='batch' needs the injected gpt_bigcode layers "
                            "(deepspeed.init_inference(..., replace_with_kernel_inject=True) "
                            "after injection.register())")
    for layer in layers:
        attn = layer.attention
        if layer.kv_heads != 1:
            raise KVLayoutError("kv_layout='batch' is for multi-query attention (one KV head)")
        if not pg_utils.is_parallel(attn.mp_group):
            raise KVLayoutError("kv_layout='batch' needs tensor parallelism (tp_size >= 2)")
        if not isinstance(attn.score_context_func, BatchShardedContext):
            head_dim = layer.config.hidden_size // layer.config.heads
            attn.score_context_func = BatchShardedContext(attn.score_context_func, attn.mp_group, head_dim)
