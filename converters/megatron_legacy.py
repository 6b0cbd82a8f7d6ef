"""Megatron-LM legacy checkpoints (`--ckpt-format torch`, legacy GPT model), any TP, PP=1.

  DIR/latest_checkpointed_iteration.txt        "release" (what we write) or an iteration number
  DIR/release/mp_rank_00/model_optim_rng.pt    (or iter_0001000/mp_rank_01/...)
      {'args': Namespace, 'checkpoint_version': 3.0, 'iteration': 0,
       'model': {'language_model': {'embedding': {...}, 'encoder': {'layers.0....': T, ...}}}}

"release" is how converted weights are marked: Megatron-LM then loads the model only, no
optimizer or RNG state. We also store the HF config (`hf_config`, plain types) so that
bos/eos ids and the like survive a round trip; Megatron ignores the extra key.
"""

from __future__ import annotations

import re
from argparse import Namespace
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig

from plugins.core.config import TANH_GELUS, kv_heads

from .mapping import ConversionError, hf_to_megatron, megatron_to_hf, padded_vocab_size, with_groups

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"


# --------------------------------------------------------------------------- write

def make_args(config: GPTBigCodeConfig, tp_size: int, padded_vocab: int) -> Namespace:
    if config.activation_function not in TANH_GELUS + ("gelu",):
        raise ConversionError(f"activation {config.activation_function!r} has no Megatron equivalent")
    groups = kv_heads(config)
    h = config.n_embd
    return Namespace(
        num_layers=config.n_layer, hidden_size=h, ffn_hidden_size=config.n_inner or 4 * h,
        num_attention_heads=config.n_head, kv_channels=h // config.n_head,
        group_query_attention=groups != config.n_head, num_query_groups=groups,
        attention_head_type="multiquery" if groups == 1 else "multihead",  # BigCode fork's name for it
        max_position_embeddings=config.n_positions, seq_length=config.n_positions,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        vocab_size=config.vocab_size, padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        normalization="LayerNorm", layernorm_epsilon=config.layer_norm_epsilon,
        add_bias_linear=True, add_qkv_bias=True, swiglu=False,
        bias_gelu_fusion=config.activation_function in TANH_GELUS, openai_gelu=False,  # tanh GELU
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1,
        consumed_train_samples=0, consumed_valid_samples=0,
    )


def nest(flat: dict) -> dict:
    """{'a/b/c': T} -> {'a': {'b': {'c': T}}}."""
    out = {}
    for path, t in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t
    return out


