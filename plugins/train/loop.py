"""Train a gpt_bigcode model from a model config's `train:` section; resumable, deterministic for a seed.

The model starts from the project's seeded init (plugins.core.checkpoint.init_model), trains with
AdamW (linear warmup, cosine decay) on windows of the stdlib train split, and is written as an HF
directory (complete, like the seeded checkpoints: plugins.core.checkpoint.write_hf_files, whose
`tokenizer.json` is the one it was trained with, what `checkpoint_tokenizer` finds) plus
`train_log.json` and `loss.png`, atomically. Every `checkpoint_every` steps the whole state (weights, AdamW, RNG,
data position, step, log) goes to `state_dir`; a run started with that state continues it and ends with
the same weights as an uninterrupted run (same machine, same thread count).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from plugins.core.atomic import atomic_dir, check_destination
from plugins.core.checkpoint import init_model, write_hf_files
from plugins.core.config import TrainSpec
from plugins.core.tokenizer import DEFAULT_TOKENIZER, check_vocab, load_tokenizer, tokenizer_file
from plugins.train import data
from plugins.train.plot import plot_loss
from plugins.train.state import has_state, load_state, save_state

LOG_FILE, PLOT_FILE, TOKENIZER_NAME = "train_log.json", "loss.png", "tokenizer.json"


def tokenizer_id(name: str) -> dict:
    """What a run records of its tokenizer: the name and a hash of the shipped file."""
    return {"name": name, "sha256": hashlib.sha256(tokenizer_file(name).read_bytes()).hexdigest()}


def learning_rate(spec: TrainSpec, step: int) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    floor = spec.lr * spec.min_lr_ratio
    return floor + (spec.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _autocast(spec: TrainSpec):
    # bf16 matmuls with fp32 master weights and fp32 loss; runs on any x86-64 CPU (fast with avx512_bf16/AMX)
    return torch.autocast("cpu", dtype=torch.bfloat16) if spec.precision == "bf16" else nullcontext()


def lm_loss(model, spec: TrainSpec, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of [B, L + 1] windows."""
    with _autocast(spec):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, spec: TrainSpec, tok=None) -> float:
    windows = data.heldout_windows(spec.eval_windows, spec.seq_len + 1, tok)
    was_training = model.training
    model.eval()
    losses = [float(lm_loss(model, spec, windows[i:i + spec.batch])) * len(windows[i:i + spec.batch])
              for i in range(0, len(windows), spec.batch)]
    model.train(was_training)
    return sum(losses) / len(windows)


def make_optimizer(model, spec: TrainSpec) -> torch.optim.AdamW:
    # weight decay on matrices only (embeddings included), not on biases and layer norms
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def train(config, spec: TrainSpec, dst: str | Path, state_dir: str | Path | None = None, name: str = "",
          force: bool = False, progress: bool = True, stop_at: int | None = None,
          tokenizer: str = DEFAULT_TOKENIZER) -> dict | None:
    """Train and write the HF directory `dst`; returns its log. `state_dir`: where resumable states go
    (default `<dst>.state`), removed once `dst` is written. `stop_at`: stop after the state of that
    step is saved, writing nothing else (what an interrupted run leaves; returns None). `tokenizer`:
    the name of the tokenizer the data is cut with (plugins.core.tokenizer.TOKENIZERS)."""
    from tqdm import tqdm

    dst = Path(dst)
    state_dir = Path(state_dir) if state_dir else dst.with_name(dst.name + ".state")
    check_destination(dst, force)
    tok = load_tokenizer(tokenizer)
    check_vocab(tok.get_vocab_size(), config.vocab_size, f"training {name or dst.name} with tokenizer {tokenizer}")
    model = init_model(config, seed=spec.seed)
    model.train()
    optimizer = make_optimizer(model, spec)
    batches = data.Batches(spec.seq_len, spec.batch, spec.seed, tok=tok)
    log = {"name": name, "spec": asdict(spec), "tokenizer": tokenizer_id(tokenizer), "loss": [], "heldout": [],
           "lr": [], "train_seconds": 0.0}
    step = 0
    if has_state(state_dir):
        trainer = load_state(state_dir, model, optimizer)
        if trainer["log"]["spec"] != log["spec"] or trainer["log"].get("tokenizer") != log["tokenizer"]:
            raise ValueError(f"{state_dir} is the state of another training run (its spec differs): "
                             "remove it to start over")
        step, log = trainer["step"], trainer["log"]
        batches.epoch, batches.index = trainer["data"]["epoch"], trainer["data"]["index"]
    bar = tqdm(total=spec.steps, initial=step, disable=not progress, unit="step", desc=f"train {name}".strip())
    t = time.perf_counter()
    while step < spec.steps:
        lr = learning_rate(spec, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, spec, batches.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss = float(loss.detach())
        log["loss"].append(loss)
        log["lr"].append(lr)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % spec.checkpoint_every == 0 and step < spec.steps:
            log["heldout"].append([step, heldout_loss(model, spec, tok)])
            log["train_seconds"] += time.perf_counter() - t
            t = time.perf_counter()
            save_state(state_dir, model, optimizer, {"step": step, "data": batches.position(), "log": log},
                       tokenizer=tokenizer)
            if stop_at is not None and step >= stop_at:
                bar.close()
                return None
    bar.close()
    log["train_seconds"] += time.perf_counter() - t
    log["heldout"].append([step, heldout_loss(model, spec, tok)])
    log.update(data.unigram_baseline(tok))
    tail = log["loss"][-max(1, min(20, len(log["loss"]))):]
    log.update(steps=step, tokens_seen=step * spec.batch * spec.seq_len, final_train_loss=sum(tail) / len(tail),
               heldout_loss=log["heldout"][-1][1], heldout_files=len(data.split_files()[1]))
    model.eval()
    with atomic_dir(dst, force=force) as tmp:
        write_hf_files(model, tmp, tokenizer=tokenizer)  # its tokenizer.json: what the data was cut with
        (tmp / LOG_FILE).write_text(json.dumps(log, indent=1))
        plot_loss(log, tmp / PLOT_FILE)
    shutil.rmtree(state_dir, ignore_errors=True)
    return log
