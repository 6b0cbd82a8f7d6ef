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
# its CheckpointingConfig: no common_backend
CONFIG_019 = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


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


# ---------------------------------------------------------------- Megatron-LM --ckpt-format torch files, loaded the
# way its load_checkpoint loads them: each rank's file into that rank's GPTModel with load_state_dict(strict=True)

def stage_model(config, tp_size: int, n_layers: int, pre_process: bool, post_process: bool, padded_vocab: int):
    """A real GPTModel of one pipeline stage (local spec, megatron-core's own attention), as Megatron-LM's
    gpt_builder builds it; parallel state must be set up (plugins.megatron.init_parallel)."""
    import torch
    from megatron.core.models.gpt import GPTModel

    from plugins.megatron.model import layer_spec, transformer_config

    tc = transformer_config(config, tp_size)
    tc.num_layers = n_layers
    return GPTModel(config=tc, transformer_layer_spec=layer_spec("megatron"), vocab_size=padded_vocab,
                    max_sequence_length=config.n_positions, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=config.tie_word_embeddings,
                    position_embedding_type="learned_absolute", parallel_output=False).to(torch.float32).eval()


def load_rank_files(ckpt_dir, config, tp_rank: int = 0) -> list:
    """This TP rank's stage models, each loaded strictly from its model_optim_rng.pt (weights-only, with
    megatron-core's safe globals, as Megatron-LM's torch.load does by default)."""
    import torch
    from megatron.core.safe_globals import register_safe_globals

    from converters.stages import FILE, layers_per_stage, rank_dir, read_layout

    register_safe_globals()
    it_dir, args, _ = read_layout(ckpt_dir)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    models = []
    for p, n in enumerate(layers_per_stage(args, pp)):
        ckpt = torch.load(rank_dir(it_dir, tp_rank, p, pp) / FILE, map_location="cpu", weights_only=True)
        model = stage_model(config, tp, n, p == 0, p == pp - 1, args.padded_vocab_size)
        model.load_state_dict(ckpt["model"], strict=True)
        models.append(model)
    return models


def chained_logits(stages: list, input_ids, attention_mask, vocab_size: int):
    """Pipeline stages run in turn in one process: each later stage takes the previous one's hidden states
    (set_input_tensor, as Megatron-LM's schedules do), the last returns the (TP-gathered) logits."""
    import torch

    from plugins.core.tensors import position_ids
    from plugins.megatron.decoder import causal_padding_mask

    pos, mask = position_ids(attention_mask), causal_padding_mask(attention_mask)
    hidden = None
    with torch.inference_mode():
        for s, model in enumerate(stages):
            if s > 0:
                model.set_input_tensor(hidden)
            hidden = model(input_ids, pos, mask, runtime_gather_output=True)
    return hidden[..., :vocab_size].float()


class TorchFormatLoader(MegatronGPT):
    """In each TP rank: load that rank's files of a megatron-torch checkpoint into fresh stage models."""

    name = "megatron-torch-loader"

    def torch_format_logits(self, ckpt_dir: str, input_ids, attention_mask):
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
        stages = load_rank_files(ckpt_dir, self.config, rank)
        return chained_logits(stages, input_ids, attention_mask, self.config.vocab_size)
