"""Serve a checkpoint from NVIDIA Triton Inference Server: our continuous-batching engine as one
decoupled (streaming) Triton model. Run as `mqa-triton` or `python -m plugins.triton`.

  mqa-triton checkpoints/santacoder-1b --dtype bfloat16 --port 8000 --grpc-port 8001 --metrics-port 8002
  curl http://127.0.0.1:8000/v2/models/santacoder-1b/generate \\
       -d '{"text_input": "def fib(n):", "max_tokens": 32, "temperature": 0}'
  curl http://127.0.0.1:8000/v2/models/santacoder-1b/generate_stream \\
       -d '{"text_input": "def fib(n):", "max_tokens": 32, "stream": true}'

Triton (the server nvidia-pytriton bundles, installed in .venv-triton by `make triton`) serves HTTP
(KServe v2, generate / generate_stream), gRPC (KServe v2, streaming for decoupled models) and
Prometheus metrics; its model instances (--instances, Python backend stubs) hand every request to
this one process, whose engine batches them all, as mqa-serve's does. Every engine option of
mqa-serve is taken here (the same flags, the same checks); mqa-serve's HTTP limits are not used
(Triton's HTTP server has its own). SIGTERM: Triton refuses new requests, running ones get
--graceful-timeout seconds, then end with an error; if the engine fails, Triton is stopped and this
exits 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from plugins.triton.server import DEFAULT_VENV

READY_TIMEOUT_S = 300.0
# Once our engine has answered every request, Triton only unloads the model (~2.5 s here). After a
# client cancelled a gRPC stream that had already ended, Triton 2.51's gRPC server waits out its whole
# exit timeout instead; past this, it is killed (its model instances have finalized by then).
UNLOAD_TIMEOUT_S = 15.0
HTTP_ONLY = ("--read-timeout", "--max-body-bytes", "--max-connections", "--keep-alive-timeout")


def parse_args(argv=None):
    # mqa-serve's own parser is the parent: every engine and scheduler flag it has (or gains) is ours too
    from plugins.http import cli as serve_cli

    serve_ap, _ = serve_cli.parse_args(["CHECKPOINT"])
    ap = argparse.ArgumentParser(prog="mqa-triton", description=__doc__, parents=[serve_ap],
                                 conflict_handler="resolve", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000, help="Triton's HTTP port (KServe v2, generate; default 8000)")
    ap.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port (default 8001)")
    ap.add_argument("--metrics-port", type=int, default=8002, help="Triton's Prometheus /metrics port (default 8002)")
    ap.add_argument("--host", default="127.0.0.1", help="address of all three (default 127.0.0.1)")
    ap.add_argument("--model-name", help="the Triton model's name (default the checkpoint directory's name)")
    ap.add_argument("--instances", type=int, default=1,
                    help="Triton model instances (Python backend processes), all handing requests to this "
                         "process's one engine (default 1: a decoupled instance takes requests concurrently)")
    ap.add_argument("--triton-venv", type=Path, default=Path(os.environ.get("MQA_TRITON_VENV", DEFAULT_VENV)),
                    help="the venv holding nvidia-pytriton's Triton server (default .venv-triton: `make triton`)")
    ap.add_argument("--triton-args", default="", help="more tritonserver flags, one string after '=' (e.g. "
                                                      "--triton-args='--http-thread-count=16 --log-info=true')")
    for flag in HTTP_ONLY:  # mqa-serve's HTTP server's limits: Triton's HTTP server is not that server
        default = serve_ap.get_default(flag[2:].replace("-", "_"))
        ap.add_argument(flag, default=default, type=type(default), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return ap, args


def check_triton_args(ap, args) -> None:
    if args.instances < 1:
        ap.error(f"--instances must be >= 1, got {args.instances}")
    ports = (args.port, args.grpc_port, args.metrics_port)
    if len(set(ports)) < 3 or not all(0 < p < 65536 for p in ports):
        ap.error(f"--port, --grpc-port and --metrics-port must be three different ports, got {ports}")
    name = args.model_name or args.checkpoint_dir.resolve().name
    if not name or "/" in name or name.startswith("."):
        ap.error(f"--model-name {name!r} cannot name a Triton model (a directory of its repository)")
    args.model_name = name
    try:
        args.triton_args = shlex.split(args.triton_args)
    except ValueError as e:
        ap.error(f"--triton-args: {e}")


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    from plugins.core.console import announce, exit_without_collecting, quiet_upstream
    from plugins.http import cli as serve_cli
    from plugins.triton.server import TritonMissing, find_install

    quiet_upstream()
    exit_without_collecting()
    check_triton_args(ap, args)
    if args.node_rank == 0:
        try:
            install = find_install(args.triton_venv)  # before minutes of loading
        except TritonMissing as e:
            ap.error(str(e))
    checked = serve_cli.check_args(ap, args)
    if args.node_rank > 0:  # the other machines of a multi-node TP group run only their ranks, as mqa-serve's
        from plugins.launch.launcher import join_group

        announce(f"node {args.node_rank} of {args.nnodes}: {args.tp // args.nnodes} tensor-parallel rank(s) joining "
                 f"{args.rdzv_endpoint}; node 0 serves")
        return 1 if join_group(args.tp, args.nnodes, args.rdzv_endpoint) else 0
    return serve(args, checked, install)


def serve(args, checked: dict, install) -> int:
    from plugins.core.console import announce
    from plugins.http.cli import open_engine
    from plugins.http.served import Served
    from plugins.triton.bridge import Bridge
    from plugins.triton.server import TritonServer

    backend, engine = open_engine(args, checked, f"Triton from {install.venv}")
    served = Served(engine, checked["tokenizer"], args.model_name, checked["config"].vocab_size,
                    args.max_body_bytes, checked["chat"])
    triton = TritonServer(install, args.model_name, args.instances, args.host, args.port, args.grpc_port,
                          args.metrics_port, exit_timeout=args.graceful_timeout + 5, extra=args.triton_args)
    bridge = Bridge(served, triton.socket_path)
    stopping = threading.Event()
    failed: list[str] = []

    def stop(signum=None, frame=None):
        if not stopping.is_set():
            stopping.set()
            # Triton refuses new requests and waits for those in flight; running ones get
            # --graceful-timeout seconds, then end with an error
            triton.terminate()
            threading.Thread(target=engine.close, args=(args.graceful_timeout,), daemon=True).start()

    def fail(message: str):
        if not stopping.is_set():
            failed.append(message)
            print(message, flush=True)
            stop()

    def supervise():
        try:
            triton.wait_ready(READY_TIMEOUT_S, alive=lambda: not engine.error and not stopping.is_set())
        except RuntimeError as e:
            fail(f"exiting: {e}")
            return
        announce(f"serving {args.model_name!r} from Triton: http://{args.host}:{args.port}"
                 f"/v2/models/{args.model_name}/generate, gRPC {args.host}:{args.grpc_port}, metrics "
                 f"http://{args.host}:{args.metrics_port}/metrics (Ctrl-C or SIGTERM stops)")
        code = triton.proc.wait()
        fail(f"exiting: tritonserver exited with code {code}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        bridge.start()
        triton.start()
        threading.Thread(target=supervise, name="triton-supervisor", daemon=True).start()
        engine.watch()
        engine.run()  # the decode loop, on the thread that loaded the backend, until close()
        if engine.error:
            stop()  # Triton refuses requests at once; the engine already failed those it held
    finally:
        stop()
        code = triton.stop(UNLOAD_TIMEOUT_S)
        bridge.stop()
        backend.close()
        triton.cleanup()
    if code:
        print(f"tritonserver ended with code {code}" + (" (killed: it had not exited "
              f"{UNLOAD_TIMEOUT_S:.0f} s after the engine drained)" if code == -signal.SIGKILL else ""), flush=True)
    if failed:
        return 1
    if engine.error:
        print(f"exiting: the engine failed ({engine.error})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
