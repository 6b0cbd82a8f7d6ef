"""Serve a checkpoint over HTTP: OpenAI-compatible completions with continuous batching.
Run as `mqa-serve`, `python -m plugins.http` or `scripts/serve.py`.

  mqa-serve checkpoints/santacoder-1b --backend deepspeed --dtype bfloat16 --kv-budget 2GB
  mqa-serve /tmp/tiny --backend megatron --tp 2 --port 8001
  mqa-serve ckpt --tp 4 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400   # HTTP here, 2 ranks here
  mqa-serve ckpt --tp 4 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400   # on node1: its 2 ranks
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "santacoder-1b", "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

The KV pool (slots x context, per rank) is allocated once from --kv-budget (at most --max-batch
slots); requests beyond its slots wait (up to --max-waiting, then HTTP 503).
The served model id is the directory's name.

What a client can hold is bounded: a request must arrive whole (headers and body) within
--read-timeout seconds of its first byte, its body within --max-body-bytes (413), at most
--max-connections connections are open (503 beyond), idle kept-alive ones close after
--keep-alive-timeout. SIGTERM: no new requests; running ones get --graceful-timeout seconds, then
end with an error body (an error event for streams). If the engine fails (a tensor-parallel rank
died), /health turns 503 at once, every request gets one short error, and the server exits with 1.

Tensor parallelism across machines: every machine runs mqa-serve with the same --tp, --nnodes and
--rdzv-endpoint (torchrun's c10d rendezvous, flag names as torchrun's); node rank 0 serves HTTP and
loads what every rank loads (the checkpoint must be at the same path on every machine), the others
only run their --tp / --nnodes ranks and exit when the group ends (0 when node 0 closed it).
"""

import argparse
import gc
import signal
import sys
import threading
import time

from plugins.core.config import byte_size
from plugins.serving.args import add_engine_args, engine_options, max_batched_tokens

ENGINE_FAILED_LINGER_S = 2.0


def pool_slots(configs: list, dtype, tp_size: int, capacity: int, budget: int) -> tuple[int, int]:
    """(slots that fit `budget` bytes per rank, bytes per slot) of a pool holding the K and V of the
    models in `configs` (the served one, and a speculative draft)."""
    from plugins.core.tensors import kv_bytes_per_token

    per_token = sum(kv_bytes_per_token(config, dtype, tp_size) for config in configs)
    per_slot = per_token * capacity
    return budget // per_slot, per_slot


