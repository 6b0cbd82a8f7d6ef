"""`MegatronGPT`: the `Backend` for megatron-core's GPTModel (TP over torch.distributed).

TP > 1 needs one process per rank. Inside ranks (e.g. `torchrun --nproc_per_node 2 script.py`
calling `from_hf(..., tp_size=2)` everywhere) the model is built right here and every rank
returns the same results. From a single process, `from_hf(..., tp_size=2)` starts the ranks
with `plugins.launch.launcher` and returns its proxy, which forwards every call to them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from plugins.core.checkpoint import check_memory, read_hf_config, read_hf_state
from plugins.core.config import ConfigError
from plugins.core.tensors import default_device, needs_ranks, position_ids, resolve_dtype
from plugins.engine.backend import LocalBackend
from plugins.megatron.decoder import MegatronDecoder, MegatronPoolDecoder, causal_padding_mask, place_rows
from plugins.megatron.model import build_model, check_config, init_parallel, load_rank_state

# how ranks are started (plugins.launch.launcher)
LAUNCHER_OPTIONS = ("launcher", "env", "timeout_s", "nnodes", "rdzv_endpoint")


def _no_options(options: dict) -> None:
    """Launcher options (LAUNCHER_OPTIONS) only mean something when ranks are started."""
    if options:
        raise ConfigError(f"unexpected option(s) {', '.join(sorted(options))} for an in-process model")


def _remote(method: str, path, dtype, tp_size: int, **options):
    from plugins.launch.launcher import RemoteBackend
    return RemoteBackend("megatron", path, dtype=dtype, tp_size=tp_size, method=method, **options)


class MegatronGPT(LocalBackend):
    name = "megatron"

    def __init__(self, model, config, dtype: torch.dtype, tp_size: int):
        self.model = model
        self.config = config
        self.dtype = dtype
        self.tp_size = tp_size
        self.device = default_device()

    @classmethod
    def check_options(cls, config, tp_size: int, **options) -> None:
        unknown = sorted(set(options) - {"attention", *LAUNCHER_OPTIONS})
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} for backend 'megatron'; known: attention, "
                              f"{', '.join(LAUNCHER_OPTIONS)}")
        check_config(config, tp_size, options.get("attention", "sdpa"))

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype="float32", tp_size: int = 1, attention: str = "sdpa", **options):
        """attention: "sdpa" (plugins/megatron/attention.py) or "megatron" (DotProductAttention)."""
        dtype = resolve_dtype(dtype)
        config = read_hf_config(hf_dir)
        check_config(config, tp_size, attention)
        if needs_ranks(tp_size):
            return _remote("from_hf", hf_dir, dtype, tp_size, attention=attention, **options)
        _no_options(options)
        check_memory(config, dtype, str(hf_dir))
        return cls.from_state(config, read_hf_state(hf_dir, config), dtype, tp_size, attention)

    @classmethod
    def from_state(cls, config, hf_state: dict, dtype=torch.float32, tp_size: int = 1, attention: str = "sdpa"):
        """Build this rank's model from an HF state dict (split with converters.mapping)."""
        from converters.mapping import hf_to_mcore

        rank = init_parallel(tp_size)
        model = build_model(config, tp_size, dtype, attention=attention)
        shard = hf_to_mcore(hf_state, config, tp_size)[rank]
        load_rank_state(model, {k: v.to(dtype) for k, v in shard.items()})
        return cls(model.to(default_device()), config, dtype, tp_size)

    @classmethod
    def from_megatron(cls, ckpt_dir: str | Path, dtype="float32", tp_size: int = 1, attention: str = "sdpa",
                      **options):
        """Load a megatron-core dist checkpoint (converters/megatron_core.py: read safely, resharded for
        `tp_size` by the mapping table) at any TP size."""
        from converters import megatron_core

        dtype = resolve_dtype(dtype)
        config = megatron_core.read_config(ckpt_dir)
        check_config(config, tp_size, attention)
        if needs_ranks(tp_size):
            return _remote("from_megatron", ckpt_dir, dtype, tp_size, attention=attention, **options)
        _no_options(options)
        config, hf_state = megatron_core.read(ckpt_dir)
        return cls.from_state(config, hf_state, dtype, tp_size, attention)

    def save_megatron(self, dst: str | Path) -> None:
        """Write this model as a megatron-core dist checkpoint into the existing, empty directory `dst`
        (every rank calls this; rank 0 gathers the shards and writes)."""
        from converters import megatron_core
        from converters.mapping import mcore_to_hf

        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        states = [state]
        if self.tp_size > 1:
            states = [None] * self.tp_size
            dist.all_gather_object(states, state)
        if not dist.is_initialized() or dist.get_rank() == 0:
            megatron_core.write(self.config, mcore_to_hf(states, self.config), dst, self.tp_size)
        if dist.is_initialized():
            dist.barrier()

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        from plugins import kernels  # compat routes megatron's bf16 linears through the probe

        return kernels.paths(self.dtype, batch, prompt_len)

    @torch.inference_mode()
    def logits(self, input_ids, attention_mask):
        input_ids, attention_mask = self._prepare(input_ids, attention_mask)
        place_rows(self.model, attention_mask)
        out = self.model(input_ids, position_ids(attention_mask),
                         causal_padding_mask(attention_mask, getattr(self.model, "window", None)),
                         runtime_gather_output=True)
        return out[..., : self.config.vocab_size].float().cpu()

    def decoder(self, batch_size: int, max_len: int) -> MegatronDecoder:
        return MegatronDecoder(self.model, batch_size, max_len, self.config.vocab_size)

    def batch_decoder(self, slots: int, capacity: int) -> MegatronPoolDecoder:
        return MegatronPoolDecoder(self, slots, capacity)