def compact(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: copy shards that are views of bigger tensors."""
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def save_ranks(dst: Path, rank_states: list[dict], args: Namespace, extra: dict | None = None) -> None:
    dst = Path(dst)
    (dst / TRACKER).write_text("release")
    for rank, state in enumerate(rank_states):
        d = dst / "release" / f"mp_rank_{rank:02d}"
        d.mkdir(parents=True)
        ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": 0,
                "model": nest({k: compact(v) for k, v in state.items()}), **(extra or {})}
        torch.save(ckpt, d / FILE)


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, progress=None) -> None:
    padded = padded_vocab_size(config.vocab_size, tp_size)
    args = make_args(config, tp_size, padded)
    ranks = hf_to_megatron(hf_state, config, "legacy", tp_size, padded, progress=progress)
    save_ranks(Path(dst), ranks, args, {"hf_config": config.to_dict()})


# --------------------------------------------------------------------------- read

def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "/"))
        elif v is not None and not path.endswith("_extra_state"):
            out[path] = v
    return out


def load_ranks(src: str | Path) -> tuple[Namespace, list[dict], dict]:
    """(args, [flat model state per TP rank], rank 0's checkpoint dict without 'model')."""
    src = Path(src)
    tracker = src / TRACKER
    if not tracker.is_file():
        raise ConversionError(f"{src} is not a Megatron-LM checkpoint (no {TRACKER})")
    tag = tracker.read_text().strip()
    if tag == "release":
        it_dir = src / "release"
    elif tag.isdigit():
        it_dir = src / f"iter_{int(tag):07d}"
    else:
        raise ConversionError(f"{tracker}: expected 'release' or an iteration number, got {tag[:40]!r}")
    rank_dirs = sorted(p for p in it_dir.glob("mp_rank_*") if p.is_dir())
    if any(not re.fullmatch(r"mp_rank_\d\d", p.name) for p in rank_dirs):
        raise ConversionError(f"{it_dir}: pipeline-parallel checkpoints (mp_rank_XX_YYY) are not supported")
    if [p.name for p in rank_dirs] != [f"mp_rank_{r:02d}" for r in range(len(rank_dirs))] or not rank_dirs:
        raise ConversionError(f"{it_dir}: expected mp_rank_00 .. mp_rank_NN, found {[p.name for p in rank_dirs]}")
    from megatron.core.safe_globals import register_safe_globals
    register_safe_globals()
    ckpts = []
    for d in rank_dirs:
        f = d / FILE
        try:
            ckpts.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # truncated zip, pickle errors, missing file: all one message
            raise ConversionError(f"cannot read {f}: {type(e).__name__}: {e}") from None
        if not isinstance(ckpts[-1], dict) or "model" not in ckpts[-1] or "args" not in ckpts[-1]:
            raise ConversionError(f"{f}: not a Megatron-LM checkpoint (needs 'model' and 'args')")
    args = ckpts[0]["args"]
    tp = getattr(args, "tensor_model_parallel_size", len(ckpts))
    if tp != len(ckpts):
        raise ConversionError(f"{it_dir}: args say tensor_model_parallel_size={tp} but there are {len(ckpts)} ranks")
    states = []
    for c in ckpts:
        flat = flatten(c["model"])
        # Older Megatron-LM called the encoder 'transformer'.
        flat = {k.replace("language_model/transformer/", "language_model/encoder/", 1): v for k, v in flat.items()}
        states.append(flat)
    meta = {k: v for k, v in ckpts[0].items() if k != "model"}
    return args, states, meta


def config_from_args(args: Namespace, groups: int, hf_config: dict | None = None) -> GPTBigCodeConfig:
    tanh = getattr(args, "bias_gelu_fusion", False) or getattr(args, "openai_gelu", False)
    h = args.hidden_size
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * h
    arch = dict(
        n_layer=args.num_layers, n_embd=h, n_head=args.num_attention_heads,
        n_positions=args.max_position_embeddings,
        vocab_size=getattr(args, "vocab_size", None) or args.padded_vocab_size,
        n_inner=None if ffn == 4 * h else ffn,
        activation_function="gelu_pytorch_tanh" if tanh else "gelu",
        layer_norm_epsilon=getattr(args, "layernorm_epsilon", 1e-5),
        tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
    )
    family = lambda act: "tanh" if act in TANH_GELUS else act  # noqa: E731
    same = hf_config and all(hf_config.get(k) == v for k, v in arch.items() if k != "activation_function")
    if same and family(hf_config.get("activation_function")) == family(arch["activation_function"]):
        base = dict(hf_config)  # same architecture: keep the rest (token ids, init range, ...)
        arch["activation_function"] = base.get("activation_function", arch["activation_function"])
    else:
        base = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base.update(arch)
    base.pop("num_query_groups", None)
    return with_groups(GPTBigCodeConfig.from_dict(base), groups)


def read(src: str | Path, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    args, states, meta = load_ranks(src)
    if getattr(args, "pipeline_model_parallel_size", 1) != 1:
        raise ConversionError(f"{src}: pipeline-parallel checkpoints are not supported")
    groups = (args.num_query_groups if getattr(args, "group_query_attention", False)
              else args.num_attention_heads)
    config = config_from_args(args, groups, meta.get("hf_config"))
    hub = megatron_to_hf(states, config, "legacy", args.padded_vocab_size, progress=progress)
    return config, hub
