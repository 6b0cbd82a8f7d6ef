"""A test helper the launcher builds in every TP rank: megatron-core's own dist-checkpoint writer
on a real GPTModel (what Megatron-LM's training saves), to check our reader against upstream files."""

import json
from pathlib import Path

from plugins.megatron import MegatronGPT


class UpstreamWriter(MegatronGPT):
    name = "megatron-upstream-writer"

    def save_upstream(self, dst: str) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self.model.sharded_state_dict(), dst)  # every rank writes its shards
        self.config.to_json_file(Path(dst) / "config.json")


def save_upstream_in_process(model, config, dst: Path) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), str(dst))
    config.to_json_file(dst / "config.json")


def state_metadata(d):
    """megatron-core's metadata of a dist checkpoint: tensor name -> its chunks."""
    from converters.megatron_core import read_metadata

    return read_metadata(Path(d)).state_dict_metadata


def add_our_meta(d, padded_vocab, tp_size=1):
    """What our writer adds beside upstream's files (megatron.json), so our reader takes them."""
    (Path(d) / "megatron.json").write_text(json.dumps({"format": "megatron-core dist_checkpointing", "tp_size": tp_size,
                                                       "dtype": "float32", "padded_vocab_size": padded_vocab}))


# megatron-core 0.19 (PR #5160, serialization.py of core_v0.19.0) keeps the common (non-sharded) state inside the
# dist checkpoint, as this ShardedObject (global shape (1,), offset (0,)), instead of writing common.pt.
COMMON_STATE = "common_state/shard_0_1"
CONFIG_019 = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}  # its CheckpointingConfig: no common_backend


def save_like_megatron_core_019(sharded_state_dict: dict, checkpoint_dir: Path) -> None:
    """0.19's `dist_checkpointing.save` on 0.16.1's parts: save_preprocess splits off the common state, which
    becomes the ShardedObject 'common_state' (replica_id = the rank) saved with the sharded part by the
    torch_dist strategy (objects as torch.save([data]) bytes), then metadata.json without common_backend."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sharded, common = save_preprocess(sharded_state_dict, True)
    sharded["common_state"] = ShardedObject(key="common_state", data=common, global_shape=(1,), global_offset=(0,),
                                            replica_id=torch.distributed.get_rank())
    TorchDistSaveShardedStrategy("torch_dist", 1).save(sharded, checkpoint_dir)
    if torch.distributed.get_rank() == 0:
        (Path(checkpoint_dir) / "metadata.json").write_text(json.dumps(CONFIG_019))
    torch.distributed.barrier()


def load_like_megatron_core_019(sharded_state_dict: dict, checkpoint_dir: Path, strict):
    """0.19's `dist_checkpointing.load`, which differs from 0.16.1's in two steps: the common state comes
    from the 'common_state' object (`load_common_state_dict`: torch.distributed.checkpoint.load of its bytes,
    torch.load weights_only, [0]) and that object is left out of the strict key check."""
    import io
    from unittest import mock

    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing import load, serialization
    from megatron.core.dist_checkpointing.strategies.base import LoadCommonStrategy

    class CommonState(LoadCommonStrategy):
        def load_common(self, checkpoint_dir):
            assert not (Path(checkpoint_dir) / "common.pt").exists()
            state = {COMMON_STATE: io.BytesIO()}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint_dir)), no_dist=True)
            loaded = state[COMMON_STATE]
            if isinstance(loaded, io.BytesIO):
                loaded.seek(0)
                loaded = torch.load(loaded, weights_only=True)
            return loaded[0]

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise NotImplementedError  # the torch_dist strategy loads sharded objects itself

        def check_backend_compatibility(self, loaded_backend):
            pass

        def check_version_compatibility(self, loaded_version):
            pass

    upstream_metadata = serialization.load_sharded_metadata

    def without_common_state(*args, **kwargs):
        return {k: v for k, v in upstream_metadata(*args, **kwargs).items() if v.key != "common_state"}

    with mock.patch.object(serialization, "load_sharded_metadata", without_common_state):
        return load(sharded_state_dict, str(checkpoint_dir), common_strategy=CommonState(), strict=strict)
