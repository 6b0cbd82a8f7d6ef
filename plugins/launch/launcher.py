"""Run a tensor-parallel backend in N worker processes and drive it from a single process.

    m = RemoteBackend("megatron", hf_dir, dtype="float32", tp_size=2)   # starts 2 ranks
    m.logits(ids, mask); m.generate(ids, mask, 64); m.close()

The parent listens on a private AF_UNIX socket and starts `torchrun` (or `deepspeed`) on
plugins.launch.worker. Every rank joins a gloo group; rank 0 connects back to the parent. `launcher="process"`
starts one plain worker process instead (no torchrun, no process group): an engine whose native
code may crash (the peers) runs there, so that a signal ends that engine, not the caller. Each call travels
parent -> rank 0 -> all ranks (`broadcast_object_list`); every rank runs it on its shard, and
rank 0 sends back its result or the traceback of any rank that failed. Every wait has a
deadline and checks that the workers are still alive, so a dead or stuck rank is an error in
the parent (with the tail of the workers' log), never a hang. Calls from several threads are
served one at a time. The workers never outlive us: torchrun gets SIGTERM when our process dies
and each rank SIGKILL when torchrun dies (Linux parent-death signals); stopping them kills the
whole process group, stopped processes included.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

from plugins.core.atomic import process_alive
from plugins.core.config import REPO_ROOT, ConfigError
from plugins.core.tensors import check_inputs
from plugins.launch.worker import ADDRESS_ENV, FRONT_ENV, TIMEOUT_ENV, die_with_parent, exit_note, recv, send



def launch_command(launcher: str, nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    """The command that starts `nproc` ranks of this module's worker loop on this machine, or this
    machine's `nproc // nnodes` of them when `nnodes` machines meet at torchrun's c10d rendezvous.

    Run as a module, not as a file: a script's folder goes first on sys.path, and
    plugins/megatron would then shadow the real `megatron` package.
    """
    if nnodes > 1:
        if launcher != "torchrun":
            raise ValueError(f"ranks on several machines start with torchrun, not {launcher!r}")
        if nproc % nnodes or not rdzv_endpoint:
            raise ValueError(f"{nproc} ranks over {nnodes} machines need nnodes to divide them and a rendezvous "
                             "endpoint HOST:PORT")
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc // nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                "-m", "plugins.launch.worker"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "plugins.launch.worker"]
    if launcher == "process":
        if nproc != 1:
            raise ValueError(f"launcher 'process' runs one worker, got tp_size {nproc}")
        return [sys.executable, "-X", "faulthandler", "-m", "plugins.launch.worker"]
    if launcher == "deepspeed":  # passes --local_rank=N to the script
        port = free_port()
        return [str(Path(sys.executable).with_name("deepspeed")), f"--num_accelerators={nproc}",
                f"--master_port={port}", "--module", "plugins.launch.worker"]
    raise ValueError(f"unknown launcher {launcher!r}; use 'torchrun', 'deepspeed' or 'process'")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A worker rank failed, died, or did not answer in time."""


def crash_site(log: str) -> str:
    """Where the innermost Python frame was when a worker died of a signal: faulthandler's dump in the
    workers' log ('File "...", line N in f' under 'Fatal Python error'), as 'file.py:N f'; '' if none."""
    dump = log.rpartition("Fatal Python error")[2]
    found = re.search(r'File "([^"]+)", line (\d+) in (\S+)', dump)
    return f"{Path(found[1]).name}:{found[2]} {found[3]}" if found else ""


