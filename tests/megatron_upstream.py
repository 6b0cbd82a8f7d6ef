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
