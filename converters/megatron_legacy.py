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
from argparse import Namespace
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig

from converters.mapping import (ConversionError, Layout, hf_to_megatron, megatron_to_hf, padded_vocab_size,
                                pool_kv_heads, regroup_kv_heads, stored_dtype, with_groups)
from converters.megatron_pt import flatten, load_checkpoint_file, nest
from plugins.core.config import TANH_GELUS, check_hf_config, kv_heads

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
ENCODER = "language_model/encoder/"
EMBEDDING = "language_model/embedding/"
HEAD_COPY = "word_embeddings_for_head/weight"  # the last stage's copy of the tied word embeddings
LAYER = re.compile(r"^language_model/encoder/layers\.(\d+)\.(.+)$")


# --------------------------------------------------------------------------- layout on disk

def iteration_dir(src: Path, iteration: int | None = None) -> Path:
    """The directory of `iteration`, or of the tracker's (latest) one."""
    if iteration is not None:
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ConversionError(f"iteration must be an integer >= 0, got {iteration!r}")
        d = src / f"iter_{iteration:07d}"
        if not d.is_dir():
            found = sorted(p.name for p in src.glob("iter_*"))
            raise ConversionError(f"{src} has no iteration {iteration} (found: {', '.join(found) or 'none'})")
        return d
    tracker = src / TRACKER
    if not tracker.is_file():
        raise ConversionError(f"{src} is not a Megatron-LM checkpoint (no {TRACKER})")
    try:
        tag = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"{tracker}: unreadable ({e})") from None
    if tag == "release":
        d = src / "release"
    elif tag.isdigit():
        d = src / f"iter_{int(tag):07d}"
    else:
        raise ConversionError(f"{tracker}: expected 'release' or an iteration number, got {tag[:40]!r}")
    if not d.is_dir():
        raise ConversionError(f"{tracker} names {tag!r} but {d.name}/ is missing")
    return d


def rank_dir(it_dir: Path, tp_rank: int, pp_rank: int, pp_size: int) -> Path:
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return it_dir / name