class RemoteBackend:
    """A `Backend` whose ranks run in worker processes; results are the front rank's (plugins.launch.worker)."""

    runs_elsewhere = True
    speculative = draft = None  # a model runner opens in the ranks, which hold these

    def __init__(self, name: str, path, dtype="float32", tp_size: int = 2, method: str = "from_hf",
                 launcher: str = "torchrun", env: dict | None = None, timeout_s: float = 600.0, nnodes: int = 1,
                 rdzv_endpoint: str | None = None, **options):
        command = launch_command(launcher, tp_size, nnodes, rdzv_endpoint)
        self._lock = threading.Lock()  # one call at a time: answers come back in order on one socket
        self.tp_size, self._what, self._pids = tp_size, name, []
        self.timeout_s = timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="plugins-launcher-"))  # 0700: only we can connect
        self.log_path = self._dir / "workers.log"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self._dir / "sock"))
        server.listen(1)
        server.settimeout(0.2)
        worker_env = {**_worker_env(tp_size // nnodes, self._dir, timeout_s), FRONT_ENV: "1", **(env or {})}
        if launcher == "process":  # a caller that is itself a rank must not pass its place in a group on
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                worker_env.pop(key, None)
        with open(self.log_path, "wb") as log:
            # Own session: close() can end torchrun and its ranks as one process group.
            self._proc = subprocess.Popen(command, env=worker_env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=partial(die_with_parent, signal.SIGTERM))
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._dir, self._pids)
        self._conn: Connection | None = None
        self._failure: str | None = None  # why the workers were given up (a call failed), for dead_worker()
        try:
            self._conn = Connection(self._accept(server).detach())
            info = self.call("__build__", name, method, str(path), dtype, tp_size, options)
        except BaseException:
            self.close()
            raise
        finally:
            server.close()
        self.name, self.config, self.dtype = info["name"], info["config"], info["dtype"]
        self.kv_layout = info["kv_layout"]  # part of the contract, a class default on the engines
        host = socket.gethostname()  # rank r's process id where it runs here (others: their collectives fail)
        self._pids[:] = [pid if on == host else None for on, pid in info.get("pids", [])]  # _stop's list too
        for key, value in info["attributes"].items():  # the engine's plain settings (e.g. compute_type)
            if key not in vars(self) and not hasattr(type(self), key):
                setattr(self, key, value)

    def dead_worker(self) -> str | None:
        """None while every rank lives; else which one died (a watcher can ask this between calls)."""
        if self._failure is not None:  # a call found it first and is stopping the workers (that takes seconds)
            return self._failure
        if self._conn is None:
            return None  # closed (or already failed: that call raised)
        dead = self._dead_ranks()
        if dead:
            return f"{self._rank_name(dead[0])} (pid {self._pids[dead[0]]}) died"
        if self._proc.poll() is not None:
            return f"the worker processes exited (code {self._proc.returncode})"
        return None

    def _dead_ranks(self) -> list[int]:
        """Ranks no longer running, the cause first: one that died abruptly (SIGKILL, a crash) left no
        exit note, while the ranks it took down (a collective failed, torchrun stopped them) did."""
        dead = [r for r, pid in enumerate(self._pids) if pid is not None and not process_alive(pid)]
        return sorted(dead, key=lambda r: exit_note(self._dir, r) != "")

    def _rank_name(self, rank: int) -> str:
        return f"tensor-parallel rank {rank}" if self.tp_size > 1 else f"the {self._what} worker"

    def _deadline_check(self, deadline: float, what: str) -> None:
        if self._proc.poll() is not None:
            self._fail(self._exit_reason(what))
        dead = self._dead_ranks()
        if dead:  # before torchrun notices and ends the others
            self._fail(f"lost {self._rank_name(dead[0])} while {what}")
        if time.monotonic() > deadline:
            self._fail(f"workers did not answer within {self.timeout_s:g} s while {what}")

    def _exit_reason(self, what: str) -> str:
        code = self._proc.returncode
        if code is not None and code < 0:  # our own child died of a signal (launcher 'process')
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
            site = crash_site(self._log_text())
            return f"{self._what} died with {sig} while {what}" + (f" (in {site})" if site else "")
        return f"workers exited with code {code} while {what}"

    def _fail(self, error: str):
        self._failure = error
        tail = self.log_tail()
        self._kill()  # the ranks are out of step now: nothing more can be asked of them
        raise WorkerError(f"{error}\n{tail}")

    def _kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._finalizer()

    def _accept(self, server: socket.socket) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn, _ = server.accept()
                conn.setblocking(True)
                return conn
            except socket.timeout:
                self._deadline_check(deadline, "starting")

    def call(self, method: str, *args, **kwargs):
        """Run `method(*args, **kwargs)` on every rank; return rank 0's result."""
        with self._lock:
            return self._call(method, *args, **kwargs)

    def _call(self, method: str, *args, **kwargs):
        if self._conn is None:
            raise WorkerError("workers are closed")
        send(self._conn, (method, args, kwargs))
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(0.2):
            self._deadline_check(deadline, f"running {method}")
        try:
            status, value = recv(self._conn)
        except (EOFError, OSError):
            try:
                self._proc.wait(timeout=10)  # let torchrun report why rank 0 went away
            except subprocess.TimeoutExpired:
                pass
            code = self._proc.poll()
            if code is not None and code < 0:
                self._fail(self._exit_reason(f"running {method}"))
            self._fail(f"lost {self._failed_rank()} while running {method} (workers exit code {code})")
        if status == "config":  # bad input, refused before any work: the same error as in-process
            raise ConfigError(value)
        if status == "error":
            raise WorkerError(f"{method} failed in the workers:\n{value}")
        return value

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return partial(self.call, method)  # an engine's own extras (e.g. save_megatron), outside the contract

    def linear_paths(self, batch: int, prompt_len: int) -> dict:
        return self.call("linear_paths", batch, prompt_len)

    def open_runner(self, slots: int, capacity: int) -> "RemoteRunner":
        """A model runner on every rank (each holds its share of the KV pool); rank 0 answers."""
        return RemoteRunner(self, self.call("__open_runner__", slots, capacity))

    def logits(self, input_ids, attention_mask):
        check_inputs(self.config, input_ids, attention_mask)
        return self.call("logits", input_ids, attention_mask)

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        check_inputs(self.config, input_ids, attention_mask, max_new_tokens)
        return self.call("generate", input_ids, attention_mask, max_new_tokens, **kwargs)

    def _failed_rank(self) -> str:
        """The rank torchrun names as the root cause ("Root Cause ... rank : N" in its error summary), if any."""
        log = self._log_text()
        found = re.findall(r"^\s*rank\s*:\s*(\d+)", log.rpartition("Root Cause")[2], re.MULTILINE)
        return f"rank {found[0]}" if found else "the workers"

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return "--- workers log (tail) ---\n" + self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._proc.poll() is None:
                try:
                    send(self._conn, ("__close__", (), {}))
                    self._proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteRunner:
    """The model runner of a `RemoteBackend`: every rank executes each step; rank 0 answers."""

    def __init__(self, remote: RemoteBackend, info):
        self._remote, self.info = remote, info

    def execute(self, step):
        return self._remote.call("__runner_execute__", step)


def _worker_env(local_ranks: int, tmp_dir: Path, timeout_s: float) -> dict:
    return {**os.environ, "LOCAL_SIZE": str(local_ranks), "OMP_NUM_THREADS": str(_threads_per_rank(local_ranks)),
            ADDRESS_ENV: str(tmp_dir / "sock"), TIMEOUT_ENV: str(timeout_s),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def join_group(tp_size: int, nnodes: int, rdzv_endpoint: str, timeout_s: float = 600.0) -> int:
    """This machine's ranks of a tensor-parallel group whose front (calls, HTTP) runs on another machine
    (`mqa-serve --node-rank R > 0`): they join the rendezvous, load what the front asks and follow its
    calls until it closes them. Returns torchrun's exit code (0: the front closed the group)."""
    command = launch_command("torchrun", tp_size, nnodes, rdzv_endpoint)
    tmp_dir = Path(tempfile.mkdtemp(prefix="plugins-launcher-"))  # this machine's ranks' exit notes
    proc = subprocess.Popen(command, env=_worker_env(tp_size // nnodes, tmp_dir, timeout_s), start_new_session=True,
                            preexec_fn=partial(die_with_parent, signal.SIGTERM))
    previous = signal.signal(signal.SIGTERM, lambda *_: os.killpg(proc.pid, signal.SIGTERM))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(proc, tmp_dir)


def _threads_per_rank(nproc: int) -> int:
    """The cores this process may run on (a fleet pins each replica to its share), split over the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // nproc)


def _stop(proc: subprocess.Popen, tmp_dir: Path, pids=()) -> None:
    """End the worker process group we started (torchrun and its ranks), then remove our temp dir.
    `pids`: the ranks' process ids here (None elsewhere); torchrun starts each rank in a session of its own."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped rank handles SIGTERM only once continued:
            for pid in filter(None, pids):       # torchrun's SIGTERM to it would wait out its 30 s
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:  # whatever is left of the group, torchrun gone or not (a rank it failed to stop, a stopped one)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    shutil.rmtree(tmp_dir, ignore_errors=True)


