"""A core-attention module for megatron-core's local layer spec, on torch SDPA, without KV expansion.

megatron-core's local `DotProductAttention` expands K and V to every query head
(`repeat_interleave`, a full copy of the cache per layer and step) and runs `baddbmm` on
transposed strided views that CPU BLAS copies again: on SantaCoder-1B (bf16, bs16) that is more
than half of a decode step. Here each KV group attends as one head: its query heads are stacked
along the query axis, so K and V are never expanded (the MQA cache stays one head).
It plugs into the spec where Transformer Engine's attention would (`core_attention`). A one-token
step on an MQA cache in bf16 on CPU runs our decode kernel (plugins.kernels.layer_ops) instead of SDPA.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from plugins.kernels import layer_ops


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, **unused):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.softmax_scale  # None: 1/sqrt(d)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, heads, d], key/value [sk, b, groups, d] (this rank's share), attention_mask
        bool [b, 1, sq, sk] with True = masked -> [sq, b, heads * d]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias")
        sq, b, heads, d = query.shape
        groups = key.shape[2]
        if sq == 1 and groups == 1:
            # [b, heads, d] against the cache read as [b, sk, d] (a strided view, nothing copied)
            allowed = None if attention_mask is None else ~attention_mask.expand(b, 1, 1, key.shape[0])[:, 0, 0]
            out = layer_ops.mqa_decode_attention(query[0], key[:, :, 0].transpose(0, 1), value[:, :, 0].transpose(0, 1),
                                                 allowed, self.scale if self.scale is not None else d ** -0.5)
            if out is not None:
                return out.view(1, b, heads * d)
        per_group = heads // groups
        # Query heads of a group are adjacent in megatron's layout: [b, groups, per_group * sq, d].
        q = query.permute(1, 2, 0, 3).reshape(b, groups, per_group * sq, d)
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        if groups > 1:
            # megatron's cache is [sk, b, groups, d]: as [b, groups, sk, d] each key row sits b * groups * d
            # elements after the previous one, and with several groups SDPA's CPU kernel reads that ~2x
            # slower than a copy plus a contiguous read (measured MHA bs1-16). With one group (MQA) the
            # copy costs more than it saves.
            k, v = k.contiguous(), v.contiguous()
        allowed = ~attention_mask  # [b, 1, sq, sk]; rows repeat for each head of the group
        if sq > 1 and per_group > 1:
            allowed = (allowed.unsqueeze(2).expand(b, 1, per_group, sq, allowed.shape[-1])
                       .reshape(b, 1, per_group * sq, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return out.view(b, heads, sq, d).permute(2, 0, 1, 3).reshape(sq, b, heads * d)
