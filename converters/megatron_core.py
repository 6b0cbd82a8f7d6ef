"""The megatron-core `dist_checkpointing` format (`torch_dist`: what `GPTModel.sharded_state_dict()`
saves and megatron-core / Megatron-LM load), read and written as plain state dicts, no model.

A directory holds megatron-core's files (`metadata.json`, `common.pt`, torch.distributed.checkpoint's
`.metadata` and `__R_T.distcp`) plus ours: `config.json` (the HF config, either family) and
`megatron.json` (dtype, padded vocabulary, the TP size the vocabulary was padded for). Tensors are
global: per-layer tensors stacked on a leading layer axis under `decoder.layers.<name>`, layer
norms under the names megatron-core's local layer spec maps them to (`LAYER_KEYS` below), and one
`_extra_state` object per linear layer and layer. A checkpoint loads at any TP size: megatron-core
reshards on load, and so do we (converters.mapping).

Reading never unpickles anything but an allow-list of torch.distributed.checkpoint's own metadata
classes (`SafeUnpickler`); tensors are read with `torch.load(weights_only=True)` from the byte
ranges the metadata names, after every size was checked against the config; `_extra_state`
objects (pickles: megatron-core loads them with `weights_only=False`) are never read.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch
from transformers import GPTBigCodeConfig

from converters.mapping import (TE_LAYER_NORMS, ConversionError, check_megatron_config, hf_to_megatron,
                                megatron_to_hf, padded_vocab_size, stored_dtype)
from plugins.core.checkpoint import CONFIG_CLASSES
from plugins.core.config import arch, check_hf_config, hf_shapes
from plugins.core.tensors import FLOAT_DTYPES, dtype_name

FORMAT = "megatron-core dist_checkpointing"
META_NAME = "megatron.json"
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}
# the local spec's layer norms are saved under the TE spec's names (its sharded_state_dict_keys_map)
LAYER_KEYS = TE_LAYER_NORMS
LAYER_PREFIX = "decoder.layers."
# linear layers whose (empty) `_extra_state` megatron-core saves per layer
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


# --------------------------------------------------------------------------- names

def layer_key(name: str) -> tuple[str, int | None]:
    """A megatron-core state-dict name -> (dist-checkpoint key, layer index or None)."""
    if not name.startswith(LAYER_PREFIX):
        return name, None
    index, rest = name[len(LAYER_PREFIX):].split(".", 1)
    for old, new in LAYER_KEYS.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    return LAYER_PREFIX + rest, int(index)


def dist_tensors(state: dict, n_layer: int) -> dict[str, torch.Tensor]:
    """The model's full (TP=1) megatron-core state dict -> global dist-checkpoint tensors."""
    layers, out = {}, {}
    for name, t in state.items():
        key, i = layer_key(name)
        if i is None:
            out[key] = t
        else:
            layers.setdefault(key, [None] * n_layer)[i] = t
    for key, ts in layers.items():
        out[key] = torch.stack(ts)
    return out


