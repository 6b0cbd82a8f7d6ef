"""HF `GPTBigCodeConfig` -> megatron-core `TransformerConfig` + `GPTModel`, and the process setup.

MQA is `num_query_groups=1` (one KV head, replicated on every TP rank); MHA is one group per
head. In both cases megatron's `linear_qkv` rows per group are `[q heads | k | v]`, which is HF's
`c_attn` layout, so the weights map without reordering (converters/mapping.py).
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
from plugins.core.config import TANH_GELUS, ConfigError, head_dim, kv_heads
from plugins.core.tensors import process_group_backend, use_local_gpu
from plugins.launch.launcher import free_port
from plugins.megatron import compat
from plugins.megatron.attention import SDPAttention

ATTENTIONS = ("sdpa", "megatron")


def check_config(config: GPTBigCodeConfig, tp_size: int, attention: str = "sdpa") -> None:
    """Everything megatron-core cannot express, refused before any weights are read."""
    check_megatron_config(config, tp_size, "mcore")  # TP vs heads and KV groups, activation, vocab padding
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be 'sdpa' or 'megatron', got {attention!r}")


def transformer_config(config: GPTBigCodeConfig, tp_size: int = 1, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=config.n_layer,
        hidden_size=config.n_embd,
        num_attention_heads=config.n_head,
        num_query_groups=kv_heads(config),  # 1 (MQA), n_head (MHA), or a converted GQA count
        kv_channels=head_dim(config),
        ffn_hidden_size=config.n_inner or 4 * config.n_embd,
        activation_func=(partial(F.gelu, approximate="tanh") if config.activation_function in TANH_GELUS
                         else F.gelu),
        normalization="LayerNorm",
        layernorm_epsilon=config.layer_norm_epsilon,
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_scale=None if config.scale_attn_weights else 1.0,
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
    model = GPTModel(
        config=transformer_config(config, tp_size, dtype),
        transformer_layer_spec=layer_spec(attention),
        vocab_size=padded_vocab,
        max_sequence_length=config.n_positions,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="learned_absolute",
        parallel_output=False,
    )
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
