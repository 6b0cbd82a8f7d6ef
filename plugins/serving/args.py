"""The command-line options that name a served engine, shared by `mqa-serve` and the serving benchmark."""

from __future__ import annotations

from pathlib import Path

from plugins.core.config import byte_size
from plugins.engine.registry import BACKENDS


def add_engine_args(ap, kv_budget_help: str) -> None:
    ap.add_argument("checkpoint_dir", type=Path, help="an HF gpt_bigcode checkpoint directory")
    ap.add_argument("--backend", default="deepspeed", help=f"one of {', '.join(BACKENDS)} (default deepspeed)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (CPU); float16 on CUDA")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (worker processes)")
    ap.add_argument("--kv-budget", type=byte_size, default=byte_size("1GB"), help=kv_budget_help)
