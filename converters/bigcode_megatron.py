"""Checkpoints of BigCode's Megatron-LM fork (SantaCoder / StarCoder training), any TP x PP, read
and written as the fork does.

Same files, nesting and pipeline stages as Megatron-LM legacy (megatron_legacy.py). With
`args.attention_head_type == "multiquery"` each layer stores `self_attention.query`
(column-parallel) and `self_attention.key_value` (`[K | V]`, one head, a plain Linear replicated on
every TP rank); with "multihead", `query_key_value` per head `[q_h, k_h, v_h]` (checkpoint_version
>= 2). The fork pickles `args.position_embedding_type` as its own enum
(`megatron.model.enums.PositionEmbeddingType`), which reading maps to an inert stand-in and
writing reproduces. The fork has no true vocab size in its args: the HF model gets
`padded_vocab_size` rows, as BigCode's own converter does (unless our `hf_config` rides along).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from transformers import GPTBigCodeConfig

from converters.mapping import ConversionError, Layout, hf_to_megatron, megatron_to_hf, padded_vocab_size, stored_dtype
from converters.megatron_legacy import config_from_args, make_args, read_layout, read_stages, save_stages, split_stages
from converters.megatron_pt import STAND_INS
from plugins.core.config import kv_heads

ENUM_MODULE = "megatron.model.enums"


def head_type(args, states) -> str:
    head = getattr(args, "attention_head_type", None)
    if head is None:  # fork args before the option existed: tell by the tensors
        head = "multiquery" if any(k.endswith("self_attention.key_value.weight") for k in states[0]) else "multihead"
    if head not in ("multiquery", "multihead"):
        raise ConversionError(f"unknown attention_head_type {head!r}")
    return head


def read(src: str | Path, iteration: int | None = None, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    it_dir, args, meta = read_layout(src, iteration)
    position = getattr(args, "position_embedding_type", None)
    if position is not None and getattr(position, "name", position) not in ("absolute", "learned_absolute"):
        raise ConversionError(f"{it_dir}: position_embedding_type {getattr(position, 'name', position)!r}; "
                              "gpt_bigcode has learned absolute positions")
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    states = read_stages(it_dir, args, tp, pp, meta.get("iteration", 0), progress)
    head = head_type(args, states)
    version = meta.get("checkpoint_version", 0)
    if head == "multihead" and version < 2.0:
        raise ConversionError(f"{it_dir}: checkpoint_version {version} stores query_key_value in an older order; "
                              "only version >= 2 is supported")
    config = config_from_args(args, 1 if head == "multiquery" else args.num_attention_heads, meta.get("hf_config"))
    hub = megatron_to_hf(states, config, "bigcode", args.padded_vocab_size, progress=progress)
    return config, hub


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1, pp_size: int = 1) -> None:
    from converters.megatron_legacy import check_writable as check_legacy

    check_legacy(config, tp_size, pp_size)
    Layout(config, tp_size, None, "bigcode")


def fork_args(config: GPTBigCodeConfig, tp_size: int, pp_size: int, padded: int, dtype):
    args = make_args(config, tp_size, pp_size, padded, kv_heads(config), dtype)
    args.attention_head_type = "multiquery" if kv_heads(config) == 1 else "multihead"
    args.position_embedding_type = STAND_INS["PositionEmbeddingType"](2)  # absolute, as the fork's enum
    return args


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, pp_size: int = 1,
          progress=None) -> None:
    """The fork's own layout: MQA as `query` (split over TP) + `key_value` (replicated), its args."""
    check_writable(config, tp_size, pp_size)
    padded = padded_vocab_size(config.vocab_size, tp_size)
    args = fork_args(config, tp_size, pp_size, padded, stored_dtype(hf_state))
    ranks = hf_to_megatron(hf_state, config, "bigcode", tp_size, padded, progress=progress)
    counts = [config.n_layer // pp_size] * pp_size
    stages = [split_stages(r, counts, config.tie_word_embeddings) for r in ranks]
    with fork_enum_module():
        save_stages(Path(dst), stages, args, {"hf_config": config.to_dict()})


def check_loadable(dst: str | Path, config: GPTBigCodeConfig) -> None:
    """Every stage file holds exactly the keys the fork's GPT model of that stage loads strictly."""
    from converters.megatron_legacy import check_loadable as check_stages

    check_stages(dst, config, "multiquery" if kv_heads(config) == 1 else "multihead")


class fork_enum_module:
    """While saving, `megatron.model.enums` names the stand-in enums, so the pickle refers to
    `megatron.model.enums.PositionEmbeddingType` exactly as the fork's own checkpoints do."""

    def __enter__(self):
        self.saved = {name: sys.modules.get(name) for name in ("megatron.model", ENUM_MODULE)}
        module = types.ModuleType(ENUM_MODULE)
        for name, cls in STAND_INS.items():
            setattr(module, name, cls)
        sys.modules.setdefault("megatron.model", types.ModuleType("megatron.model"))
        sys.modules[ENUM_MODULE] = module

    def __exit__(self, *exc):
        for name, module in self.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
