"""Kernel injection for HF `Starcoder2DecoderLayer` (StarCoder2: GQA, RoPE, sliding-window attention).

The gpt_bigcode machinery with three differences:
- the policy fuses `q_proj`, `k_proj`, `v_proj` into one [Q | K (kv heads) | V (kv heads)] projection, so
  the layer runs one QKV GEMM; under TP each rank keeps its query heads and its KV heads (split when the
  KV heads divide evenly over the ranks, else its group's head replicated: injection/tp.py);
- the layer rotates the fused projection's queries and keys with the cos / sin HF's model computes from
  the position ids (`position_embeddings`, as `Starcoder2Attention` does), before K is cached;
- `GQASoftmaxContextOp` reads that layout; SDPA's grouped-query attention attends each KV head with its
  group's query heads, so the cache ([B, KV heads, capacity, d], preallocated) is never expanded; with
  one KV head per rank it is the MQA path (our decode kernel).
The window: HF's masks carry it (`create_sliding_window_causal_mask`), our decoders' masks carry it
(plugins/deepspeed/decoder.py), and the op applies it where it builds the causal mask itself.
"""

from __future__ import annotations

import torch
from deepspeed.module_inject.policy import TransformerPolicy
from deepspeed.utils.types import ActivationFuncType
from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2DecoderLayer

from injection.layer import DeepSpeedGPTBigCodeInference, MQASoftmaxContextOp
from injection.policy import GPTBigCodeContainer
from plugins.core.config import TANH_GELUS, arch, check_hf_config, kv_heads


class Starcoder2Policy(TransformerPolicy):
    _orig_layer_class = Starcoder2DecoderLayer

    def __init__(self, client_module, inference=True):
        super().__init__(inference, linear_layer=True, pre_attn_norm=True, mlp_act_func_type=ActivationFuncType.GELU)
        self.client_module = client_module
        if client_module is None:  # DeepSpeed's throw-away instance, made to read _orig_layer_class
            return
        config = client_module.self_attn.config
        check_hf_config(config, "starcoder2 injection")  # biases, default RoPE
        if config.hidden_act not in TANH_GELUS:
            raise ValueError(f"starcoder2 injection supports tanh GELU ({', '.join(TANH_GELUS)}), "
                             f"not hidden_act={config.hidden_act!r}")
        self.scale_attention = True  # Starcoder2Attention scales by head_dim ** -0.5
        self.kv_heads = kv_heads(config)
        self.hf_config, self.layer_idx = config, client_module.self_attn.layer_idx

    def get_hidden_heads(self):
        layer, a = self.client_module, arch(self.hf_config)
        return a.hidden, a.n_head, layer.input_layernorm.eps, a.inner

    def attention(self, enable_training=False):
        attn = self.client_module.self_attn
        qkvw = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        qkvb = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        return qkvw, qkvb, attn.o_proj.weight, attn.o_proj.bias

    def mlp(self, enable_training=False):
        mlp = self.client_module.mlp
        return mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias

    def layernorm(self):
        layer = self.client_module
        return (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias,
                layer.input_layernorm.weight, layer.input_layernorm.bias)


class GQASoftmaxContextOp(MQASoftmaxContextOp):
    """Attention on [Q (heads) | K (kv heads) | V (kv heads)] rows, whatever the number of KV heads."""

    per_head_qkv = False


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(qkv, cos, sin, heads: int, kv_heads: int, head_dim: int):
    """The fused projection with its queries and keys rotated as HF's `apply_rotary_pos_emb` rotates them
    (cos / sin [B, T, d] from the model's rotary embedding, in the activations' dtype)."""
    batch, q_len, _ = qkv.shape
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    cos, sin = cos[:, :, None].to(qkv.dtype), sin[:, :, None].to(qkv.dtype)
    q = qkv[..., :q_end].view(batch, q_len, heads, head_dim)
    k = qkv[..., q_end:k_end].view(batch, q_len, kv_heads, head_dim)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    return torch.cat([q.flatten(2), k.flatten(2), qkv[..., k_end:]], -1)


class DeepSpeedStarcoder2Inference(DeepSpeedGPTBigCodeInference):
    """DeepSpeed's inference layer, called the way transformers 5.x calls `Starcoder2DecoderLayer`:
    `(hidden_states, attention_mask=<4-D mask>, position_ids=..., cache=<Cache>, position_embeddings=(cos,
    sin), ...)`, returning the hidden states tensor."""

    context_op = GQASoftmaxContextOp

    def forward(self, hidden_states=None, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, past_key_values=None, **kwargs):
        if position_embeddings is None:
            raise ValueError("the injected starcoder2 layer needs the model's position_embeddings (cos, sin)")
        cos, sin = position_embeddings
        heads, d = self.attention.num_attention_heads_per_partition, self.config.hidden_size // self.config.heads

        def rope(qkv):
            return rotary(qkv, cos, sin, heads, self.kv_heads, d)

        return self.block(hidden_states, cache if cache is not None else past_key_values, attention_mask, rope)


class Starcoder2Container(GPTBigCodeContainer):
    layer_class = DeepSpeedStarcoder2Inference
