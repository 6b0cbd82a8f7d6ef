"""The worker side of plugins.launch.launcher: what torchrun / deepspeed (or one plain process) run
in every rank. The front rank (local rank 0 of the machine whose parent serves, rank 0 on one machine)
connects back to the parent's socket, receives each call and broadcasts it; every rank runs it on its
shard of the engine; the front answers with its result or the tracebacks. Ranks on other machines
(`mqa-serve --node-rank R > 0`) only follow the front's calls.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import os
import pickle
import signal
import socket
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from plugins.core.config import ConfigError
from plugins.core.tensors import process_group_backend, use_local_gpu
from plugins.engine.registry import backend_class
from plugins.kernels.allocator import keep_freed_memory
from plugins.serving.runner import open_runner

PR_SET_PDEATHSIG = 1
ADDRESS_ENV = "PLUGINS_LAUNCHER_ADDRESS"
TIMEOUT_ENV = "PLUGINS_LAUNCHER_TIMEOUT"
FRONT_ENV = "PLUGINS_LAUNCHER_FRONT"  # "1" on the machine whose parent process takes the calls


def in_worker() -> bool:
    """Whether this process is a worker started by RemoteBackend."""
    return ADDRESS_ENV in os.environ


# Plain pickle: Connection.send would use torch's shared-memory tensor reductions, which hand
# file descriptors between processes of one multiprocessing family; ours are strangers.
def send(conn: Connection, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def exit_note_path(tmp_dir: Path, rank: int) -> Path:
    return Path(tmp_dir) / f"rank{rank}.exit"


def exit_note(tmp_dir: Path, rank: int) -> str:
    try:
        return exit_note_path(tmp_dir, rank).read_text(errors="replace")
    except OSError:
        return ""


def die_with_parent(sig: int) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (no-op elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _build(name, method, path, dtype, tp_size, options):
    if ":" in name:  # "module:Class", for backends outside plugins.engine.registry.BACKENDS
        module, cls = name.split(":")
        cls = getattr(importlib.import_module(module), cls)
    else:
        cls = backend_class(name)
    backend = getattr(cls, method)(path, dtype=dtype, tp_size=tp_size, **options)
    plain = (str, int, float, bool, torch.dtype, type(None))
    info = {"name": backend.name, "config": backend.config, "dtype": backend.dtype,
            "kv_layout": getattr(backend, "kv_layout", "head"),
            "attributes": {k: v for k, v in vars(backend).items() if not k.startswith("_") and isinstance(v, plain)}}
    return backend, info


def worker_main() -> None:
    import torch.distributed as dist

    die_with_parent(signal.SIGKILL)  # torchrun (or the caller, launcher 'process') gone: nobody to answer
    timeout_s = float(os.environ.get(TIMEOUT_ENV, 600))
    group = "RANK" in os.environ  # started by torchrun / deepspeed; else one plain worker
    if group and not dist.is_initialized():
        use_local_gpu()
        dist.init_process_group(process_group_backend(), timeout=timedelta(seconds=timeout_s))
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    front_here = os.environ.get(FRONT_ENV) == "1" and os.environ.get("LOCAL_RANK", "0") == "0"
    here = (socket.gethostname(), os.getpid(), front_here)
    ranks = [here]  # rank r's (host, process id, front?), for the parent's liveness checks
    if group:
        ranks = [None] * world
        dist.all_gather_object(ranks, here)
    fronts = [r for r, (_, _, front) in enumerate(ranks) if front]
    if len(fronts) != 1:
        raise RuntimeError(f"{len(fronts)} ranks on a front machine (node rank 0) in a group of {world}; "
                           "exactly one mqa-serve --node-rank 0 may join a rendezvous")
    pids = [(host, pid) for host, pid, _ in ranks]
    # Exit note: written when this rank leaves through Python (an exception) or on SIGTERM (faulthandler's
    # C-level handler, then the default action), never when it is killed or crashes: the parent tells cause
    # from consequence by it.
    note = open(exit_note_path(Path(os.environ[ADDRESS_ENV]).parent, rank), "w")
    faulthandler.register(signal.SIGTERM, file=note, all_threads=False, chain=True)
    try:
        _serve(rank, world, group, pids, fronts[0])
    except BaseException as exc:
        note.write(f"{type(exc).__name__}: {exc}\n")
        note.flush()
        raise


def _serve(rank: int, world: int, group: bool, pids: list, front: int) -> None:
    import torch.distributed as dist

    conn = Client(os.environ[ADDRESS_ENV], family="AF_UNIX") if rank == front else None
    backend = runner = None
    while True:
        request = [recv(conn) if rank == front else None]
        if group:
            dist.broadcast_object_list(request, src=front)
        method, args, kwargs = request[0]
        if method == "__close__":
            break
        result, error = None, None
        try:
            if method == "__build__":
                backend, result = _build(*args, **kwargs)
                result["pids"] = pids
            elif method == "__open_runner__":
                runner = None  # the old pool is freed before the new one is allocated
                keep_freed_memory()  # a serving rank from here on
                runner = open_runner(backend, *args)
                result = runner.info
            elif method == "__runner_execute__":
                result = runner.execute(*args)
            else:
                result = getattr(backend, method)(*args, **kwargs)
        except Exception as exc:
            error = (traceback.format_exc(), str(exc) if isinstance(exc, ConfigError) else None)
        errors = [error]
        if group:
            errors = [None] * world
            dist.all_gather_object(errors, error)
        if rank == front:
            failed = [(r, e) for r, e in enumerate(errors) if e]
            if not failed:
                send(conn, ("ok", result))
            elif all(e[1] is not None for _, e in failed):
                send(conn, ("config", failed[0][1][1]))
            else:
                send(conn, ("error", "\n".join(f"[rank {r}]\n{e[0]}" for r, e in failed)))
    if backend is not None:
        backend.close()
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    from plugins.core.console import exit_without_collecting

    exit_without_collecting()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    worker_main()
