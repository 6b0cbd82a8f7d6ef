"""Megatron-LM legacy checkpoints (`--ckpt-format torch`, legacy GPT model), any TP x PP, as NVIDIA
Megatron-LM and BigCode's fork lay them out (read the same way; bigcode_megatron.py writes the fork's).

  DIR/latest_checkpointed_iteration.txt           "release" or the last iteration number
  DIR/release/mp_rank_{tp:02d}/model_optim_rng.pt          PP = 1
  DIR/iter_{it:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   PP > 1
      {'args': Namespace, 'checkpoint_version': 3.0, 'iteration': it,
       'model': {'language_model': {'embedding': {...},         first stage only
                                    'encoder': {'layers.0....': T, ..., 'final_layernorm.*'}, (last stage)
                                    'output_layer': {...}},     last stage, untied only
                 'word_embeddings_for_head': {'weight': T}}}    last stage, tied and PP > 1

Layer indices inside a stage file are local (0 .. n-1); a stage's global offset is the sum of the
layers of the stages before it. The per-stage counts are derived from args (an even split; the
fork's `standalone_embedding_stage` / NVIDIA's `account_for_embedding_in_pipeline_split`, and
`decoder_first/last_pipeline_num_layers`) and must match the files. Virtual (interleaved) pipeline
stages (`model0`, `model1`, ...) are refused. Optimizer state (`optimizer`, `distrib_optim.pt` of
the distributed optimizer), RNG state and `opt_param_scheduler` are ignored: weights only.

Writing: "release", every args field NVIDIA Megatron-LM's loader and tools/checkpoint read and HF's
megatron_gpt2 converter reads. NVIDIA's legacy attention needs num_query_groups to be a multiple
of TP, so MQA (and GQA with fewer KV heads than ranks) at TP > 1 is written with the K/V heads
duplicated to TP groups: the same model (each group attends with an identical copy). The HF
config rides along (`hf_config`, plain types); reading pools the copies back, exactly, when they
are identical. Files are read with torch's weights-only unpickler, mapped (mmap) rather than
copied, one stage at a time; no code from a checkpoint runs (see `load_checkpoint_file`).
"""

from __future__ import annotations

import re
import warnings
from argparse import Namespace
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig, Starcoder2Config

from converters import consumers
from converters.kv_heads import layer_kv
from converters.mapping import (ConversionError, Layout, hf_to_megatron, megatron_to_hf, padded_vocab_size,
                                pool_kv_heads, regroup_kv_heads, stored_dtype, with_groups)
from converters.megatron_pt import flatten, load_checkpoint_file, nest  # noqa: F401 (used by tests and bigcode)
from converters.stages import (FILE, LEGACY, TRACKER, check_args, compact, iteration_dir,  # noqa: F401
                               layers_per_stage, merge_stages, rank_dir, read_layout, save_stages, split_stages)
from converters.stages import read_stages as _read_stages
from plugins.core.config import TANH_GELUS, arch, check_hf_config, kv_heads

ENCODER = "language_model/encoder/"
LEGACY_ROPE_NOTE = ("Megatron-LM's legacy GPT model (core_v0.17.x and before) builds its rotary embedding without "
                    "--rotary-base (always 10000) and has no sliding window: it loads this StarCoder2 checkpoint "
                    "strictly but computes another model; megatron-torch and megatron keep both")
OUTPUT_LAYER = "language_model/output_layer/weight"  # untied head


# --------------------------------------------------------------------------- args

def make_args(config, tp_size: int, pp_size: int, padded_vocab: int, groups: int,
              dtype: torch.dtype) -> Namespace:
    """What a Megatron-LM run that trained this model would have stored: every field NVIDIA's
    `check_checkpoint_args` / `load_args_from_checkpoint` / tools/checkpoint and HF's megatron_gpt2
    converter read (tests/unit/test_converters.py lists them). StarCoder2: RoPE (`rotary_base` = its
    rope_theta, a float where the model's is: 3B's is not an integer) and `window_size` = (window - 1, 0),
    megatron-core's flash-attention convention for HF's `sliding_window`."""
    a = arch(config)
    if a.activation not in TANH_GELUS + ("gelu",):
        raise ConversionError(f"activation {a.activation!r} has no Megatron equivalent")
    h = a.hidden
    args = Namespace(
        num_layers=a.n_layer, hidden_size=h, ffn_hidden_size=a.inner,
        num_attention_heads=a.n_head, kv_channels=a.head_dim,
        group_query_attention=groups != a.n_head, num_query_groups=groups,
        max_position_embeddings=a.n_positions, seq_length=a.n_positions,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        use_rotary_position_embeddings=False,
        vocab_size=config.vocab_size, padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer", orig_vocab_size=config.vocab_size,
        untie_embeddings_and_output_weights=not a.tied,
        normalization="LayerNorm", layernorm_epsilon=a.eps, apply_layernorm_1p=False,
        add_bias_linear=True, add_qkv_bias=True, swiglu=False, squared_relu=False,
        bias_gelu_fusion=a.activation in TANH_GELUS, openai_gelu=False,  # tanh GELU
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1, world_size=tp_size * pp_size, rank=0,
        ckpt_format="torch", bert_binary_head=False, iteration=0,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
    )
    if a.rope:
        args.position_embedding_type, args.add_position_embedding = "rope", False
        args.use_rotary_position_embeddings = True
        args.rotary_base, args.rotary_percent, args.rotary_interleaved = a.rope_theta, 1.0, False
        args.window_size = None if a.sliding_window is None else (a.sliding_window - 1, 0)
    return args