def check_nodes(ap, args) -> dict:
    """The launch options of --nnodes / --node-rank / --rdzv-endpoint, checked."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        ap.error(f"--node-rank must be in 0..{args.nnodes - 1} with --nnodes {args.nnodes}")
    if args.nnodes == 1:
        if args.rdzv_endpoint:
            ap.error("--rdzv-endpoint needs --nnodes > 1")
        return {}
    if args.tp % args.nnodes:
        ap.error(f"--tp {args.tp} ranks do not split evenly over --nnodes {args.nnodes}")
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        ap.error(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, got {args.rdzv_endpoint!r}")
    return {"nnodes": args.nnodes, "rdzv_endpoint": args.rdzv_endpoint}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="mqa-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, "bytes of KV pool per rank (default 1GB): slots = budget / (bytes per token x context)")
    ap.add_argument("--prefix-cache", type=byte_size, default=byte_size("512MB"),
                    help="bytes per rank of prompt-prefix KV kept for reuse (default 512MB; 0 turns it off)")
    ap.add_argument("--max-model-len", type=int, help="context per slot, prompt + max_tokens "
                                                      "(default the model's n_positions)")
    ap.add_argument("--max-batch", type=int, default=256, help="most sequences decoded together (slots are "
                                                                 "min(this, what --kv-budget holds))")
    ap.add_argument("--max-waiting", type=int, default=256, help="requests queued for a slot before 503s")
    ap.add_argument("--nnodes", type=int, default=1, help="machines the --tp ranks span (default 1)")
    ap.add_argument("--node-rank", type=int, default=0, help="this machine's place: 0 serves HTTP, the others "
                                                              "only run their ranks")
    ap.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                    help="where the machines meet (torchrun's c10d rendezvous; with --nnodes > 1)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish after SIGTERM (then they end with an error)")
    ap.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds a request's headers and body may take to arrive (slow clients are cut)")
    ap.add_argument("--max-body-bytes", type=byte_size, default=byte_size("4MiB"),
                    help="largest request body (default 4MiB; larger: 413)")
    ap.add_argument("--max-connections", type=int, default=1024, help="open HTTP connections (more: 503)")
    ap.add_argument("--keep-alive-timeout", type=float, default=75.0,
                    help="seconds an idle kept-alive connection stays open (default 75: longer than clients "
                         "keep theirs)")
    return ap, ap.parse_args(argv)


def check_args(ap, args) -> dict:
    """Every check of the flags and the checkpoint, before any work (mqa-fleet runs it for its replicas);
    what serving needs of them."""
    from plugins.core.checkpoint import read_hf_config
    from plugins.core.config import ConfigError, arch, check_tp
    from plugins.core.tensors import resolve_dtype
    from plugins.engine.registry import backend_class
    from plugins.serving.runner import check_batchable

    launch = check_nodes(ap, args)
    try:
        config = read_hf_config(args.checkpoint_dir)
        check_batchable(backend_class(args.backend))
        dtype = resolve_dtype(args.dtype)
        check_tp(config, args.tp)
        backend_class(args.backend).check_options(config, args.tp, **engine_options(args), **launch)
        models = [config] + ([] if args.speculative in (None, "prompt-lookup") else  # a draft's K and V too
                             [config if args.speculative in ("int8", "int4") else read_hf_config(args.speculative)])
    except (ConfigError, OSError, ValueError) as e:
        ap.error(str(e))
    if args.node_rank > 0:  # node 0 holds the pool, the scheduler and the tokenizer
        return {"launch": launch}
    longest = min(arch(m).n_positions for m in models)
    capacity = args.max_model_len or arch(config).n_positions
    if not 2 <= capacity <= longest:
        ap.error(f"--max-model-len must be in 2..{longest} (the n_positions of the model"
                 f"{' and its draft' if len(models) > 1 else ''}), got {capacity}")
    if args.max_batch < 1:
        ap.error(f"--max-batch must be >= 1, got {args.max_batch}")
    slots, per_slot = pool_slots(models, dtype, args.tp, capacity, args.kv_budget)
    if slots < 1:
        ap.error(f"--kv-budget {args.kv_budget} bytes holds no slot: one sequence of {capacity} tokens needs "
                 f"{per_slot} bytes per rank (raise --kv-budget or lower --max-model-len)")
    slots = min(slots, args.max_batch)
    if args.num_speculative_tokens is not None and not args.speculative:
        ap.error("--num-speculative-tokens needs --speculative")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        ap.error(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if args.max_num_batched_tokens != "auto" and args.max_num_batched_tokens < 0:
        ap.error(f"--max-num-batched-tokens must be >= 0, got {args.max_num_batched_tokens}")
    if not (args.ttft_slo > 0 and args.itl_slo > 0):
        ap.error("--ttft-slo and --itl-slo must be > 0 (seconds)")
    if args.max_waiting < 0:
        ap.error("--max-waiting must be >= 0")
    for flag in ("graceful_timeout", "read_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            ap.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.max_connections < 1 or args.max_body_bytes < 1:
        ap.error("--max-connections and --max-body-bytes must be >= 1")
    from plugins.core.tokenizer import checkpoint_tokenizer
    from plugins.http.chat import ChatTemplate

    try:
        tokenizer, tok_path = checkpoint_tokenizer(args.checkpoint_dir)
        chat = ChatTemplate.of_checkpoint(args.checkpoint_dir, tokenizer)
    except ValueError as e:  # its ids do not fit the model; its tokenizer_config.json is not JSON
        ap.error(str(e))
    return {"launch": launch, "config": config, "dtype": dtype, "capacity": capacity, "slots": slots,
            "per_slot": per_slot, "tokenizer": tokenizer, "tok_path": tok_path, "chat": chat}


def open_engine(args, checked: dict, note: str):
    """The backend the flags name, loaded, and the serving engine over it, as every front end starts them
    (mqa-serve, mqa-triton): (backend, engine). `checked`: what check_args found; `note` ends the line
    that announces the load."""
    from plugins.core.console import announce
    from plugins.engine.registry import load_backend
    from plugins.kernels.allocator import keep_freed_memory
    from plugins.serving.engine import ServingEngine

    capacity, slots, per_slot = (checked[k] for k in ("capacity", "slots", "per_slot"))
    announce(f"loading {args.checkpoint_dir} on {args.backend} (tp {args.tp}, {args.dtype}"
             f"{', ' + args.quantize if args.quantize else ''}"
             f"{', speculative ' + args.speculative if args.speculative else ''}); "
             f"chunked prefill {args.max_num_batched_tokens or 'off'}; "
             f"KV pool: {slots} slots x {capacity} tokens = {slots * per_slot / 2**20:.0f} MiB per rank, "
             f"prefix cache {args.prefix_cache / 2**20:.0f} MiB; {note}")
    backend = load_backend(args.backend, args.checkpoint_dir, dtype=args.dtype, tp_size=args.tp,
                           **engine_options(args), **checked["launch"])
    keep_freed_memory()  # before the engine's step thread starts
    try:
        engine = ServingEngine(backend, slots, capacity, args.max_waiting, args.prefix_cache,
                               max_batched_tokens(args), args.ttft_slo, args.itl_slo)
    except BaseException:
        backend.close()
        raise
    # The loaded process holds hundreds of thousands of objects (torch, transformers, DeepSpeed): a full
    # collection walks them all, and the one that requests' allocations trigger now and then stalls an
    # engine step (docs/results/2026-12-06-queue-first-steps-avx512bf16.md). Frozen, they are never walked
    # again (vLLM freezes its engine's heap too).
    gc.collect()
    gc.freeze()
    return backend, engine


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    from plugins.core.console import announce, exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
    checked = check_args(ap, args)
    if args.node_rank > 0:
        from plugins.launch.launcher import join_group

        announce(f"node {args.node_rank} of {args.nnodes}: {args.tp // args.nnodes} tensor-parallel rank(s) joining "
                 f"{args.rdzv_endpoint}; node 0 serves")
        code = join_group(args.tp, args.nnodes, args.rdzv_endpoint)
        if code:
            print(f"exiting: this node's ranks ended with code {code} (a rank of the group failed, or node 0 is "
                  "gone)", flush=True)
        return 1 if code else 0
    config, tokenizer, tok_path, chat = (checked[k] for k in ("config", "tokenizer", "tok_path", "chat"))

    import uvicorn

    from plugins.http.app import Served, create_app
    from plugins.http.http_limits import Limits, limited_protocol

    backend, engine = open_engine(args, checked, f"tokenizer {tok_path}")
    model_id = args.checkpoint_dir.resolve().name
    app = create_app(Served(engine, tokenizer, model_id, config.vocab_size, args.max_body_bytes, chat),
                     on_shutdown=backend.close)
    announce(f"serving {model_id!r} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)")
    limits = Limits(args.read_timeout, args.max_connections)
    # uvicorn waits a little longer than our own drain, so the requests it cuts get their error bodies out
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", http=limited_protocol(limits),
        timeout_graceful_shutdown=args.graceful_timeout + 5, timeout_keep_alive=args.keep_alive_timeout))

    def serve_http():
        try:
            server.run()  # returns after its graceful shutdown (our lifespan closes the engine)
        finally:
            engine.close(timeout=0)  # also when it could not start (port taken): the decode loop ends

    def stop(signum, frame):
        if not server.should_exit:
            server.should_exit = True  # uvicorn stops accepting, drains open requests, then shuts down
            # running requests get --graceful-timeout seconds, then end with an error body
            threading.Thread(target=engine.close, args=(args.graceful_timeout,), daemon=True).start()

    # HTTP on a thread, the decode loop on this one (see ServingEngine.run); signals arrive here.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http = threading.Thread(target=serve_http, name="http")
    http.start()
    engine.watch()
    try:
        engine.run()
        if engine.error:  # /health answers 503 a moment for whoever watches it, then the process ends
            time.sleep(ENGINE_FAILED_LINGER_S)
    finally:
        server.should_exit = True
        http.join()
        backend.close()
    if engine.error:
        print(f"exiting: the engine failed ({engine.error})", flush=True)
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
