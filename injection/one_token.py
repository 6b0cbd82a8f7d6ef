"""An injected layer's one-token step on CPU: the kernels its op bindings run, called directly.

On CPU every op binding of the layer (injection.layer) runs our fallback, so a decode step of one
layer is nine kernel calls wrapped in seven module calls, DeepSpeed's argument handling and our
per-call checks of dtype, device and kernel choice: 0.35 ms a layer, 9 of the 23 ms of a decode step
of 8 rows of a 24-layer hidden-256 model, 15 of santacoder-1b's 150 ms (AMX Xeon, 2026-12-07).
`OneTokenStep` makes the same calls in the same order on the same tensors, so its output is the same
bits; what can be checked once is checked when it is built, for one layer and one linear choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.comm import pg_utils
from deepspeed.utils.types import NormType

from plugins import kernels
from plugins.engine.kv_cache import SingleHeadLayer
from plugins.kernels.layer_ops import compiled


class OneTokenStep:
    """`DeepSpeedGPTBigCodeInference.block` for one token per row of an MQA layer on its
    `SingleHeadLayer`, bf16 on CPU without TP: ln_1 -> c_attn -> cache write -> attention (our kernel,
    SDPA where the rung has none) -> c_proj -> ln_2 (with the residual) -> c_fc + GELU -> c_proj ->
    both residuals, the hidden states updated in place as DeepSpeed's residual add does."""

    def __init__(self, layer, impl: str):
        attn, mlp, config = layer.attention, layer.mlp, layer.config
        self.impl = impl
        self.add_layer_norm, self.add_residuals_ = compiled("add_layer_norm"), compiled("add_residuals_")
        self.attend = compiled("mqa_decode_attention")
        self.heads, self.head_dim = attn.num_attention_heads_per_partition, config.hidden_size // config.heads
        self.scale, self.eps = float(layer.scale), float(config.epsilon)
        self.ln_1, self.ln_2 = (layer.norm_w, layer.norm_b), (mlp.attn_nw, mlp.attn_nb)
        self.attn_bias, self.out_bias = attn.attn_ob, mlp.output_b
        # weights [out, in] (row-major storage of DeepSpeed's [in, out]) with the packs of their op binding
        self.qkv = (attn.attn_qkvw.t(), attn.attn_qkvb, attn.qkv_func.packs)
        self.attn_out = (attn.attn_ow.t(), None, attn.vector_matmul_func.packs)
        self.fc = (mlp.inter_w.t(), mlp.inter_b, mlp.mlp_gemm_func.packs)
        self.proj = (mlp.output_w.t(), None, mlp.mlp_gemm_func.packs)

    @staticmethod
    def fits(layer) -> bool:
        """Whether `layer` computes a one-token step the way this class does (checked once per layer)."""
        attn, mlp, config = layer.attention, layer.mlp, layer.config
        weights = (attn.attn_qkvw, attn.attn_ow, mlp.inter_w, mlp.output_w)
        return (layer.kv_heads == 1 and config.dtype == torch.bfloat16 and config.norm_type == NormType.LayerNorm
                and config.pre_layer_norm and config.mlp_after_attn and config.mp_size == 1
                and not pg_utils.is_parallel(attn.mp_group) and not pg_utils.is_parallel(mlp.mp_group)
                and layer.weights_row_major and all(w is not None and w.dtype == torch.bfloat16 for w in weights)
                and mlp.attn_nw is not None and attn.attn_ob is not None and mlp.output_b is not None
                and attn.score_context_func.window is None
                and compiled("add_layer_norm") is not None and compiled("add_residuals_") is not None)

    @staticmethod
    def takes(hidden_states, kv, mask) -> bool:
        """Whether this call is a one-token step this class computes (checked per call)."""
        return (hidden_states.shape[1] == 1 and hidden_states.dtype == torch.bfloat16
                and hidden_states.device.type == "cpu" and hidden_states.is_contiguous()
                and type(kv) is SingleHeadLayer and not torch.compiler.is_compiling()
                and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[2] == 1
                                      and mask.shape[-1] == kv.length + 1)))

    def _linear(self, x, linear, gelu: bool = False):
        weight, bias, packs = linear
        return kernels.linear(x, weight, bias, gelu, packs, self.impl)

    def __call__(self, hidden_states, kv: SingleHeadLayer, mask):
        batch, width = hidden_states.shape[0], hidden_states.shape[-1]
        heads, head_dim = self.heads, self.head_dim
        x = hidden_states.view(batch, width)
        normed = self.add_layer_norm(x, None, None, *self.ln_1, self.eps)[1]
        qkv = self._linear(normed, self.qkv)
        q_end = heads * head_dim
        key, value = kv.update(qkv[:, q_end:q_end + head_dim].view(batch, 1, 1, head_dim),
                               qkv[:, q_end + head_dim:].view(batch, 1, 1, head_dim))
        query = qkv[:, :q_end].view(batch, heads, head_dim)
        if self.attend is not None:
            allowed = None if mask is None else mask.expand(batch, 1, 1, key.shape[2])[:, 0, 0]
            context = self.attend(query, key[:, 0], value[:, 0], allowed, self.scale)
        else:
            context = F.scaled_dot_product_attention(query.unsqueeze(1), key, value, attn_mask=mask,
                                                     scale=self.scale).reshape(batch, heads * head_dim)
        attn_out = self._linear(context, self.attn_out)
        normed = self.add_layer_norm(x, attn_out, self.attn_bias, *self.ln_2, self.eps)[1]
        mlp_out = self._linear(self._linear(normed, self.fc, gelu=True), self.proj)
        self.add_residuals_(x, attn_out, self.attn_bias, mlp_out, self.out_bias)
        return hidden_states
