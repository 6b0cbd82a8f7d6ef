"""DeepSpeed AutoTP (replace_with_kernel_inject=False, tensor_parallel): gpt_bigcode balanced, StarCoder2 as is.

    engine = injection.autotp.init_autotp(model, tp_size=2, dtype=torch.float32)

gpt_bigcode: upstream AutoTP uses the config's kv-head count as the shard grain of attention weights;
with MQA's single KV head that gives every query head and the whole attention c_proj to rank 0. While
AutoTP shards, the config reports n_head as the grain, so each rank gets n_head / tp whole query
heads (its 'bigcodetype' split still replicates the one K/V head). MHA's per-head [q, k, v] c_attn
is split as whole heads (compat.mha_bigcode_qkv_as_bloom). Afterwards the HF attention modules
are told their per-rank head counts (AutoTP updates `num_heads` / `embed_dim` only).

StarCoder2 (GQA, separate q / k / v projections): upstream's grain, `num_key_value_heads`
(deepspeed/module_inject/tp_shard.py: get_shard_size), is right when tp divides the KV heads: each rank
takes KV heads / tp whole KV heads and the query heads of their groups from q_proj, k_proj and v_proj
(rows), the same run of o_proj's input columns, an even split of the MLP, and `tp_parser` makes o_proj
and mlp.c_proj the all-reduced linears. HF's `Starcoder2Attention` reads only `head_dim` and
`num_key_value_groups` (unchanged per rank), so nothing is patched. Where tp does not divide the KV
heads, upstream would cut heads apart: `injection.tp.check_autotp` refuses it before any work.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from injection import compat
from injection.tp import check_autotp
from plugins.core.config import arch


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

    check_autotp(model.config, tp_size)
    compat.patch_comm()
    if arch(model.config).family == "starcoder2":  # upstream's KV-head grain (module doc)
        return deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=False,
                                        tensor_parallel={"tp_size": tp_size}, **kwargs)
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
