#!/usr/bin/env python
"""Decode ms/step and tok/s of the DeepSpeed-injected engine vs HF, same weights, same loop.

  flock /tmp/heavy.lock .venv/bin/python scripts/bench_injection.py /tmp/ckpt/santacoder-1b
  ... --backends deepspeed deepspeed:2 deepspeed-autotp:2     # NAME:TP starts TP ranks
  (make the checkpoint with scripts/make_checkpoint.py santacoder-1b /tmp/ckpt/santacoder-1b)

Both engines run plugins.generation.generate (greedy) on a real-code prompt; the median of the
decode steps is reported. Backends are timed one after the other, never at the same time.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.backend import load_backend  # noqa: E402
from plugins.tokenizer import load_tokenizer, make_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backends", nargs="+", default=["hf", "deepspeed"], help="NAME or NAME:TP")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    tok = load_tokenizer()
    rows = []
    for name in args.backends:
        base, _, tp = name.partition(":")
        backend = load_backend(base, args.hf_dir, dtype=args.dtype, tp_size=int(tp or 1))
        for batch in args.batch:
            ids, mask = make_batch(tok, batch_size=batch, prompt_len=args.prompt_len)
            backend.generate(ids, mask, 4)  # warm-up (oneDNN packing, allocator)
            res = backend.generate(ids, mask, args.new_tokens)
            ms = statistics.median(res.step_s) * 1e3
            rows.append((name, batch, ms, batch * 1e3 / ms, res.prefill_s, res.kv_cache_bytes, res.tokens))
            print(f"{name:10s} bs={batch:3d} decode {ms:8.1f} ms/step {batch * 1e3 / ms:8.1f} tok/s "
                  f"prefill {res.prefill_s:6.2f} s  kv {res.kv_cache_bytes / 2**20:7.1f} MiB", flush=True)
        backend.close()
        del backend
    by = {(r[0], r[1]): r for r in rows}
    for batch in args.batch:
        if ("hf", batch) in by and ("deepspeed", batch) in by:
            hf, ds = by[("hf", batch)], by[("deepspeed", batch)]
            same = torch.equal(hf[6], ds[6])
            print(f"bs={batch}: deepspeed / hf speed-up {hf[2] / ds[2]:.2f}x; greedy tokens identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
