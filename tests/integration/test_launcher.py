"""plugins/launch (launcher and worker) with a tiny probe backend in 2 real worker processes (torchrun or deepspeed,
gloo): every call reaches every rank, results come back from rank 0, worker errors surface with
their traceback, and a dead or stuck rank is an error in the parent, not a hang."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plugins.launch.launcher import RemoteBackend, WorkerError

PROBE = "tests.integration.test_launcher:Probe"  # imported by the workers (the launcher puts the repo on PYTHONPATH)


class Probe:
    """A backend-shaped object whose methods exercise the launcher, not a model."""

    name = "probe"

    def __init__(self, tp_size):
        self.config, self.dtype, self.tp_size = {"probe": True}, torch.float32, tp_size
        self.rank = dist.get_rank()

    @classmethod
    def from_hf(cls, path, dtype="float32", tp_size=1, fail_build_on=None):
        if dist.get_rank() == fail_build_on:
            raise ValueError(f"probe build failed on rank {fail_build_on}")
        return cls(tp_size)

    def ranks(self):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, (self.rank, os.environ.get("LOCAL_SIZE"), os.environ.get("PROBE_EXTRA")))
        return out

    def add(self, x, y=0):
        return x + y + self.rank  # rank 0's result is returned

    def fail(self, rank):
        if self.rank == rank:
            raise ValueError(f"probe failure on rank {rank}")

    def exit(self, rank):
        if self.rank == rank:
            os._exit(3)
        dist.barrier()

    def sleep(self, rank, seconds):
        if self.rank == rank:
            time.sleep(seconds)
        dist.barrier()

    def echo_slowly(self, value, seconds):
        time.sleep(seconds)  # long enough for other threads' calls to arrive meanwhile
        return value

    def pids(self):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, os.getpid())
        return out

    def close(self):
        pass


@pytest.fixture(scope="module")
def probe():
    with RemoteBackend(PROBE, ".", tp_size=2, env={"PROBE_EXTRA": "x"}) as remote:
        yield remote


def test_every_rank_runs_each_call_and_rank0_answers(probe):
    assert probe.name == "probe" and probe.config == {"probe": True} and probe.tp_size == 2
    assert probe.ranks() == [(0, "2", "x"), (1, "2", "x")]  # LOCAL_SIZE and extra env reach every rank
    t = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(probe.add(t, y=1), t + 1)


def test_worker_error_surfaces_with_traceback_and_workers_stay_usable(probe):
    with pytest.raises(WorkerError, match=r"(?s)\[rank 1\].*Traceback.*ValueError: probe failure on rank 1"):
        probe.fail(1)
    assert probe.add(1) == 1
    with pytest.raises(WorkerError, match="AttributeError"):
        probe.no_such_method()
    assert [r for r, _, _ in probe.ranks()] == [0, 1]


def test_build_error_surfaces():
    with pytest.raises(WorkerError, match="probe build failed on rank 1"):
        RemoteBackend(PROBE, ".", tp_size=2, fail_build_on=1)


def test_dead_worker_is_an_error_not_a_hang():
    remote = RemoteBackend(PROBE, ".", tp_size=2, timeout_s=120)
    with pytest.raises(WorkerError, match="exit|fail|Connection|closed"):
        remote.exit(1)
    with pytest.raises(WorkerError, match="closed"):
        remote.add(1)
    remote.close()


def test_stuck_worker_times_out_and_is_stopped():
    remote = RemoteBackend(PROBE, ".", tp_size=2)
    remote.timeout_s = 2
    proc = remote._proc
    with pytest.raises(WorkerError, match="did not answer within 2 s while running sleep"):
        remote.sleep(1, 600)
    assert proc.poll() is not None  # the worker group was ended, not left behind
    remote.close()


def test_deepspeed_launcher():
    with RemoteBackend(PROBE, ".", tp_size=2, launcher="deepspeed") as remote:
        assert [(r, size) for r, size, _ in remote.ranks()] == [(0, "2"), (1, "2")]


def test_unknown_launcher():
    with pytest.raises(ValueError, match="unknown launcher"):
        RemoteBackend(PROBE, ".", tp_size=2, launcher="mpirun")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, seconds=30):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_concurrent_callers_each_get_their_own_answer(probe):
    """Three threads call one RemoteBackend at once: calls are serialized, answers never swapped."""
    got = {}

    def call(i):
        got[i] = probe.echo_slowly(i * 100, 0.3)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == {0: 0, 1: 100, 2: 200}


def test_stopped_rank_is_killed_with_the_others_after_a_timeout():
    remote = RemoteBackend(PROBE, ".", tp_size=2)
    pids = remote.pids()
    os.kill(pids[1], signal.SIGSTOP)
    remote.timeout_s = 3
    with pytest.raises(WorkerError, match="did not answer within 3 s"):
        remote.add(1)
    assert _wait_gone(pids + [remote._proc.pid]) == []
    # torchrun stopped its ranks on our SIGTERM (the stopped one was continued: it runs in a session of its
    # own), rather than being killed when it was still waiting for that rank
    assert remote._proc.returncode != -signal.SIGKILL
    remote.close()


def test_ranks_die_when_torchrun_dies():
    remote = RemoteBackend(PROBE, ".", tp_size=2)
    pids = remote.pids()
    os.kill(remote._proc.pid, signal.SIGKILL)  # torchrun gets no chance to stop its ranks
    assert _wait_gone(pids) == [], "ranks outlived torchrun"
    remote.close()


def test_workers_die_when_their_parent_process_dies(tmp_path):
    """A process that started TP workers is SIGKILLed: torchrun and the ranks follow it."""
    code = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from plugins.launch.launcher import RemoteBackend
r = RemoteBackend({PROBE!r}, ".", tp_size=2)
print(r._proc.pid, *r.pids(), flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3
    parent.kill()
    parent.wait()
    assert _wait_gone(pids) == [], "workers outlived the process that started them"


def test_lost_rank_is_named_right():
    remote = RemoteBackend(PROBE, ".", tp_size=2, timeout_s=120)
    with pytest.raises(WorkerError) as err:
        remote.exit(1)
    message = str(err.value).splitlines()[0]
    assert "rank 0" not in message and ("rank 1" in message or "workers" in message), message
    remote.close()


def test_the_rank_that_died_first_is_named_when_torchrun_has_ended_the_other():
    """Rank 1 is SIGKILLed while idle; torchrun then stops rank 0 (SIGTERM). Both are dead when asked,
    and the answer names the cause, not the rank stopped because of it."""
    remote = RemoteBackend(PROBE, ".", tp_size=2, timeout_s=120)
    try:
        pids = remote.pids()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
                  for pid in pids):
            assert time.monotonic() < deadline, "torchrun did not stop rank 0"
            time.sleep(0.05)
        assert remote.dead_worker() == f"tensor-parallel rank 1 (pid {pids[1]}) died"
    finally:
        remote.close()


class Solo:
    """A backend-shaped object for launcher 'process': one worker, no process group."""

    name = "solo"

    def __init__(self, setting):
        self.config, self.dtype, self.tp_size, self.setting = {"solo": True}, torch.float32, 1, setting

    @classmethod
    def from_hf(cls, path, dtype="float32", tp_size=1, setting="x", refuse=False):
        from plugins.core.config import ConfigError

        if refuse:
            raise ConfigError("solo refuses this option")
        return cls(setting)

    def pid(self):
        return os.getpid(), dist.is_initialized(), os.environ.get("RANK")

    def refuse(self):
        from plugins.core.config import ConfigError

        raise ConfigError("bad input, said in the worker")

    def crash(self, sig):
        os.kill(os.getpid(), sig)  # as a native fault would: the signal's default action ends the process

    def close(self):
        pass


SOLO = "tests.integration.test_launcher:Solo"


def test_process_launcher_runs_one_plain_worker(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # a caller that is itself a rank does not pass that on
    with RemoteBackend(SOLO, ".", tp_size=1, launcher="process", setting="y") as remote:
        pid, grouped, rank = remote.pid()
        assert pid != os.getpid() and not grouped and rank is None
        assert remote.setting == "y" and remote.name == "solo"  # the engine's plain attributes come along
        from plugins.core.config import ConfigError

        with pytest.raises(ConfigError, match="bad input, said in the worker"):
            remote.refuse()  # bad input stays a ConfigError across the boundary, and the worker lives on
        assert remote.pid()[0] == pid
    with pytest.raises(ValueError, match="one worker"):
        RemoteBackend(SOLO, ".", tp_size=2, launcher="process")


def test_process_launcher_build_refusal_is_a_config_error():
    from plugins.core.config import ConfigError

    with pytest.raises(ConfigError, match="solo refuses"):
        RemoteBackend(SOLO, ".", tp_size=1, launcher="process", refuse=True)


@pytest.mark.parametrize("sig", [signal.SIGILL, signal.SIGSEGV])
def test_a_native_crash_in_the_worker_is_one_clear_error(sig):
    remote = RemoteBackend(SOLO, ".", tp_size=1, launcher="process")
    pid = remote.pid()[0]
    with pytest.raises(WorkerError) as err:
        remote.crash(int(sig))
    first = str(err.value).splitlines()[0]
    # the signal by name, the call, and where Python was (faulthandler's dump in the worker's log)
    assert first.startswith(f"tests.integration.test_launcher:Solo died with {sig.name} while running crash"), first
    assert "test_launcher.py:" in first and "crash" in first.rpartition("(in ")[2], first
    assert _wait_gone([pid]) == []
    with pytest.raises(WorkerError, match="closed"):
        remote.pid()
    remote.close()
