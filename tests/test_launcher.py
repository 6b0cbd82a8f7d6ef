"""plugins/launcher.py with a tiny probe backend in 2 real worker processes (torchrun or deepspeed,
gloo): every call reaches every rank, results come back from rank 0, worker errors surface with
their traceback, and a dead or stuck rank is an error in the parent, not a hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from plugins.core.launcher import RemoteBackend, WorkerError

PROBE = "tests.test_launcher:Probe"  # imported by the workers (the launcher puts the repo on PYTHONPATH)


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
