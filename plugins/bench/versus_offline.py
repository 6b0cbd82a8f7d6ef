"""The offline prefill rate the versus bench compares served prefill with: `--batch` real-code prompts of
`--prompt` tokens through our engine's `load_backend(...).generate` (one new token), on the checkpoint and
dtype the server loads. Run by plugins.bench.versus as a child process, before any server starts (the
cores to itself, its memory given back); prints one JSON line:

  python -m plugins.bench.versus_offline /tmp/mqa/santacoder-1b --batch 8 --prompt 1024
  {"batch": 8, "prompt": 1024, "prefill_s": [...], "best_s": ..., "prompt_tok_s": ...}

`prefill_s` is GenerationResult.prefill_s (the prompt forward and the first token); the first of
`--repeats` runs also builds whatever the engine builds on first use, so the best run is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("--backend", default="deepspeed")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", choices=("int8", "int4"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from plugins.core.tokenizer import checkpoint_tokenizer, make_batch
    from plugins.engine.registry import load_backend
    from plugins.kernels.allocator import keep_freed_memory

    tok, _ = checkpoint_tokenizer(args.checkpoint_dir)
    input_ids, mask = make_batch(tok, args.batch, args.prompt)
    t = time.perf_counter()
    backend = load_backend(args.backend, args.checkpoint_dir, dtype=args.dtype,
                           **({"quantize": args.quantize} if args.quantize else {}))
    load_s = time.perf_counter() - t
    keep_freed_memory()  # as the server runs
    try:
        runs = [backend.generate(input_ids, mask, max_new_tokens=1).prefill_s for _ in range(args.repeats)]
    finally:
        backend.close()
    best = min(runs)
    print(json.dumps({"backend": args.backend, "dtype": args.dtype, "batch": args.batch, "prompt": args.prompt,
                      "load_s": load_s, "prefill_s": runs, "best_s": best,
                      "prompt_tok_s": args.batch * args.prompt / best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
