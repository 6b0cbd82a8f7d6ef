"""Helpers the converter tests share (imported like live_server: pytest puts tests/ on sys.path)."""

from pathlib import Path

import torch


def load_rank(d, rank=0):
    from megatron.core.safe_globals import register_safe_globals
    register_safe_globals()
    return torch.load(Path(d) / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=True)


def assert_nothing_left(dst):
    dst = Path(dst)
    assert not dst.exists()
    assert not list(dst.parent.glob(f".{dst.name}.tmp-*")), "temp dir left behind"


def hub_of(model):
    """The HF state dict as a hub checkpoint holds it (no lm_head.weight when tied)."""
    return {k: v for k, v in model.state_dict().items()
            if k != "lm_head.weight" or not model.config.tie_word_embeddings}