def rope_args(args: Namespace) -> bool:
    """Whether args describe rotary positions (what StarCoder2 has) rather than a learned table."""
    return (getattr(args, "position_embedding_type", None) == "rope"
            or bool(getattr(args, "use_rotary_position_embeddings", False)))


def _starcoder2_arch(args: Namespace, tanh: bool) -> dict:
    theta = getattr(args, "rotary_base", 10000)
    window = getattr(args, "window_size", None)
    if getattr(args, "rotary_percent", 1.0) != 1.0 or getattr(args, "rotary_interleaved", False):
        raise ConversionError("args: partial or interleaved rotary embeddings have no HF starcoder2 equivalent")
    if window is not None and (not isinstance(window, (tuple, list)) or len(window) != 2 or window[1] != 0
                               or not isinstance(window[0], int) or window[0] < 0):
        raise ConversionError(f"args.window_size {window!r}: HF starcoder2 has a causal window (left, 0) only")
    h = args.hidden_size
    return dict(model_type="starcoder2", num_hidden_layers=args.num_layers, hidden_size=h,
                num_attention_heads=args.num_attention_heads,
                max_position_embeddings=args.max_position_embeddings,
                vocab_size=getattr(args, "vocab_size", None) or args.padded_vocab_size,
                intermediate_size=getattr(args, "ffn_hidden_size", None) or 4 * h,
                hidden_act="gelu_pytorch_tanh" if tanh else "gelu",
                norm_epsilon=getattr(args, "layernorm_epsilon", 1e-5),
                tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                rope_parameters={"rope_type": "default", "rope_theta": theta},
                sliding_window=None if window is None else window[0] + 1)


def config_from_args(args: Namespace, groups: int, hf_config: dict | None = None):
    """The HF config args describe: gpt_bigcode with learned positions, starcoder2 with RoPE. A stored
    `hf_config` of the same architecture supplies the rest (token ids, init range, ...)."""
    tanh = getattr(args, "bias_gelu_fusion", False) or getattr(args, "openai_gelu", False)
    h = args.hidden_size
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * h
    if rope_args(args):
        arch_ = _starcoder2_arch(args, tanh)
        act_key, cls = "hidden_act", Starcoder2Config
        base_defaults = dict(attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, use_bias=True)
    else:
        arch_ = dict(
            n_layer=args.num_layers, n_embd=h, n_head=args.num_attention_heads,
            n_positions=args.max_position_embeddings,
            vocab_size=getattr(args, "vocab_size", None) or args.padded_vocab_size,
            n_inner=None if ffn == 4 * h else ffn,
            activation_function="gelu_pytorch_tanh" if tanh else "gelu",
            layer_norm_epsilon=getattr(args, "layernorm_epsilon", 1e-5),
            tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        )
        act_key, cls = "activation_function", GPTBigCodeConfig
        base_defaults = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    family = lambda act: "tanh" if act in TANH_GELUS else act  # noqa: E731
    same = isinstance(hf_config, dict) and all(hf_config.get(k) == v for k, v in arch_.items() if k != act_key)
    if same and family(hf_config.get(act_key)) == family(arch_[act_key]):
        base = dict(hf_config)  # same architecture: keep the rest (token ids, init range, ...)
        arch_[act_key] = base.get(act_key, arch_[act_key])
    else:
        base = base_defaults
    base.update(arch_)
    base.pop("num_query_groups", None)
    try:
        config = with_groups(cls.from_dict(base), groups)  # the KV heads: the args' own
    except (TypeError, ValueError) as e:
        raise ConversionError(f"args do not describe a {cls.model_type} model: {e}") from None
    check_hf_config(config, "args")
    return config


# --------------------------------------------------------------------------- pipeline stages

def read_stages(it_dir: Path, args: Namespace, tp: int, pp: int, iteration: int, progress=None) -> list[dict]:
    """[full flat state per TP rank] of a legacy-model checkpoint (stages.read_stages, names normalized)."""
    return _read_stages(it_dir, args, tp, pp, iteration, progress, LEGACY, _normalize)


def _normalize(key: str) -> str:
    """Newer NVIDIA Megatron-LM saves `*_norm` and older ones `transformer` / `.attention.`: our names."""
    key = key.replace("language_model/transformer/", ENCODER, 1)
    key = key.replace(".attention.", ".self_attention.")
    key = re.sub(r"(input|post_attention|final)_norm\.", r"\1_layernorm.", key)
    return key


# --------------------------------------------------------------------------- NVIDIA Megatron-LM

def groups_for_tp(config: GPTBigCodeConfig, tp_size: int) -> int:
    """KV groups NVIDIA's legacy attention can shard over tp_size ranks (a multiple of tp_size)."""
    groups = kv_heads(config)
    return groups if groups % tp_size == 0 else tp_size


