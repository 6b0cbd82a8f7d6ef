"""Convert gpt_bigcode checkpoints between HF and Megatron formats.
Run as `mqa-convert`, `python -m converters` or `scripts/convert.py`.

Formats:
  hf                HF directory: config.json + safetensors (or pytorch_model*.bin when reading)
  megatron          megatron-core dist_checkpointing directory (torch_dist)
  megatron-torch    Megatron-LM --ckpt-format torch of the megatron-core GPT model (what current Megatron-LM trains)
  megatron-legacy   Megatron-LM's legacy GPT model (up to core_v0.17): tracker + {release,iter_N}/mp_rank_XX[_YYY]/
  bigcode-megatron  BigCode's Megatron-LM fork (SantaCoder/StarCoder training): query + key_value for MQA

Examples:
  mqa-convert --from hf --to megatron-legacy --tp 2 ckpt/santacoder-1b /tmp/sc-legacy-tp2
  mqa-convert --from megatron-legacy --to hf /tmp/sc-legacy-tp2 /tmp/sc-hf
  mqa-convert --from hf --to megatron --tp 2 ckpt/santacoder-1b /tmp/sc-mcore
  mqa-convert --from hf --to megatron-torch --tp 2 --pp 2 --layer-spec te ckpt/santacoder-1b /tmp/sc-torch
  mqa-convert --from bigcode-megatron --to hf /data/starcoder-ckpt /tmp/sc-hf --dtype bfloat16
  mqa-convert --from hf --to megatron-legacy --tp 4 --pp 4 ckpt/starcoder /tmp/sc-tp4-pp4
  mqa-convert --from hf --to hf --kv-heads 1 ckpt/santacoder-1b-mha /tmp/sc-mqa   # MHA -> MQA
  mqa-convert --from hf --to megatron-legacy --kv-heads 4 ckpt/santacoder-1b-mha /tmp/sc-gqa4
"""

import argparse
import sys
from pathlib import Path

from converters.formats import FORMATS, LAYER_SPECS, WRITABLE

LEGACY_NOTE = ("note: megatron-legacy is the legacy GPT model, which Megatron-LM removed in core_v0.18.0: current "
               "Megatron-LM cannot load it (use --to megatron-torch or --to megatron); BigCode's fork and Megatron-LM "
               "core_v0.5.0 to core_v0.17.x can")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src_format", required=True, choices=list(FORMATS), help="input format")
    ap.add_argument("--to", dest="dst_format", required=True, choices=list(WRITABLE), help="output format")
    ap.add_argument("src", type=Path, help="input checkpoint directory")
    ap.add_argument("dst", type=Path, help="output directory (must not exist unless --force)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the output (Megatron formats)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages of the output (megatron-torch, megatron-legacy, bigcode-megatron)")
    ap.add_argument("--iteration", type=int, default=None,
                    help="which iteration of a Megatron-LM / BigCode-fork input (default: the tracker's latest)")
    ap.add_argument("--layer-spec", choices=LAYER_SPECS, default=None,
                    help="megatron-torch output's layer names: megatron-core's local spec (default) or Transformer "
                         "Engine's (--transformer-impl transformer_engine)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="mean-pool K/V heads into N groups (1 = MQA; 1<N<n_head = GQA, Megatron outputs only)")
    ap.add_argument("--dtype", default=None, help="cast weights: float32, bfloat16 or float16 (default: keep)")
    ap.add_argument("--force", action="store_true", help="replace an existing DST")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    from plugins.core.console import exit_without_collecting, quiet_upstream

    if args.dst_format == "megatron-legacy":
        print(LEGACY_NOTE, file=sys.stderr)
    quiet_upstream()
    exit_without_collecting()
    from converters import convert  # torch and friends: only once the arguments are known
    from plugins.core.config import ConfigError

    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(unit="layer", file=sys.stderr)
    try:
        s = convert(args.src, args.dst, args.src_format, args.dst_format, tp_size=args.tp, pp_size=args.pp,
                    kv_heads=args.kv_heads, dtype=args.dtype, iteration=args.iteration, force=args.force,
                    progress=bar, layer_spec=args.layer_spec)
    except ConfigError as e:
        if bar is not None:
            bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if bar is not None:
        bar.close()
    print(f"{s['from']} -> {s['to']} (tp_size={s['tp_size']}, pp_size={s['pp_size']}, kv_heads={s['kv_heads']}): "
          f"{s['tensors']} tensors, "
          f"{s['params'] / 1e6:.1f}M params, {s['bytes'] / 1e6:.1f} MB written to {s['dst']} in {s['seconds']:.2f} s")
    return 0
