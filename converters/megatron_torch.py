"""Megatron-LM `--ckpt-format torch` checkpoints of the megatron-core GPT model: what current Megatron-LM
trains and saves in that format (its legacy GPT model is gone since core_v0.18.0), any TP x PP, MQA, GQA
or MHA, with the local layer spec's names or the Transformer Engine spec's (`layer_spec` "local" / "te").

The directory is laid out like every torch-format checkpoint (stages.py); each
release/mp_rank_TT[_PPP]/model_optim_rng.pt holds what Megatron-LM's `save_checkpoint`
(megatron/training/checkpointing.py: `generate_state_dict` with ckpt_format "torch") writes with
`--no-save-optim --no-save-rng`, as its own tools/checkpoint saver does:

  {'args': Namespace, 'checkpoint_version': 3.0, 'iteration': 0, 'num_floating_point_operations_so_far': 0,
   'model': OrderedDict: GPTModel.state_dict() of that TP rank and stage, flat names with local layer indices
            ('decoder.layers.0.self_attention.linear_qkv.weight', ...), `_extra_state` included},
   'hf_config': the HF config (ignored by Megatron-LM; makes the round trip exact)}

`_extra_state` is None for megatron-core's own linears (local spec, output_layer) and an empty uint8
tensor for Transformer Engine modules (what TE's `get_extra_state` returns without FP8): a strict load
needs the keys. The tied head's copy on the last pipeline stage is `output_layer.weight`. Reading takes
either spec (told by the names), any iteration, and ignores optimizer, RNG and scheduler state.
"""

from __future__ import annotations

from argparse import Namespace
from collections import OrderedDict
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig

from converters import consumers
from converters.mapping import (ConversionError, check_megatron_config, hf_to_megatron, megatron_to_hf,
                                padded_vocab_size, stored_dtype)
from converters.megatron_legacy import config_from_args, make_args
from converters.megatron_pt import load_checkpoint_file
from converters.stages import (FILE, MCORE, layers_per_stage, rank_dir, read_layout, read_stages, save_stages,
                               split_stages)
from plugins.core.config import arch, kv_heads

SPECS = {"local": "mcore", "te": "mcore-te"}  # --layer-spec -> the mapping table's dialect
TRANSFORMER_IMPL = {"local": "local", "te": "transformer_engine"}  # Megatron-LM's --transformer-impl
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
TE_ONLY = ("self_attention.core_attention",)  # TE modules with an extra state that the local spec lacks


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1, pp_size: int = 1, layer_spec: str = "local") -> None:
    """Everything `write` would refuse, checked before any work."""
    if layer_spec not in SPECS:
        raise ConversionError(f"layer_spec must be one of {', '.join(SPECS)}, got {layer_spec!r}")
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ConversionError(f"pp_size must be a positive integer, got {pp_size!r}")
    n_layer = arch(config).n_layer
    if n_layer % pp_size:
        raise ConversionError(f"pp_size {pp_size} does not divide n_layer {n_layer}")
    check_megatron_config(config, tp_size, "mcore")


def torch_args(config: GPTBigCodeConfig, tp_size: int, pp_size: int, padded: int, layer_spec: str, dtype) -> Namespace:
    """The legacy format's args (every field Megatron-LM's check_checkpoint_args / load_args_from_checkpoint
    read) with megatron-core's KV groups as they are, plus what a current run records about this model."""
    args = make_args(config, tp_size, pp_size, padded, kv_heads(config), dtype)
    args.transformer_impl = TRANSFORMER_IMPL[layer_spec]
    args.spec = None  # the default GPT layer spec of transformer_impl
    if not arch(config).rope:  # Megatron-LM's defaults, unused with learned positions
        args.rotary_base, args.rotary_percent, args.rotary_interleaved = 10000, 1.0, False
    args.num_experts, args.use_dist_ckpt = None, False
    args.no_save_optim = args.no_save_rng = True
    return args