def duplicate_kv_heads(hf_state: dict, config: GPTBigCodeConfig, groups: int) -> tuple[GPTBigCodeConfig, dict]:
    """The same model with each KV head repeated to `groups` groups (a multiple of the KV heads)."""
    return regroup_kv_heads(hf_state, config, groups,
                            lambda kv: kv.repeat_interleave(groups // kv_heads(config), 0))


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1, pp_size: int = 1) -> None:
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ConversionError(f"pp_size must be a positive integer, got {pp_size!r}")
    n_layer = arch(config).n_layer
    if n_layer % pp_size:
        raise ConversionError(f"pp_size {pp_size} does not divide n_layer {n_layer} (Megatron-LM's legacy "
                              "model splits layers evenly over pipeline stages)")
    Layout(config, tp_size, None, "legacy")


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, pp_size: int = 1,
          progress=None) -> None:
    """NVIDIA Megatron-LM legacy checkpoint at TP x PP (MQA / GQA KV heads duplicated to TP groups where
    fewer than TP: see the module docstring)."""
    check_writable(config, tp_size, pp_size)
    if arch(config).rope:
        warnings.warn(LEGACY_ROPE_NOTE, stacklevel=2)
    groups = groups_for_tp(config, tp_size)
    wide, state = duplicate_kv_heads(hf_state, config, groups)
    padded = padded_vocab_size(config.vocab_size, tp_size)
    args = make_args(wide, tp_size, pp_size, padded, groups, stored_dtype(hf_state))
    ranks = hf_to_megatron(state, wide, "legacy", tp_size, padded, progress=progress)
    counts = [arch(config).n_layer // pp_size] * pp_size
    stages = [split_stages(r, counts, config.tie_word_embeddings) for r in ranks]
    save_stages(Path(dst), stages, args, {"hf_config": config.to_dict()}, model=lambda state, t, p: nest(
        with_extra_state(state)))


# megatron-core's Column/RowParallelLinear, which NVIDIA's legacy model uses since core_v0.5.0, save an extra
# state (None) that a strict load requires.
MCORE_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def with_extra_state(state: dict) -> dict:
    out = dict(state)
    for key in state:
        m = LEGACY.layer.match(key)
        if (m and m.group(2).endswith(".weight") and m.group(2)[:-7] in MCORE_LINEARS) or key == OUTPUT_LAYER:
            out[key[:-len("weight")] + "_extra_state"] = None
    return out


def check_loadable(dst: str | Path, config: GPTBigCodeConfig, fork_heads: str | None = None) -> None:
    """Every stage file holds exactly the keys NVIDIA's legacy GPT model (or, with fork_heads, BigCode's
    fork) of that stage loads strictly."""
    dst = Path(dst)
    it_dir, args, _ = read_layout(dst)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    tied, counts = not args.untie_embeddings_and_output_weights, layers_per_stage(args, pp)
    consumer = "NVIDIA Megatron-LM's legacy GPT model" if fork_heads is None else "BigCode's Megatron-LM fork"
    for t in range(tp):
        for p in range(pp):
            f = rank_dir(it_dir, t, p, pp) / FILE
            got = consumers.flat_values(load_checkpoint_file(f)["model"])
            if fork_heads is None:
                got = consumers.nvidia_legacy_view(got)
            want = consumers.legacy_stage_keys(counts[p], p == 0, p == pp - 1, tied, pp, fork_heads,
                                               learned_positions=not rope_args(args))
            consumers.check_strict(str(f.relative_to(dst)), got, want, f"{consumer} (TP rank {t}, PP stage {p})")


def read(src: str | Path, iteration: int | None = None, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    it_dir, args, meta = read_layout(src, iteration)
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ConversionError(f"{it_dir}: args.num_query_groups must be a positive integer, got {groups!r}")
    config = config_from_args(args, groups, meta.get("hf_config"))
    states = read_stages(it_dir, args, tp, pp, meta.get("iteration", 0), progress)
    hub = megatron_to_hf(states, config, "legacy", args.padded_vocab_size, progress=progress)
    return undo_kv_duplication(config, hub, meta.get("hf_config"), str(it_dir))


def undo_kv_duplication(config, hub: dict, hf_config, where: str):
    """Pool K/V heads that `write` duplicated back to the stored HF config's count, if every copy is
    identical (else the checkpoint has really that many KV heads, e.g. after training: keep them)."""
    if not isinstance(hf_config, dict):
        return config, hub
    a = arch(config)
    if a.family == "starcoder2":
        want = hf_config.get("num_key_value_heads")
    else:
        want = hf_config.get("num_query_groups") or (1 if hf_config.get("multi_query") else a.n_head)
    have = kv_heads(config)
    if not isinstance(want, int) or want < 1 or want >= have or have % want:
        return config, hub
    for i in range(a.n_layer):
        kv = layer_kv(hub, config, i, "weight").reshape(want, have // want, -1)
        if not bool((kv == kv[:, :1]).all()):
            return config, hub
    return pool_kv_heads(hub, config, want)
