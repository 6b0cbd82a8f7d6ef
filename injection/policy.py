"""The kernel-injection policy and container for HF `GPTBigCodeBlock` (MQA and MHA); StarCoder2's
policy (injection/starcoder2.py) reuses the container.

DeepSpeed's `replace_transformer_layer` instantiates the policy on each `GPTBigCodeBlock`,
asks `policy_to_ds_container` for our container, and runs the container's steps (tensors,
dtype, config, module, transpose, tensor parallelism, copy). The policy only names the
block's tensors; the container adds what gpt_bigcode needs: `num_kv` (1 for MQA) and our layer.
"""

from __future__ import annotations

import torch
from deepspeed.module_inject.containers.base import BaseTransformerContainer
from deepspeed.module_inject.policy import TransformerPolicy
from deepspeed.utils.types import ActivationFuncType
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeBlock

from injection.layer import DeepSpeedGPTBigCodeInference
from injection.tp import qkv_rows
from plugins.core.config import TANH_GELUS, arch, check_tp, kv_heads, kv_heads_per_rank


class GPTBigCodePolicy(TransformerPolicy):
    _orig_layer_class = GPTBigCodeBlock

    def __init__(self, client_module, inference=True):
        super().__init__(inference, linear_layer=True, pre_attn_norm=True, mlp_act_func_type=ActivationFuncType.GELU)
        self.client_module = client_module
        if client_module is None:  # DeepSpeed's throw-away instance, made to read _orig_layer_class
            return
        config = client_module.attn.config
        if config.activation_function not in TANH_GELUS:
            raise ValueError(f"gpt_bigcode injection supports tanh GELU ({', '.join(TANH_GELUS)}), "
                             f"not activation_function={config.activation_function!r}")
        if config.add_cross_attention:
            raise ValueError("gpt_bigcode injection does not support cross-attention blocks")
        self.scale_attention = config.scale_attn_weights
        self.kv_heads = kv_heads(config)
        self.hf_config, self.layer_idx = config, client_module.attn.layer_idx

    def get_hidden_heads(self):
        block = self.client_module
        return block.attn.embed_dim, block.attn.num_heads, block.ln_1.eps, block.inner_dim

    def attention(self, enable_training=False):
        attn = self.client_module.attn
        return attn.c_attn.weight, attn.c_attn.bias, attn.c_proj.weight, attn.c_proj.bias

    def mlp(self, enable_training=False):
        mlp = self.client_module.mlp
        return mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias

    def layernorm(self):
        block = self.client_module
        return block.ln_2.weight, block.ln_2.bias, block.ln_1.weight, block.ln_1.bias


class GPTBigCodeContainer(BaseTransformerContainer):
    """Our layer in place of the block; its policy names the HF config (`hf_config`) and layer index."""

    layer_class = DeepSpeedGPTBigCodeInference

    def create_ds_model_config(self):
        check_tp(self.policy.hf_config, self.mp_size)
        super().create_ds_model_config()
        self.ds_model_config.num_kv = self.policy.kv_heads  # [Q | K(num_kv) | V(num_kv)] sizes attn_qkvw
        self.ds_model_config.scale_attention = self.scale_attention
        return self.ds_model_config

    def create_module(self, config=None):
        config = config if config is not None else self.ds_model_config
        head_dim = config.hidden_size // config.heads
        shape = arch(self.policy.hf_config)
        self.module = self.layer_class(
            config, mp_group=self.mp_group, layer_idx=self.policy.layer_idx,
            kv_heads=kv_heads_per_rank(self.policy.hf_config, self.mp_size), max_positions=shape.n_positions,
            scale=head_dim ** -0.5 if self.scale_attention else 1.0)
        self.module.attention.score_context_func.window = shape.sliding_window
        return self.module

    def attention_qkv_mp(self, mp_replace, reversed_dim=False):
        # Upstream strided_copy cuts [Q|K|V] into 3 equal parts (wrong for MQA and GQA, whose K and V have
        # fewer heads); take this rank's rows by our shard rule instead.
        rows = qkv_rows(self.policy.hf_config, mp_replace.gpu_index, self.mp_size)
        attn = self.module.attention
        device = attn.attn_qkvw.device
        attn.attn_qkvw = torch.nn.Parameter(self.qkvw[:, rows].contiguous().to(device), requires_grad=False)
        attn.attn_qkvb = torch.nn.Parameter(self.qkvb[rows].contiguous().to(device), requires_grad=False)
