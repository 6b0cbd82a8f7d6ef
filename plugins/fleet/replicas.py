"""Replicas of `mqa-serve` behind vLLM's router (`vllm-router`, the PyPI wheel of vllm-project/router).

    fleet = Fleet(servers=[replica_command(...), ...], workers=["http://10.0.0.7:8000"],
                  router=router_command(...), log_dir=...)
    fleet.start(); fleet.wait(); fleet.stop()

Each replica is a child process pinned to its own share of this machine's cores, dying with us (Linux
parent-death signal); the router runs beside them and routes by its policy (cache-aware by default:
requests sharing a prefix go to the replica whose radix tree holds it, unless the load is too uneven).
A replica that dies is routed around by the router (its health checks and circuit breaker); the fleet
ends when the router ends, when every worker is gone, or on SIGTERM / SIGINT (router first, then the
replicas drain their requests as mqa-serve does on SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx2

from plugins.launch.worker import die_with_parent

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")


def core_shares(cores: list[int], n: int) -> list[list[int]]:
    """`n` contiguous groups of `cores` as equal as can be; with fewer cores than replicas, all share all."""
    if len(cores) < n:
        return [list(cores) for _ in range(n)]
    if n == 0:
        return []
    size, extra = divmod(len(cores), n)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        shares.append(list(cores[start:end]))
        start = end
    return shares


def replica_command(checkpoint: Path, port: int, serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "plugins.http", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
            *serve_args]


def router_command(urls: list[str], host: str, port: int, policy: str, metrics_port: int,
                   health_check_s: int) -> list[str]:
    return [sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", *urls, "--host", host,
            "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--health-check-interval-secs", str(health_check_s),
            "--worker-startup-timeout-secs", "30", "--log-level", "warning"]


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx2.get(url + "/health", timeout=timeout).status_code == 200
    except httpx2.HTTPError:
        return False


class FleetError(RuntimeError):
    """A replica or the router could not start, or exited."""


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    url: str | None = None  # where it answers /health
    cores: list[int] | None = None
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # Own session: stopping it ends its tensor-parallel workers too (they are its process group).
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env}, preexec_fn=partial(_child_setup, self.cores))

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def _child_setup(cores: list[int] | None) -> None:
    die_with_parent(signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


class Fleet:
    def __init__(self, replicas: list[Child], workers: list[str], router: Child, startup_timeout_s: float = 600.0):
        self.replicas, self.workers, self.router = replicas, workers, router
        self.startup_timeout_s = startup_timeout_s
        self._reported: set[str] = set()

    def start(self) -> None:
        """Every replica up and healthy, then the router; on any failure everything started is stopped."""
        try:
            for child in self.replicas:
                child.start()
            self._wait_healthy(self.replicas, "replica")
            self.router.start()
            self._wait_healthy([self.router], "router")
        except BaseException:
            self.stop(grace_s=5)
            raise

    def _wait_healthy(self, children: list[Child], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                code = child.exited()
                if code is not None:
                    raise FleetError(f"{child.name} exited with code {code} while starting; its log "
                                     f"({child.log_path}) ends:\n{child.tail()}")
                if healthy(child.url):
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                raise FleetError(f"{pending[0].name} not healthy after {self.startup_timeout_s:.0f} s; its log "
                                 f"({pending[0].log_path}) ends:\n{pending[0].tail()}")
            if pending:
                time.sleep(0.3)

    def alive_replicas(self) -> list[Child]:
        return [c for c in self.replicas if c.exited() is None]

    def poll(self) -> str | None:
        """None while the fleet serves; else why it ends. Reports each replica's death once."""
        for child in self.replicas:
            code = child.exited()
            if code is not None and child.name not in self._reported:
                self._reported.add(child.name)
                print(f"{child.name} ({child.url}) exited with code {code}; the router routes around it "
                      f"(log {child.log_path})", flush=True)
        code = self.router.exited()
        if code is not None:
            return f"the router exited with code {code}; its log ({self.router.log_path}) ends:\n{self.router.tail()}"
        if not self.workers and not self.alive_replicas():
            return "every replica exited"
        return None

    def wait(self, interval_s: float = 0.5) -> str:
        while True:
            reason = self.poll()
            if reason is not None:
                return reason
            time.sleep(interval_s)

    def stop(self, grace_s: float = 35.0) -> None:
        """Router first (no new requests), then the replicas drain (mqa-serve's SIGTERM); SIGKILL after grace_s."""
        self.router.signal(signal.SIGTERM)
        for child in self.replicas:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in [self.router, *self.replicas]:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            child.signal(signal.SIGKILL)
            child.proc.wait()
