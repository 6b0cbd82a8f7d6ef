#!/usr/bin/env python
"""Tensor-parallel generation in ranks you launch yourself (the README's TP examples run this).

  LOCAL_SIZE=2 torchrun --nproc_per_node 2 scripts/tp_generate.py injected CHECKPOINT_DIR
  deepspeed --num_accelerators 2 scripts/tp_generate.py injected CHECKPOINT_DIR --kv-layout batch
  torchrun --nproc_per_node 2 scripts/tp_generate.py megatron CHECKPOINT_DIR
  LOCAL_SIZE=2 torchrun --nproc_per_node 2 scripts/tp_generate.py autotp CHECKPOINT_DIR

Every rank loads its shard and runs the same calls; rank 0 prints the new tokens.
  injected  deepspeed.init_inference(..., replace_with_kernel_inject=True, tensor_parallel=...) with our
            gpt_bigcode policy (injection.register()), optionally the batch-sharded MQA KV cache
  autotp    DeepSpeed AutoTP: gpt_bigcode with balanced MQA shards, StarCoder2 by KV heads
            (injection.autotp.init_autotp)
  megatron  megatron-core GPTModel (plugins.megatron.MegatronGPT)
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=["injected", "autotp", "megatron"])
    ap.add_argument("checkpoint", type=Path, help="HF gpt_bigcode or starcoder2 directory")
    ap.add_argument("--kv-layout", choices=["head", "batch"], default="head", help="injected, MQA: KV layout")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by `deepspeed`
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from plugins.core.tensors import DTYPES
    from plugins.core.checkpoint import load_hf_model
    from plugins.core.console import exit_without_collecting, quiet_upstream
    from plugins.core.tokenizer import checkpoint_tokenizer, make_batch

    quiet_upstream()
    exit_without_collecting()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dtype = DTYPES[args.dtype]
    tok, _ = checkpoint_tokenizer(args.checkpoint)  # the model's own vocabulary (trained ones have a small one)
    input_ids, mask = make_batch(tok, batch_size=args.batch, prompt_len=args.prompt_len)
    if args.engine == "megatron":
        from plugins.megatron import MegatronGPT

        model = MegatronGPT.from_hf(args.checkpoint, dtype=dtype, tp_size=int(os.environ["WORLD_SIZE"]))
        tokens = model.generate(input_ids, mask, max_new_tokens=args.new_tokens).tokens
    else:
        import deepspeed

        import injection
        from injection.autotp import init_autotp
        from injection.kv_shard import shard_kv_by_batch

        injection.register()  # before init_distributed: it also makes DeepSpeed unlink its /dev/shm segments
        deepspeed.init_distributed(dist_backend="gloo")
        world = dist.get_world_size()
        model = load_hf_model(args.checkpoint, dtype)
        if args.engine == "autotp":
            engine = init_autotp(model, tp_size=world, dtype=dtype)
        else:
            engine = deepspeed.init_inference(model, dtype=dtype, replace_with_kernel_inject=True,
                                              tensor_parallel={"tp_size": world})
            if args.kv_layout == "batch":
                shard_kv_by_batch(engine.module)
        tokens = engine.module.generate(input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                        do_sample=False, pad_token_id=0)
    if dist.get_rank() == 0:
        print(tokens[:, input_ids.shape[1]:].tolist())
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
