"""The command-line options that name a served engine, shared by `mqa-serve` and the serving benchmarks."""

from __future__ import annotations

from pathlib import Path

from plugins.core.config import byte_size
from plugins.engine.registry import BACKENDS
from plugins.serving.token_budget import ITL_SLO_S, TTFT_SLO_S

# Prompt tokens per engine step for goodput, from measured step times (plugins.serving.token_budget): no
# fixed budget suits every CPU here (a chunk token costs ~20x more on an AVX2 EPYC than on an AMX Xeon).
DEFAULT_MAX_BATCHED_TOKENS = "auto"


def token_budget(text: str) -> int | str:
    """A --max-num-batched-tokens value: a token count, or "auto"."""
    return "auto" if text == "auto" else int(text)


def add_engine_args(ap, kv_budget_help: str) -> None:
    ap.add_argument("checkpoint_dir", type=Path, help="an HF gpt_bigcode checkpoint directory")
    ap.add_argument("--backend", default="deepspeed", help=f"one of {', '.join(BACKENDS)} (default deepspeed)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (CPU); float16 on CUDA")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (worker processes)")
    ap.add_argument("--kv-budget", type=byte_size, default=byte_size("1GB"), help=kv_budget_help)
    ap.add_argument("--quantize", choices=("int8", "int4"),
                    help="weight-only int8 / int4 layer linears (deepspeed backend, TP 1; int4 on CPU)")
    ap.add_argument("--speculative", metavar="prompt-lookup|int8|int4|DRAFT_DIR",
                    help="greedy rows propose tokens and keep what the model confirms (deepspeed backend, TP 1): "
                         "prompt-lookup (the continuation of their last n-gram's earlier match in prompt and "
                         "output), int8 / int4 (a draft model: the served weights quantized), or an HF checkpoint "
                         "directory of a draft model with the same vocabulary")
    ap.add_argument("--num-speculative-tokens", type=int,
                    help="most tokens a row proposes per step (default 10 for prompt-lookup, as transformers' "
                         "prompt lookup; 4 for a draft model)")
    ap.add_argument("--max-num-batched-tokens", type=token_budget, default=DEFAULT_MAX_BATCHED_TOKENS,
                    help="tokens per engine step, decode rows included: longer prompts are prefilled in chunks "
                         "over several steps so running streams keep decoding (default auto: prompt tokens per step "
                         "from measured step times, for goodput under --ttft-slo and --itl-slo; 0: every prompt "
                         "whole, in the step it is admitted)")
    ap.add_argument("--ttft-slo", type=float, default=TTFT_SLO_S,
                    help=f"seconds from a request's arrival to its first token that --max-num-batched-tokens auto "
                         f"aims for (default {TTFT_SLO_S:g}): when a waiting prompt would miss it, prompts get "
                         "the step")
    ap.add_argument("--itl-slo", type=float, default=ITL_SLO_S,
                    help=f"seconds between a stream's tokens that auto keeps while prompts are prefilled beside "
                         f"them, where no first token is at risk (default {ITL_SLO_S:g})")


def engine_options(args) -> dict:
    """The backend options the flags ask for (for load_backend)."""
    options = {"quantize": args.quantize} if args.quantize else {}
    if args.speculative:
        k = {} if args.num_speculative_tokens is None else {"k": args.num_speculative_tokens}
        options["speculative"] = {"draft": args.speculative, **k}
    return options


def max_batched_tokens(args) -> int | str | None:
    return args.max_num_batched_tokens or None


def serve_flags(args) -> list[str]:
    """The same engine options as `mqa-serve` flags (for a server started as a subprocess)."""
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--ttft-slo", str(args.ttft_slo),
             "--itl-slo", str(args.itl_slo)]
    if args.speculative:
        flags += ["--speculative", args.speculative]
    if args.num_speculative_tokens is not None:
        flags += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    return flags + (["--quantize", args.quantize] if args.quantize else [])
