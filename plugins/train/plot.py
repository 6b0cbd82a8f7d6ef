"""The loss curve of a training run as a PNG: train loss per step (raw and smoothed), held-out loss at
each saved state and at the end, and the unigram baseline."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_loss(log: dict, path: Path) -> None:
    steps = list(range(1, len(log["loss"]) + 1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, log["loss"], color="#4c72b0", alpha=0.25, linewidth=0.8, label="train loss (per step)")
    ax.plot(steps, smooth(log["loss"]), color="#4c72b0", linewidth=1.8, label="train loss (20-step mean)")
    if log["heldout"]:
        xs, ys = zip(*log["heldout"])
        ax.plot(xs, ys, "o-", color="#dd8452", label="held-out loss (whole held-out files)")
    if "unigram_heldout_nats" in log:
        ax.axhline(log["unigram_heldout_nats"], color="gray", linestyle="--",
                   label=f"unigram baseline on held-out ({log['unigram_heldout_nats']:.2f})")
    spec = log["spec"]
    ax.set(xlabel="step", ylabel="cross-entropy (nats / token)",
           title=f"{log.get('name') or 'model'}: {spec['steps']} steps x {spec['batch']} x {spec['seq_len']} tokens")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
