"""Import of checkpoints from BigCode's Megatron-LM fork (SantaCoder / StarCoder training), any TP.

Same files and nesting as Megatron-LM legacy (see megatron_legacy.py). With
`args.attention_head_type == "multiquery"` each layer stores `self_attention.query` (column-parallel)
and `self_attention.key_value` (`[K | V]`, one head, replicated on every rank); with "multihead",
`query_key_value` per head `[q_h, k_h, v_h]` (checkpoint_version >= 2). The fork has no true
vocab size in its args: the HF model gets `padded_vocab_size` rows, as BigCode's own converter does.
"""

from __future__ import annotations

from pathlib import Path

from transformers import GPTBigCodeConfig

from .mapping import ConversionError, megatron_to_hf
from .megatron_legacy import config_from_args, load_ranks


def read(src: str | Path, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    args, states, meta = load_ranks(src)
    if getattr(args, "pipeline_model_parallel_size", 1) != 1:
        raise ConversionError(f"{src}: pipeline-parallel checkpoints are not supported")
    head_type = getattr(args, "attention_head_type", None)
    if head_type is None:  # older fork args: tell by the tensors
        head_type = "multiquery" if any(k.endswith("self_attention.key_value.weight") for k in states[0]) else "multihead"
    if head_type not in ("multiquery", "multihead"):
        raise ConversionError(f"{src}: unknown attention_head_type {head_type!r}")
    version = meta.get("checkpoint_version", 0)
    if head_type == "multihead" and version < 2.0:
        raise ConversionError(f"{src}: checkpoint_version {version} stores query_key_value in an older order; "
                              "only version >= 2 is supported")
    groups = 1 if head_type == "multiquery" else args.num_attention_heads
    config = config_from_args(args, groups)
    hub = megatron_to_hf(states, config, "bigcode", args.padded_vocab_size, progress=progress)
    return config, hub