def model_entry(state: dict, layer_spec: str, last: bool) -> OrderedDict:
    """A stage's 'model': its tensors plus the `_extra_state` entries GPTModel.state_dict() holds."""
    out = OrderedDict(state)
    te = layer_spec == "te"
    layers = sorted({int(m.group(1)) for m in map(MCORE.layer.match, state) if m})
    for i in layers:
        for module in LINEARS + (TE_ONLY if te else ()):
            out[f"decoder.layers.{i}.{module}._extra_state"] = torch.empty(0, dtype=torch.uint8) if te else None
    if last:
        out["output_layer._extra_state"] = None  # megatron-core's ColumnParallelLinear in both specs
        if te:
            out["decoder.final_layernorm._extra_state"] = torch.empty(0, dtype=torch.uint8)  # TENorm
    return out


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, pp_size: int = 1,
          layer_spec: str = "local", progress=None) -> None:
    check_writable(config, tp_size, pp_size, layer_spec)
    padded = padded_vocab_size(config.vocab_size, tp_size)
    args = torch_args(config, tp_size, pp_size, padded, layer_spec, stored_dtype(hf_state))
    ranks = hf_to_megatron(hf_state, config, SPECS[layer_spec], tp_size, padded, progress=progress)
    counts = [arch(config).n_layer // pp_size] * pp_size
    stages = [split_stages(r, counts, config.tie_word_embeddings, MCORE) for r in ranks]
    save_stages(Path(dst), stages, args, {"num_floating_point_operations_so_far": 0, "hf_config": config.to_dict()},
                model=lambda state, t, p: model_entry(state, layer_spec, p == pp_size - 1))


# --------------------------------------------------------------------------- read

def check_model_args(args: Namespace, where: str) -> None:
    """A GPT model that gpt_bigcode or starcoder2 can express: refused by its args before any tensor is read."""
    refuse = {
        "position_embedding_type": lambda v: v not in (None, "learned_absolute", "rope"),
        "normalization": lambda v: v not in (None, "LayerNorm"),
        "swiglu": bool, "squared_relu": bool, "apply_layernorm_1p": bool, "qk_layernorm": bool,
        "multi_latent_attention": bool, "num_experts": bool,
        "add_bias_linear": lambda v: v is False,
    }
    for name, bad in refuse.items():
        value = getattr(args, name, None)
        if bad(value):
            raise ConversionError(f"{where}: args.{name} = {value!r}; gpt_bigcode (learned absolute positions) "
                                  "and starcoder2 (RoPE) have LayerNorm, a biased GELU MLP and no experts")


def detect_spec(state: dict, where: str) -> str:
    """Which layer spec's names a state uses: TE's fused layer norms or the local spec's own."""
    if not isinstance(state, dict):
        raise ConversionError(f"{where}: 'model' is not a state dict")
    te = any(".linear_qkv.layer_norm_weight" in k for k in state)
    local = any(".input_layernorm.weight" in k for k in state)
    if te == local:
        sample = next(iter(state), "nothing")
        hint = " (a legacy-model checkpoint? read it as megatron-legacy)" if sample.startswith("language_model") else ""
        raise ConversionError(f"{where}: not a megatron-core GPT model's state dict (found {sample!r}){hint}")
    return "te" if te else "local"


def read(src: str | Path, iteration: int | None = None, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    it_dir, args, meta = read_layout(src, iteration)
    check_model_args(args, str(it_dir))
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ConversionError(f"{it_dir}: args.num_query_groups must be a positive integer, got {groups!r}")
    first = rank_dir(it_dir, 0, 0, pp) / FILE
    spec = detect_spec(load_checkpoint_file(first)["model"], str(first))  # a wrong format: told before merging stages
    config = config_from_args(args, groups, meta.get("hf_config"))
    states = read_stages(it_dir, args, tp, pp, meta.get("iteration", 0), progress, MCORE)
    return config, megatron_to_hf(states, config, SPECS[spec], args.padded_vocab_size, progress=progress)


def check_loadable(dst: str | Path, config: GPTBigCodeConfig) -> None:
    """Every rank's file holds exactly the keys and shapes of megatron-core's GPTModel of that TP rank and
    pipeline stage (`load_state_dict(strict=True)`), in the layer spec its args name."""
    dst = Path(dst)
    it_dir, args, _ = read_layout(dst)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    spec = "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local"
    counts = layers_per_stage(args, pp)
    for t in range(tp):
        for p in range(pp):
            f = rank_dir(it_dir, t, p, pp) / FILE
            model = load_checkpoint_file(f)["model"]
            got = {k: consumers.describe(v) for k, v in model.items()}
            want = consumers.mcore_state_keys(config, args.padded_vocab_size, spec, tp, t, counts[p], p == 0,
                                              p == pp - 1)
            consumers.check_strict(str(f.relative_to(dst)), got, want,
                                   f"megatron-core GPTModel ({spec} spec, TP rank {t}, PP stage {p})")
