"""A resumable training state on disk, with no pickle: tensors in safetensors, everything else in JSON.

  config.json + model.safetensors   the weights, as an HF directory (loadable as is, with its tokenizer)
  optimizer.safetensors             AdamW's per-parameter tensors (step, exp_avg, exp_avg_sq) and the RNG
  trainer_state.json                step, data position, optimizer param groups, the loss log, the spec

The directory is replaced atomically (plugins.core.atomic), so an interrupted write leaves the
previous state whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plugins.core.atomic import atomic_dir
from plugins.core.checkpoint import WEIGHTS_NAME, write_hf_files

OPTIMIZER_FILE, TRAINER_FILE = "optimizer.safetensors", "trainer_state.json"


def save_state(state_dir: Path, model, optimizer: torch.optim.Optimizer, trainer: dict,
               tokenizer: str | None = None) -> None:
    """`tokenizer`: the name of the run's tokenizer, written beside the weights (plugins.core.checkpoint)."""
    sd = optimizer.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    scalars = {}
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    with atomic_dir(state_dir, force=True) as tmp:
        write_hf_files(model, tmp, tokenizer=tokenizer)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        (tmp / TRAINER_FILE).write_text(json.dumps({**trainer, "param_groups": groups, "scalars": scalars}))


def has_state(state_dir: Path) -> bool:
    return all((Path(state_dir) / f).is_file() for f in (WEIGHTS_NAME, OPTIMIZER_FILE, TRAINER_FILE))


def load_state(state_dir: Path, model, optimizer: torch.optim.Optimizer) -> dict:
    """Weights, optimizer and RNG restored in place; returns the trainer dict (step, data, log, spec)."""
    state_dir = Path(state_dir)
    trainer = json.loads((state_dir / TRAINER_FILE).read_text())
    weights = load_file(state_dir / WEIGHTS_NAME)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the tied head is not stored
        raise ValueError(f"{state_dir}: weights do not match the model ({missing[:3]}, {unexpected[:3]})")
    tensors = load_file(state_dir / OPTIMIZER_FILE)
    torch.set_rng_state(tensors.pop("rng.torch"))
    state = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for name, value in trainer.pop("scalars").items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in trainer.pop("param_groups")]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return trainer
