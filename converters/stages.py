"""Megatron-LM's `--ckpt-format torch` directory layout, shared by every format stored that way (legacy GPT
model, BigCode's fork, the megatron-core GPT model): the tracker, iteration directories, one
`model_optim_rng.pt` per TP x PP rank, and the re-keying of one TP rank's full state into pipeline stages.

  DIR/latest_checkpointed_iteration.txt           "release" or the last iteration number
  DIR/release/mp_rank_{tp:02d}/model_optim_rng.pt          PP = 1
  DIR/iter_{it:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   PP > 1
      {'args': Namespace, 'checkpoint_version': 3.0, 'iteration': it, 'model': ..., ...}

Layer indices inside a stage file are local (0 .. n-1); a stage's global offset is the sum of the
layers of the stages before it. The embeddings live on the first stage, the final norm and the
output layer on the last; with tied embeddings and PP > 1 the last stage holds a copy of the word
embeddings for the head, which must equal the first stage's. Where those tensors are named is a
`StageNames` (LEGACY: the legacy model's nested keys flattened with '/', MCORE: GPTModel's keys).
"""

from __future__ import annotations

import re
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch

from converters.errors import ConversionError
from converters.megatron_pt import flatten, load_checkpoint_file

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"


@dataclass(frozen=True)
class StageNames:
    layer: re.Pattern  # a layer tensor: group 1 its index, group 2 the rest of its name
    layer_format: str  # (index, rest) -> name
    embedding: str  # prefix of the first stage's tensors
    word_embeddings: str
    head_copy: str  # the last stage's copy of the tied word embeddings (PP > 1)


LEGACY = StageNames(re.compile(r"^language_model/encoder/layers\.(\d+)\.(.+)$"), "language_model/encoder/layers.{}.{}",
                    "language_model/embedding/", "language_model/embedding/word_embeddings/weight",
                    "word_embeddings_for_head/weight")
# megatron-core GPTModel: a stage that is not the first has no `embedding`; the last stage's
# `output_layer.weight` is the tied head's copy (megatron-core keeps it in sync over the embedding group).
MCORE = StageNames(re.compile(r"^decoder\.layers\.(\d+)\.(.+)$"), "decoder.layers.{}.{}", "embedding.",
                   "embedding.word_embeddings.weight", "output_layer.weight")


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


def stage_files(d: Path) -> list[Path]:
    """Every model_optim_rng.pt of a written checkpoint, in (TP, PP) order."""
    return sorted(d.glob(f"*/mp_rank_*/{FILE}"))


def layers_per_stage(args: Namespace, pp: int) -> list[int]:
    """How many transformer layers each pipeline stage holds, as Megatron-LM splits them."""
    n = args.num_layers
    first, last = (getattr(args, "decoder_first_pipeline_num_layers", None),
                   getattr(args, "decoder_last_pipeline_num_layers", None))
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
            raise ConversionError(f"args: {n} layers do not split evenly over {pp - 1} stages "
                                  "after the embedding stage")
        return [0] + [n // (pp - 1)] * (pp - 1)
    if n % pp:
        raise ConversionError(f"args: num_layers {n} is not divisible by pipeline_model_parallel_size {pp}, and "
                              "the args name no uneven split (decoder_first/last_pipeline_num_layers)")
    return [n // pp] * pp


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


# --------------------------------------------------------------------------- pipeline stages

def split_stages(state: dict, counts: list[int], tied: bool, names: StageNames = LEGACY) -> list[dict]:
    """One TP rank's full flat state (global layer indices) -> its pipeline stages (local indices)."""
    pp = len(counts)
    starts = [sum(counts[:s]) for s in range(pp)]
    stages = [{} for _ in range(pp)]
    for key, t in state.items():
        m = names.layer.match(key)
        if m:
            i = int(m.group(1))
            s = max(s for s in range(pp) if starts[s] <= i and counts[s] > 0)
            stages[s][names.layer_format.format(i - starts[s], m.group(2))] = t
        elif key.startswith(names.embedding):
            stages[0][key] = t
        else:  # final layer norm, untied output layer
            stages[-1][key] = t
    if tied and pp > 1:
        stages[-1][names.head_copy] = state[names.word_embeddings]
    return stages


def merge_stages(stages: list[dict], counts: list[int], tied: bool, where: str, names: StageNames = LEGACY) -> dict:
    """A TP rank's stages -> its full flat state with global layer indices (inverse of split_stages)."""
    out, start, last = {}, 0, len(stages) - 1
    copy = tied and last > 0
    for s, (stage, count) in enumerate(zip(stages, counts)):
        local = sorted({int(m.group(1)) for m in map(names.layer.match, stage) if m})
        if local != list(range(count)):
            raise ConversionError(f"{where}: pipeline stage {s} holds layers "
                                  f"{local[:4]}{'...' if len(local) > 4 else ''}"
                                  f" ({len(local)}), the args say {count}")
        for key, t in stage.items():
            m = names.layer.match(key)
            if m:
                key = names.layer_format.format(start + int(m.group(1)), m.group(2))
            elif key == names.head_copy and (copy or names is LEGACY):
                if s != last:
                    raise ConversionError(f"{where}: pipeline stage {s} holds {key} "
                                          "(the head's copy belongs to the last)")
                continue
            elif key.startswith(names.embedding) and s != 0:
                raise ConversionError(f"{where}: pipeline stage {s} holds {key} (embeddings belong to stage 0)")
            if key in out:
                raise ConversionError(f"{where}: {key} is stored by two pipeline stages")
            out[key] = t
        start += count
    if copy:
        head, emb = stages[-1].get(names.head_copy), out.get(names.word_embeddings)
        if head is None:
            raise ConversionError(f"{where}: the last pipeline stage has no {names.head_copy} (tied embeddings)")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise ConversionError(f"{where}: the last stage's {names.head_copy} differs from the first stage's word "
                                  "embeddings, but the args say they are tied")
    return out


def read_stages(it_dir: Path, args: Namespace, tp: int, pp: int, iteration: int, progress=None,
                names: StageNames = LEGACY, normalize=lambda key: key) -> list[dict]:
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
            if not isinstance(ckpt["model"], dict):
                raise ConversionError(f"{f}: 'model' is not a state dict")
            stages.append({normalize(k): v for k, v in flatten(ckpt["model"]).items()})
            if progress is not None:
                progress.update(1)
        ranks.append(merge_stages(stages, counts, tied, f"{it_dir} TP rank {t}", names))
    return ranks


def save_stages(dst: Path, ranks: list[list[dict]], args: Namespace, extra: dict, model=None) -> None:
    """ranks[tp][pp] flat stage states -> release/mp_rank_*/model_optim_rng.pt (+ the tracker).
    `model(state, tp, pp)` makes a stage file's 'model' entry from its flat state (default: nested, legacy)."""
    from converters.megatron_pt import nest

    model = model or (lambda state, t, p: nest(state))
    (dst / TRACKER).write_text("release")
    pp = len(ranks[0])
    for t, stages in enumerate(ranks):
        for p, state in enumerate(stages):
            d = rank_dir(dst / "release", t, p, pp)
            d.mkdir(parents=True)
            ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": 0,
                    "model": model({k: compact(v) for k, v in state.items()}, t, p), **extra}
            torch.save(ckpt, d / FILE)


def compact(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: copy shards that are views of bigger tensors."""
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