def layers_per_stage(args: Namespace, pp: int) -> list[int]:
    """How many transformer layers each pipeline stage holds, as Megatron-LM's legacy model splits them."""
    n = args.num_layers
    first, last = getattr(args, "decoder_first_pipeline_num_layers", None), getattr(args, "decoder_last_pipeline_num_layers", None)
    standalone = getattr(args, "standalone_embedding_stage", False) or getattr(
        args, "account_for_embedding_in_pipeline_split", False)
    if pp == 1:
        return [n]
    if first is not None or last is not None:  # megatron-core's uneven split
        counts = [None] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        rest = [i for i in range(pp) if counts[i] is None]
        left = n - sum(c for c in counts if c is not None)
        if rest and (left < 0 or left % len(rest)):
            raise ConversionError(f"args: {n} layers do not split over {pp} stages with first={first}, last={last}")
        for i in rest:
            counts[i] = left // len(rest)
        return counts
    if standalone:  # the first stage holds the embeddings only
        if n % (pp - 1):
            raise ConversionError(f"args: {n} layers do not split evenly over {pp - 1} stages after the embedding stage")
        return [0] + [n // (pp - 1)] * (pp - 1)
    if n % pp:
        raise ConversionError(f"args: num_layers {n} is not divisible by pipeline_model_parallel_size {pp}, and "
                              "the args name no uneven split (decoder_first/last_pipeline_num_layers)")
    return [n // pp] * pp


# --------------------------------------------------------------------------- args

def check_args(args: Namespace, where: str) -> None:
    """The args fields the reader needs, with their types, before anything else is read."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "padded_vocab_size"):
        value = getattr(args, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConversionError(f"{where}: args.{name} must be a positive integer, got {value!r}")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(args, name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConversionError(f"{where}: args.{name} must be a positive integer, got {value!r}")


def make_args(config: GPTBigCodeConfig, tp_size: int, pp_size: int, padded_vocab: int, groups: int,
              dtype: torch.dtype) -> Namespace:
    """What a Megatron-LM run that trained this model would have stored: every field NVIDIA's
    `check_checkpoint_args` / `load_args_from_checkpoint` / tools/checkpoint and HF's megatron_gpt2
    converter read (tests/unit/test_converters.py lists them)."""
    if config.activation_function not in TANH_GELUS + ("gelu",):
        raise ConversionError(f"activation {config.activation_function!r} has no Megatron equivalent")
    h = config.n_embd
    return Namespace(
        num_layers=config.n_layer, hidden_size=h, ffn_hidden_size=config.n_inner or 4 * h,
        num_attention_heads=config.n_head, kv_channels=h // config.n_head,
        group_query_attention=groups != config.n_head, num_query_groups=groups,
        max_position_embeddings=config.n_positions, seq_length=config.n_positions,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        use_rotary_position_embeddings=False,
        vocab_size=config.vocab_size, padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer", orig_vocab_size=config.vocab_size,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        normalization="LayerNorm", layernorm_epsilon=config.layer_norm_epsilon, apply_layernorm_1p=False,
        add_bias_linear=True, add_qkv_bias=True, swiglu=False, squared_relu=False,
        bias_gelu_fusion=config.activation_function in TANH_GELUS, openai_gelu=False,  # tanh GELU
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1, world_size=tp_size * pp_size, rank=0,
        ckpt_format="torch", bert_binary_head=False, iteration=0,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
    )


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
    same = isinstance(hf_config, dict) and all(hf_config.get(k) == v for k, v in arch.items()
                                               if k != "activation_function")
    if same and family(hf_config.get("activation_function")) == family(arch["activation_function"]):
        base = dict(hf_config)  # same architecture: keep the rest (token ids, init range, ...)
        arch["activation_function"] = base.get("activation_function", arch["activation_function"])
    else:
        base = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base.update(arch)
    base.pop("num_query_groups", None)
    try:
        config = with_groups(GPTBigCodeConfig.from_dict(base), groups)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"args do not describe a gpt_bigcode model: {e}") from None
    check_hf_config(config, "args")
    return config


# --------------------------------------------------------------------------- pipeline stages

def _normalize(key: str) -> str:
    """Newer NVIDIA Megatron-LM saves `*_norm` and older ones `transformer` / `.attention.`: our names."""
    key = key.replace("language_model/transformer/", ENCODER, 1)
    key = key.replace(".attention.", ".self_attention.")
    key = re.sub(r"(input|post_attention|final)_norm\.", r"\1_layernorm.", key)
    return key


def split_stages(state: dict, counts: list[int], tied: bool) -> list[dict]:
    """One TP rank's full flat state (global layer indices) -> its pipeline stages (local indices)."""
    pp = len(counts)
    starts = [sum(counts[:s]) for s in range(pp)]
    stages = [{} for _ in range(pp)]
    for key, t in state.items():
        m = LAYER.match(key)
        if m:
            i = int(m.group(1))
            s = max(s for s in range(pp) if starts[s] <= i and counts[s] > 0)
            stages[s][f"{ENCODER}layers.{i - starts[s]}.{m.group(2)}"] = t
        elif key.startswith(EMBEDDING):
            stages[0][key] = t
        else:  # final layer norm, untied output layer
            stages[-1][key] = t
    if tied and pp > 1:
        stages[-1][HEAD_COPY] = state[EMBEDDING + "word_embeddings/weight"]
    return stages


def merge_stages(stages: list[dict], counts: list[int], tied: bool, where: str) -> dict:
    """A TP rank's stages -> its full flat state with global layer indices (inverse of split_stages)."""
    out, start = {}, 0
    for s, (stage, count) in enumerate(zip(stages, counts)):
        local = sorted({int(m.group(1)) for m in map(LAYER.match, stage) if m})
        if local != list(range(count)):
            raise ConversionError(f"{where}: pipeline stage {s} holds layers {local[:4]}{'...' if len(local) > 4 else ''}"
                                  f" ({len(local)}), the args say {count}")
        for key, t in stage.items():
            m = LAYER.match(key)
            if m:
                key = f"{ENCODER}layers.{start + int(m.group(1))}.{m.group(2)}"
            elif key == HEAD_COPY:
                continue
            elif key.startswith(EMBEDDING) and s != 0:
                raise ConversionError(f"{where}: pipeline stage {s} holds {key} (embeddings belong to stage 0)")
            if key in out:
                raise ConversionError(f"{where}: {key} is stored by two pipeline stages")
            out[key] = t
        start += count
    if tied and len(stages) > 1:
        head = stages[-1].get(HEAD_COPY)
        emb = out.get(EMBEDDING + "word_embeddings/weight")
        if head is None:
            raise ConversionError(f"{where}: the last pipeline stage has no {HEAD_COPY} (tied embeddings)")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise ConversionError(f"{where}: the last stage's {HEAD_COPY} differs from the first stage's word "
                                  "embeddings, but the args say they are tied")
    return out


def read_stages(it_dir: Path, args: Namespace, tp: int, pp: int, iteration: int, progress=None) -> list[dict]:
    """[full flat state per TP rank], reading (mapping) one stage file at a time; every stage file must
    hold `iteration` and the same model args as the first."""
    counts = layers_per_stage(args, pp)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    expected = {rank_dir(it_dir, t, p, pp).name for t in range(tp) for p in range(pp)}
    found = {d.name for d in it_dir.glob("mp_rank_*") if d.is_dir()}
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        raise ConversionError(f"{it_dir}: args say TP={tp} x PP={pp}; missing {missing[:4]}, unexpected {extra[:4]}")
    if progress is not None:
        progress.reset(total=tp * pp)
    ranks = []
    for t in range(tp):
        stages = []
        for p in range(pp):
            f = rank_dir(it_dir, t, p, pp) / FILE
            ckpt = load_checkpoint_file(f)
            if ckpt.get("iteration", 0) != iteration:
                raise ConversionError(f"{f}: holds iteration {ckpt.get('iteration')!r}, the checkpoint {iteration} "
                                      "(a stage from another iteration?)")
            stage_args = ckpt["args"]
            for name in ("num_layers", "hidden_size", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
                if getattr(stage_args, name, None) != getattr(args, name, None):
                    raise ConversionError(f"{f}: args.{name} = {getattr(stage_args, name, None)!r}, but the first "
                                          f"stage says {getattr(args, name, None)!r} (mixed checkpoints?)")
            stages.append({_normalize(k): v for k, v in flatten(ckpt["model"]).items()})
            if progress is not None:
                progress.update(1)
        ranks.append(merge_stages(stages, counts, tied, f"{it_dir} TP rank {t}"))
    return ranks


def read_layout(src: str | Path, iteration: int | None = None) -> tuple[Path, Namespace, dict]:
    """(iteration dir, args, rank-0 stage-0 checkpoint without 'model') of a checkpoint, args checked."""
    src = Path(src)
    it_dir = iteration_dir(src, iteration)
    first = sorted(d for d in it_dir.glob("mp_rank_00*") if d.is_dir())
    if not first:
        raise ConversionError(f"{it_dir}: no mp_rank_00* directory")
    ckpt = load_checkpoint_file(first[0] / FILE)
    args = ckpt["args"]
    check_args(args, str(first[0] / FILE))
    meta = {k: v for k, v in ckpt.items() if k != "model"}
    if it_dir.name.startswith("iter_") and meta.get("iteration") != int(it_dir.name[5:]):
        raise ConversionError(f"{first[0] / FILE}: holds iteration {meta.get('iteration')!r}, not {it_dir.name}")
    return it_dir, args, meta


# --------------------------------------------------------------------------- NVIDIA Megatron-LM

def groups_for_tp(config: GPTBigCodeConfig, tp_size: int) -> int:
    """KV groups NVIDIA's legacy attention can shard over tp_size ranks (a multiple of tp_size)."""
    groups = kv_heads(config)
    return groups if groups % tp_size == 0 else tp_size


def duplicate_kv_heads(hf_state: dict, config: GPTBigCodeConfig, groups: int) -> tuple[GPTBigCodeConfig, dict]:
    """The same model with each KV head repeated to `groups` groups (a multiple of the KV heads)."""
    return regroup_kv_heads(hf_state, config, groups,
                            lambda kv: kv.repeat_interleave(groups // kv_heads(config), 0))


def save_stages(dst: Path, ranks: list[list[dict]], args: Namespace, extra: dict) -> None:
    """ranks[tp][pp] flat stage states -> release/mp_rank_*/model_optim_rng.pt (+ the tracker)."""
    (dst / TRACKER).write_text("release")
    pp = len(ranks[0])
    for t, stages in enumerate(ranks):
        for p, state in enumerate(stages):
            d = rank_dir(dst / "release", t, p, pp)
            d.mkdir(parents=True)
            ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": 0,
                    "model": nest({k: compact(v) for k, v in state.items()}), **extra}
            torch.save(ckpt, d / FILE)


def compact(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: copy shards that are views of bigger tensors."""
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1, pp_size: int = 1) -> None:
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ConversionError(f"pp_size must be a positive integer, got {pp_size!r}")
    if config.n_layer % pp_size:
        raise ConversionError(f"pp_size {pp_size} does not divide n_layer {config.n_layer} (Megatron-LM's legacy "
                              "model splits layers evenly over pipeline stages)")
    Layout(config, tp_size, None, "legacy")


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, pp_size: int = 1,
          progress=None) -> None:
    """NVIDIA Megatron-LM legacy checkpoint at TP x PP (MQA / GQA KV heads duplicated to TP groups where
    fewer than TP: see the module docstring)."""
    check_writable(config, tp_size, pp_size)
    groups = groups_for_tp(config, tp_size)
    wide, state = duplicate_kv_heads(hf_state, config, groups)
    padded = padded_vocab_size(config.vocab_size, tp_size)
    args = make_args(wide, tp_size, pp_size, padded, groups, stored_dtype(hf_state))
    ranks = hf_to_megatron(state, wide, "legacy", tp_size, padded, progress=progress)
    counts = [config.n_layer // pp_size] * pp_size
    stages = [split_stages(r, counts, config.tie_word_embeddings) for r in ranks]
    save_stages(Path(dst), stages, args, {"hf_config": config.to_dict()})


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


def undo_kv_duplication(config: GPTBigCodeConfig, hub: dict, hf_config, where: str):
    """Pool K/V heads that `write` duplicated back to the stored HF config's count, if every copy is
    identical (else the checkpoint has really that many KV heads, e.g. after training: keep them)."""
    if not isinstance(hf_config, dict):
        return config, hub
    want = hf_config.get("num_query_groups") or (1 if hf_config.get("multi_query") else config.n_head)
    have = kv_heads(config)
    if not isinstance(want, int) or want >= have or have % want:
        return config, hub
    d, n = config.n_embd // config.n_head, config.n_head
    for i in range(config.n_layer):
        t = hub[f"transformer.h.{i}.attn.c_attn.weight"]
        kv = t.reshape(have, n // have + 2, d, -1)[:, n // have:].reshape(want, have // want, -1)
        if not bool((kv == kv[:, :1]).all()):
            return config, hub
    return pool_kv_heads(hub, config, want)
