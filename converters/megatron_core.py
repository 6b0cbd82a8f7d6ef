"""The megatron-core `dist_checkpointing` format (what `GPTModel.sharded_state_dict()` saves).

A directory holds megatron-core's own files (`metadata.json`, `common.pt`, `.metadata`,
`__*_*.distcp`) plus ours: `config.json` (the HF `GPTBigCodeConfig`) and `megatron.json`
(dtype, padded vocabulary, the TP size it was written at). Tensors are stored as global
tensors (layers stacked, layernorms under Transformer-Engine names), so a checkpoint written at
one TP size loads at any other: megatron-core reshards on load.

Reading and writing go through a real `GPTModel` (TP=1 in this process, or TP ranks started by
plugins.launcher), so megatron-core's own sharding code decides the on-disk layout; names and
TP splits come from converters.mapping.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPTBigCodeConfig

from converters.mapping import ConversionError, hf_to_mcore, mcore_to_hf

FORMAT = "megatron-core dist_checkpointing"
META_NAME = "megatron.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_meta(src: str | Path) -> dict:
    src = Path(src)
    if not (src / META_NAME).is_file() or not (src / "metadata.json").is_file():
        raise ConversionError(f"{src} is not a megatron-core checkpoint written by this project "
                              f"(needs {META_NAME} and metadata.json)")
    return json.loads((src / META_NAME).read_text())


def read_config(src: str | Path) -> GPTBigCodeConfig:
    read_meta(src)
    return GPTBigCodeConfig.from_json_file(Path(src) / "config.json")


def check_writable(config: GPTBigCodeConfig, tp_size: int = 1) -> None:
    """Everything `write` would refuse, checked before any work."""
    from plugins.megatron.model import check_config

    check_config(config, tp_size)


def _dtype_of(hf_state: dict) -> torch.dtype:
    return next(t.dtype for t in hf_state.values() if t.is_floating_point())


def save_model(model, config: GPTBigCodeConfig, dst: str | Path) -> None:
    """Every rank of `model` calls this; rank 0 also writes config.json and megatron.json."""
    import megatron.core
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)  # dist_checkpointing expects the directory to exist
    dist_checkpointing.save(model.sharded_state_dict(), str(dst))
    if dist.get_rank() == 0:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        weights = model.embedding.word_embeddings.weight
        meta = {"format": FORMAT, "megatron_core": megatron.core.__version__, "tp_size": tp,
                "dtype": str(weights.dtype).removeprefix("torch."), "padded_vocab_size": weights.shape[0] * tp}
        config.to_json_file(dst / "config.json")
        (dst / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()


def load_model(src: str | Path, tp_size: int = 1, attention: str = "sdpa"):
    """This rank's GPTModel with the checkpoint's weights, in the checkpoint's dtype."""
    from megatron.core import dist_checkpointing

    from plugins.megatron.model import build_model, init_parallel, load_rank_state

    meta, config = read_meta(src), read_config(src)
    init_parallel(tp_size)
    model = build_model(config, tp_size, _DTYPES[meta["dtype"]], padded_vocab=meta["padded_vocab_size"],
                        attention=attention)
    load_rank_state(model, dist_checkpointing.load(model.sharded_state_dict(), str(src)), f"{src}: tensors")
    return model, config


def read(src: str | Path) -> tuple[GPTBigCodeConfig, dict]:
    """(config, HF-named full state dict) from a megatron-core dist checkpoint."""
    model, config = load_model(src, tp_size=1)
    return config, mcore_to_hf([model.state_dict()], config)


def write(config: GPTBigCodeConfig, hf_state: dict, dst_tmp_dir: str | Path, tp_size: int = 1) -> None:
    """Write `hf_state` as a megatron-core dist checkpoint into an existing (empty) directory.

    tp_size=1 builds the model here; tp_size > 1 saves from tp_size ranks started by
    plugins.launcher (the files are then written per rank, as a TP run would).
    """
    from plugins.megatron.model import build_model, check_config, init_parallel, load_rank_state

    check_config(config, tp_size)
    dtype = _dtype_of(hf_state)
    if tp_size == 1:
        init_parallel(1)
        model = build_model(config, 1, dtype)
        load_rank_state(model, hf_to_mcore(hf_state, config, 1)[0])
        save_model(model, config, dst_tmp_dir)
        return
    from plugins.launcher import RemoteBackend

    with tempfile.TemporaryDirectory(prefix="megatron-write-") as hf_dir:
        config.save_pretrained(hf_dir)
        save_file({k: v.contiguous() for k, v in hf_state.items()}, Path(hf_dir) / "model.safetensors")
        with RemoteBackend("megatron", hf_dir, dtype=dtype, tp_size=tp_size) as ranks:
            ranks.save_megatron(str(dst_tmp_dir))
