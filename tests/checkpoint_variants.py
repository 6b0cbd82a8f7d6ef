"""Checkpoint variants the TP tests share (imported like live_server: pytest puts tests/ on sys.path)."""

from pathlib import Path

import torch

from plugins.core.checkpoint import load_hf_model, save_hf_dir


def biased_copy(src, dst: Path) -> Path:
    """`src` with seeded random biases and norms (a seeded checkpoint's are zero / one), saved at `dst`:
    tensor parallelism must add each all-reduced linear's bias once and shard the norms right."""
    model = load_hf_model(src)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or "norm" in name:  # gpt_bigcode ln_*, starcoder2 *norm
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return save_hf_dir(model, dst)
