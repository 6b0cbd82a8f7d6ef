"""DeepSpeed AutoTP (replace_with_kernel_inject=False, tensor_parallel) on gpt_bigcode, balanced.

    engine = injection.autotp.init_autotp(model, tp_size=2, dtype=torch.float32)

Upstream AutoTP uses the config's kv-head count as the shard grain of attention weights; with
MQA's single KV head that gives every query head and the whole attention c_proj to rank 0. While
AutoTP shards, the config reports n_head as the grain, so each rank gets n_head / tp whole query
heads (its 'bigcodetype' split still replicates the one K/V head). MHA's per-head [q, k, v] c_attn
is split as whole heads (compat.mha_bigcode_qkv_as_bloom). Afterwards the HF attention modules
are told their per-rank head counts (AutoTP updates `num_heads` / `embed_dim` only).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from injection import compat
from plugins.core.config import check_tp


@contextmanager
def _head_grain(config):
    saved = config.num_key_value_heads
    config.num_key_value_heads = config.n_head
    try:
        with compat.mha_bigcode_qkv_as_bloom(not config.multi_query):
            yield
    finally:
        config.num_key_value_heads = saved


def init_autotp(model, tp_size: int, dtype: torch.dtype = torch.float32, **kwargs):
    import deepspeed

    check_tp(model.config, tp_size)
    compat.patch_comm()
    with _head_grain(model.config):
        engine = deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=False,
                                          tensor_parallel={"tp_size": tp_size}, **kwargs)
    for block in engine.module.transformer.h:
        attn = block.attn
        if not attn.multi_query:
            attn.kv_heads = attn.num_heads
            attn.kv_dim = attn.kv_heads * attn.head_dim
        attn.num_key_value_groups = attn.num_heads // attn.kv_heads
    return engine
