"""Train a small code model on the Python standard library from a model config's `train:` section.
Run as `mqa-train`, `python -m plugins.train` or `scripts/train.py`.

  mqa-train code-mqa                      # -> checkpoints/code-mqa-trained/ (resumes an interrupted run)
  mqa-train code-draft --out /tmp/draft --force
  mqa-train code-mqa --steps 20 --out /tmp/probe --force   # a short run: measure tokens/s first

Besides the checkpoint (config.json, model.safetensors, train_log.json, loss.png), the loss log and
curve are copied to results/quality-train/<name>.{json,png}.
"""

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="config name in configs/models/ (with a train section) or a YAML path")
    ap.add_argument("--out", type=Path, help="checkpoint dir (default checkpoints/<name>-trained)")
    ap.add_argument("--steps", type=int, help="override the train section's steps (short measuring runs)")
    ap.add_argument("--force", action="store_true", help="replace an existing OUT")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results are bitwise per thread count)")
    ap.add_argument("--log-dir", type=Path, help="where the loss log and PNG are copied "
                    "(default results/quality-train)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from plugins.core.console import exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
    import torch

    from plugins.core.config import REPO_ROOT, ConfigError, load_model_config, load_tokenizer_name, load_train_spec
    from plugins.train.loop import LOG_FILE, PLOT_FILE, train

    name = Path(args.model).stem
    try:
        config = load_model_config(args.model)
        spec = load_train_spec(args.model)
        tokenizer = load_tokenizer_name(args.model)
        if spec is None:
            raise ConfigError(f"{args.model} has no train section (seeded models: mqa-make-checkpoint)")
        if args.steps is not None:
            spec = dataclasses.replace(spec, steps=args.steps, warmup=min(spec.warmup, args.steps))
        if args.threads < 1:
            raise ConfigError("--threads must be >= 1")
    except ConfigError as e:
        ap.error(str(e))
    out = args.out or REPO_ROOT / "checkpoints" / f"{name}-trained"
    if out.exists() and not args.force:
        ap.error(f"{out} already exists (use --force)")
    torch.set_num_threads(args.threads)
    log = train(config, spec, out, name=name, force=args.force, progress=not args.no_progress, tokenizer=tokenizer)
    log_dir = args.log_dir or REPO_ROOT / "results" / "quality-train"
    log_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / LOG_FILE, log_dir / f"{name}.json")
    shutil.copyfile(out / PLOT_FILE, log_dir / f"{name}.png")
    seconds = log["train_seconds"]
    print(f"{name}: {log['steps']} steps, {log['tokens_seen']:,} tokens in {seconds / 60:.1f} min "
          f"({log['tokens_seen'] / seconds:,.0f} tokens/s); train loss {log['final_train_loss']:.3f}, "
          f"held-out {log['heldout_loss']:.3f}, unigram baseline {log['unigram_heldout_nats']:.3f} nats "
          f"-> {out} (curve: {log_dir / (name + '.png')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