def mcore_names(dist: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Global dist-checkpoint tensors -> the megatron-core state dict names (inverse of dist_tensors)."""
    back = {new: old for old, new in LAYER_KEYS.items()}
    out = {}
    for key, t in dist.items():
        if not key.startswith(LAYER_PREFIX):
            out[key] = t
            continue
        rest = key[len(LAYER_PREFIX):]
        for new, old in back.items():
            if rest.startswith(new):
                rest = old + rest[len(new):]
        for i in range(t.shape[0]):
            out[f"{LAYER_PREFIX}{i}.{rest}"] = t[i]
    return out


# --------------------------------------------------------------------------- write

def check_writable(config: GPTBigCodeConfig, tp_size: int = 1) -> None:
    """Everything `write` would refuse, checked before any work."""
    check_megatron_config(config, tp_size, "mcore")


def write(config: GPTBigCodeConfig, hf_state: dict, dst: str | Path, tp_size: int = 1, progress=None) -> None:
    """Write `hf_state` as a megatron-core dist checkpoint into an existing (empty) directory.

    The vocabulary is padded for `tp_size` (a multiple of 128 x TP, as Megatron pads it)."""
    import torch.distributed.checkpoint as dcp

    check_writable(config, tp_size)
    dst = Path(dst)
    padded = padded_vocab_size(config.vocab_size, tp_size)
    state = hf_to_megatron(hf_state, config, "mcore", 1, padded, progress=progress)[0]
    n_layer = arch(config).n_layer
    tensors = dist_tensors(state, n_layer)
    # a local-spec linear's extra state, as megatron-core stores it: torch.save of [None]
    objects = {f"{LAYER_PREFIX}{m}._extra_state/shard_{i}_{n_layer}": [None]
               for m in EXTRA_STATE for i in range(n_layer)}
    # as megatron-core saves: keys not flattened; the planner torch.saves each object
    dcp.save({**tensors, **objects}, storage_writer=dcp.FileSystemWriter(str(dst), thread_count=1),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save({}, dst / "common.pt")
    (dst / "metadata.json").write_text(json.dumps(MCORE_METADATA))
    config.to_json_file(dst / "config.json")
    meta = {"format": FORMAT, "tp_size": tp_size, "dtype": dtype_name(stored_dtype(hf_state)),
            "padded_vocab_size": padded}
    (dst / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def check_loadable(dst: str | Path, config: GPTBigCodeConfig) -> None:
    """The checkpoint holds exactly the tensors (global shapes) and objects of megatron-core's
    `GPTModel.sharded_state_dict()`: what `dist_checkpointing.load(..., strict=RAISE_ALL)` accepts."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from converters import consumers

    dst = Path(dst)
    got = {k: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
           for k, md in read_metadata(dst).state_dict_metadata.items()}
    want = consumers.mcore_sharded_keys(config, read_meta(dst)["padded_vocab_size"])
    consumers.check_strict(".metadata", got, want, "megatron-core dist_checkpointing.load of GPTModel")


# --------------------------------------------------------------------------- read

_DCP = "torch.distributed.checkpoint."


class SafeUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` pickle, with only its own dataclasses, torch sizes,
    dtypes and layouts allowed: any other global (a code-running payload) is refused."""

    ALLOWED = {
        (_DCP + "metadata", n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                         "_MEM_FORMAT_ENCODING")
    } | {(_DCP + "filesystem", "_StorageInfo")} | {
        (_DCP + "planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")
    } | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
         ("pathlib", "PosixPath")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                              torch.dtype)):
            return super().find_class(module, name)
        raise ConversionError(f"refusing to load {module}.{name} from a checkpoint's .metadata "
                              "(only torch.distributed.checkpoint's own metadata is read)")


def read_meta(src: str | Path) -> dict:
    src = Path(src)
    for name in (META_NAME, "metadata.json", "config.json", ".metadata"):
        if not (src / name).is_file():
            raise ConversionError(f"{src} is not a megatron-core checkpoint written by this project (no {name})")
    try:
        meta = json.loads((src / META_NAME).read_text())
        backend = json.loads((src / "metadata.json").read_text()).get("sharded_backend")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ConversionError(f"{src}: {META_NAME} or metadata.json is not valid JSON ({e})") from None
    if backend != "torch_dist":
        raise ConversionError(f"{src}: sharded backend {backend!r}; only megatron-core's torch_dist is read")
    if not isinstance(meta, dict) or not isinstance(meta.get("padded_vocab_size"), int):
        raise ConversionError(f"{src}/{META_NAME}: expected a mapping with an integer padded_vocab_size")
    return meta


def read_config(src: str | Path) -> GPTBigCodeConfig:
    read_meta(src)
    try:
        raw = json.loads((Path(src) / "config.json").read_text())
        config = CONFIG_CLASSES.get(raw.get("model_type"), GPTBigCodeConfig).from_dict(raw)
    except Exception as e:  # invalid JSON, transformers' own field validation
        raise ConversionError(f"{src}/config.json: not a valid config ({type(e).__name__}: {e})") from None
    check_hf_config(config, f"{src}/config.json")
    return config


def read_metadata(src: Path):
    try:
        with open(src / ".metadata", "rb") as f:
            metadata = SafeUnpickler(f).load()
    except ConversionError:
        raise
    except Exception as e:  # truncated or corrupt pickle
        raise ConversionError(f"cannot read {src / '.metadata'}: {type(e).__name__}: {e}") from None
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise ConversionError(f"{src / '.metadata'}: not torch.distributed.checkpoint metadata")
    return metadata


def expected_shapes(config: GPTBigCodeConfig, padded: int) -> dict[str, tuple]:
    """Global shape of every tensor the checkpoint must hold (from the mapping table, on meta tensors)."""
    meta = {k: torch.empty(v, device="meta") for k, v in hf_shapes(config).items()}
    state = hf_to_megatron(meta, config, "mcore", 1, padded)[0]
    return {k: tuple(t.shape) for k, t in dist_tensors(state, arch(config).n_layer).items()}


def read(src: str | Path, progress=None) -> tuple[GPTBigCodeConfig, dict]:
    """(config, HF-named full state dict) from a megatron-core dist checkpoint."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    src = Path(src)
    meta, config = read_meta(src), read_config(src)
    check_megatron_config(config, 1, "mcore")
    padded = meta["padded_vocab_size"]
    want = expected_shapes(config, padded)
    metadata = read_metadata(src)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ConversionError(f"{src}: tensors do not match config.json (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    files = {}
    for key, md in tensors.items():  # every size checked before anything is allocated
        if tuple(md.size) != want[key]:
            raise ConversionError(f"{src}: {key} has shape {tuple(md.size)}, config.json says {want[key]}")
        if md.properties.dtype not in FLOAT_DTYPES:
            raise ConversionError(f"{src}: {key} is {md.properties.dtype}, not a floating-point weight")
        for chunk in md.chunks:
            info = metadata.storage_data.get(MetadataIndex(key, torch.Size(chunk.offsets)))
            if info is None or info.transform_descriptors:
                raise ConversionError(f"{src}: {key} has a chunk without plain storage")
            path = (src / info.relative_path).resolve()
            if path.parent != src.resolve() or not path.is_file():
                raise ConversionError(f"{src}: {key} is stored in {info.relative_path!r}, not a file of the checkpoint")
            size = files.setdefault(path, path.stat().st_size)
            nbytes = torch.Size(chunk.sizes).numel() * md.properties.dtype.itemsize
            if info.offset < 0 or info.length < nbytes or info.offset + info.length > size:
                raise ConversionError(f"{src}: {key} lies outside {path.name} (truncated checkpoint?)")
    dist = {}
    for key, md in tensors.items():
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            info = metadata.storage_data[MetadataIndex(key, torch.Size(chunk.offsets))]
            with open(src / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            try:
                part = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as e:
                raise ConversionError(f"{src}: cannot read {key}: {type(e).__name__}: {e}") from None
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                raise ConversionError(f"{src}: {key} chunk at {tuple(chunk.offsets)} is not a "
                                      f"{tuple(chunk.sizes)} tensor")
            full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = part
            covered += part.numel()
        if covered != full.numel():
            raise ConversionError(f"{src}: the chunks of {key} do not cover the tensor")
        dist[key] = full
    return config, megatron_to_hf([mcore_names(dist)], config, "mcore", padded, progress=progress)
