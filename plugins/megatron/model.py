"""HF config (`GPTBigCodeConfig`, `Starcoder2Config`) -> megatron-core `TransformerConfig` + `GPTModel`,
and the process setup.

MQA is `num_query_groups=1` (one KV head, replicated on every TP rank); MHA is one group per
head; StarCoder2 has its GQA groups (split over TP ranks when they divide, replicated otherwise). In
every case megatron's `linear_qkv` rows per group are `[q heads | k | v]`, which is HF's
`c_attn` layout, so the weights map without reordering (converters/mapping.py; StarCoder2's q / k / v
are fused there). StarCoder2's RoPE is megatron-core's `rope` position embedding with HF's positions
(plugins/megatron/rope.py); its sliding window is part of the masks the decoders pass
(plugins/megatron/decoder.py), not megatron-core's `window_size`: 0.16.1's CPU softmax builds that
window's mask on "cuda" and drops the padding mask it was given.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from functools import partial

import torch
import torch.nn.functional as F
from transformers import GPTBigCodeConfig

from converters.mapping import check_megatron_config, padded_vocab_size
from plugins.core.config import TANH_GELUS, ConfigError, arch, head_dim, kv_heads
from plugins.core.tensors import process_group_backend, use_local_gpu
from plugins.launch.launcher import free_port
from plugins.megatron import compat
from plugins.megatron.attention import SDPAttention
from plugins.megatron.rope import PositionedRotary, hf_inv_freq

ATTENTIONS = ("sdpa", "megatron")


def check_config(config: GPTBigCodeConfig, tp_size: int, attention: str = "sdpa") -> None:
    """Everything megatron-core cannot express, refused before any weights are read."""
    check_megatron_config(config, tp_size, "mcore")  # TP vs heads and KV groups, activation, vocab padding
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be 'sdpa' or 'megatron', got {attention!r}")


def transformer_config(config: GPTBigCodeConfig, tp_size: int = 1, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = arch(config)
    return TransformerConfig(
        num_layers=a.n_layer,
        hidden_size=a.hidden,
        num_attention_heads=a.n_head,
        num_query_groups=kv_heads(config),  # 1 (MQA), n_head (MHA), or GQA (StarCoder2, converted gpt_bigcode)
        kv_channels=head_dim(config),
        ffn_hidden_size=a.inner,
        activation_func=partial(F.gelu, approximate="tanh") if a.activation in TANH_GELUS else F.gelu,
        normalization="LayerNorm",
        layernorm_epsilon=a.eps,
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_scale=None if getattr(config, "scale_attn_weights", True) else 1.0,
        attention_softmax_in_fp32=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights are loaded right after; initialising them would only cost time.
        perform_initialization=False,
        use_cpu_initialization=True,
        # CUDA-only fusions stay off on CPU.
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        sequence_parallel=False,
        cuda_graph_scope=[],  # = the default "full", without its deprecation warning
    )


def layer_spec(attention: str = "sdpa"):
    """Transformer Engine's spec with CUDA and TE installed; megatron's own modules otherwise.

    attention="sdpa" swaps the local spec's core attention for `SDPAttention` (no K/V
    expansion, see attention.py); "megatron" keeps megatron-core's `DotProductAttention`.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="LayerNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(config: GPTBigCodeConfig, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                padded_vocab: int | None = None, attention: str = "sdpa"):
    """An empty (uninitialised) GPTModel for this rank; parallel state must be set up first.

    The vocabulary is padded like Megatron does (converters.mapping.padded_vocab_size: a multiple
    of 128 * tp_size, zero rows); callers slice logits back to `config.vocab_size`.
    """
    from megatron.core.models.gpt import GPTModel

    check_config(config, tp_size, attention)
    padded_vocab = padded_vocab or padded_vocab_size(config.vocab_size, tp_size)
    if padded_vocab % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the padded vocabulary {padded_vocab}")
    a = arch(config)
    positions = {"position_embedding_type": "rope", "rotary_base": a.rope_theta, "rotary_percent": 1.0} if a.rope \
        else {"position_embedding_type": "learned_absolute"}
    model = GPTModel(
        config=transformer_config(config, tp_size, dtype),
        transformer_layer_spec=layer_spec(attention),
        vocab_size=padded_vocab,
        max_sequence_length=a.n_positions,
        share_embeddings_and_output_weights=a.tied,
        parallel_output=False,
        **positions,
    )
    if a.rope:  # HF's positions (padding skipped), HF's frequencies: plugins/megatron/rope.py
        model.rotary_pos_emb = PositionedRotary(model.rotary_pos_emb, hf_inv_freq(config))
    model.window = a.sliding_window  # the decoders' masks honour it (module doc)
    return model.to(dtype).eval()


def load_rank_state(model, state: dict, what: str = "weights") -> None:
    """Load one rank's state dict (converters.mapping names); every parameter must be covered."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]  # TE metadata, None on the local spec
    if missing or unexpected:
        raise ConfigError(f"{what} do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def init_parallel(tp_size: int, timeout_s: float = 300.0) -> int:
    """torch.distributed (gloo; NCCL beside it for CUDA tensors) + megatron parallel_state for TP = world
    size; returns the rank.

    Under torchrun the environment names the group; a plain process gets a group of one.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    compat.apply()
    if not dist.is_initialized():
        backend = process_group_backend()
        use_local_gpu()
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timedelta(seconds=timeout_s))
        # The group is ours: torn down before the interpreter exits, not by static destructors (a rank
        # whose gloo threads were still joinable then aborted: "terminate called without an active
        # exception", exit -6, about 1 run in 7 of a two-rank torchrun script here).
        atexit.register(_destroy_group)
    world = dist.get_world_size()
    if world % tp_size:
        raise ConfigError(f"tp_size {tp_size} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp_size:
            raise ConfigError(f"megatron parallel state already set up for TP="
                              f"{parallel_state.get_tensor_model_parallel_world_size()}, asked for {tp_size}")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    return parallel_state.get_tensor_model_parallel_rank()
