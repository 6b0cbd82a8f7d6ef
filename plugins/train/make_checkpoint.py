"""Create a seeded HF checkpoint directory from a model config (and time it against HF's own init).
Run as `mqa-make-checkpoint`, `python -m plugins.train.make_checkpoint` or `scripts/make_checkpoint.py`.
A config with a `train:` section (code-mqa, code-mha, code-draft) is trained instead (plugins.train,
minutes, reused when DST already holds that run); `--seeded` gives its shape with seeded weights.

  mqa-make-checkpoint santacoder-1b checkpoints/santacoder-1b
  mqa-make-checkpoint tiny /tmp/tiny --seed 3 --dtype bfloat16 --force
  mqa-make-checkpoint santacoder-1b /tmp/sc --compare-hf-init   # also time HF's init
  mqa-make-checkpoint code-mqa checkpoints/code-mqa-trained       # trains it (~10 min, once)
  mqa-make-checkpoint tiny /tmp/tiny-chat --chat-template chat.jinja  # for apply_chat_template
"""

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="config name in configs/models/ or a YAML path")
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (weights as stored)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing DST")
    ap.add_argument("--compare-hf-init", action="store_true", help="also time GPTBigCodeForCausalLM(config)")
    ap.add_argument("--seeded", action="store_true", help="seeded weights even for a config with a train section")
    ap.add_argument("--chat-template", type=Path, metavar="FILE",
                    help="a Jinja chat template, written into tokenizer_config.json (seeded checkpoints)")
    args = ap.parse_args(argv)

    from plugins.core.console import exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
    from plugins.core.checkpoint import init_model, load_hf_model, save_hf_dir
    from plugins.core.config import ConfigError, load_model_config, load_tokenizer_name, load_train_spec
    from plugins.core.tensors import resolve_dtype

    try:
        config = load_model_config(args.model)
        trained = load_train_spec(args.model) is not None and not args.seeded
        tokenizer = load_tokenizer_name(args.model)
        dtype = resolve_dtype(args.dtype, "cpu")
    except ConfigError as e:
        ap.error(str(e))
    if args.dst.exists() and not args.force:
        ap.error(f"{args.dst} already exists (use --force)")
    if trained and args.chat_template:
        ap.error("--chat-template is for seeded checkpoints (a trained one is reused as trained); add --seeded")
    try:
        chat_template = args.chat_template.read_text() if args.chat_template else None
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"--chat-template: cannot read {args.chat_template}: {e}")
    if trained:
        from plugins.train import ensure_trained

        ensure_trained(args.model, args.dst)
        print(f"{args.model}: trained checkpoint at {args.dst}")
        return 0

    t = time.perf_counter()
    model = init_model(config, seed=args.seed, dtype=dtype)
    t_init = time.perf_counter() - t
    n_params = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    save_hf_dir(model, args.dst, force=args.force, tokenizer=tokenizer, chat_template=chat_template)
    t_save = time.perf_counter() - t
    del model
    t = time.perf_counter()
    load_hf_model(args.dst, dtype)
    t_load = time.perf_counter() - t
    size = sum(f.stat().st_size for f in args.dst.iterdir())
    print(f"{args.model}: {n_params / 1e6:.1f}M params, seeded init {t_init:.2f} s, save {t_save:.2f} s, "
          f"load {t_load:.2f} s ({size / 1e9:.2f} GB at {args.dst})")
    if args.compare_hf_init:
        from transformers import GPTBigCodeForCausalLM

        t = time.perf_counter()
        GPTBigCodeForCausalLM(config)
        print(f"HF GPTBigCodeForCausalLM(config) with its default init: {time.perf_counter() - t:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
