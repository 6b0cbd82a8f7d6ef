"""The serving engine: one loop drives the model one step at a time, for callers on asyncio event loops.

Callers `submit` requests (checked here, once) and `cancel` them from their threads; before every step
the loop asks the scheduler for the step (plugins.serving.scheduler), the model runner executes it
(plugins.serving.runner, in this process or in every tensor-parallel rank), and the scheduler applies
the result. New tokens go to each request's asyncio queue (the last ones with the finish reason);
detokenization and HTTP happen in the event loop, so this loop never waits on them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field

from plugins.core.arch import arch
from plugins.engine.contract import Backend
from plugins.serving.kv_manager import KVManager
from plugins.serving.metrics import Metrics
from plugins.serving.request import Request, RequestRefused, failure_message
from plugins.serving.runner import open_runner
from plugins.serving.scheduler import Scheduler
from plugins.serving.speculation import SpeculationPolicy
from plugins.serving.step import StepResult
from plugins.serving.token_budget import ITL_SLO_S, TTFT_SLO_S, GoodputBudget, TokenBudget, token_budget


class QueueFull(RuntimeError):
    pass


class ServerClosing(RuntimeError):
    pass


@dataclass
class ResultQueue:
    """A request on its way through the engine: where its results go (an asyncio queue on the caller's
    event loop) and when it arrived and got its first token."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _dispatch(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineCore:
    """One engine's scheduler, KV manager and model runner, stepped by the caller (no thread): `add`
    requests, `step()` until they finish. `ServingEngine` drives one from its loop."""

    def __init__(self, backend: Backend, slots: int, capacity: int | None = None, prefix_cache_bytes: int = 0,
                 max_batched_tokens: int | str | None = None, budget: TokenBudget | None = None):
        """`capacity`: tokens per slot (prompt + new), the model's n_positions by default. The token budget
        of a step: `max_batched_tokens` (None: whole prompts; "auto": goodput from measured step times) or a
        strategy object (`budget`: plugins.serving.token_budget)."""
        capacity = arch(backend.config).n_positions if capacity is None else capacity
        self.capacity = capacity
        self.runner = open_runner(backend, slots, capacity)
        self.kv = KVManager(self.runner.info, capacity, prefix_cache_bytes)
        self.scheduler = Scheduler(slots, capacity, self.kv, budget or token_budget(max_batched_tokens),
                                   SpeculationPolicy() if self.runner.info.speculative else None)

    def add(self, request: Request) -> None:
        request.check(self.capacity)
        self.scheduler.add(request)

    def step(self) -> StepResult:
        step = self.scheduler.schedule()
        result = self.runner.execute(step)
        self.scheduler.update(step, result)
        return result


class ServingEngine:
    """FIFO admission into `slots` KV slots; a request waits only when every slot is taken, and at
    most `max_waiting` requests wait (the requests queued for the next step that a free slot will take
    do not count).

    A failure of one request (its prefill or sampling raised) ends that request alone. A failure of the
    engine (its step raised, or a worker process died: `watch`) fails every request with one short
    message, turns /health to 503 and ends the loop; the details go to the server's log only."""

    def __init__(self, backend: Backend, slots: int, capacity: int, max_waiting: int = 256,
                 prefix_cache_bytes: int = 0, max_batched_tokens: int | str | None = None,
                 ttft_slo: float = TTFT_SLO_S, itl_slo: float = ITL_SLO_S):
        """`max_batched_tokens`: the token budget of a step (None: whole prompts), or "auto": prompt
        tokens per step for goodput under the `ttft_slo` / `itl_slo` targets, from measured step times
        (plugins.serving.token_budget)."""
        self.backend, self.slots, self.capacity, self.max_waiting = backend, slots, capacity, max_waiting
        self.max_batched_tokens, self.prefix_cache_bytes = max_batched_tokens, prefix_cache_bytes
        self.core = EngineCore(backend, slots, capacity, prefix_cache_bytes,
                               budget=token_budget(max_batched_tokens, ttft_slo, itl_slo))
        self.runner, self.kv, self.scheduler = self.core.runner, self.core.kv, self.core.scheduler
        self.metrics = Metrics(slots, self.kv, adaptive=isinstance(self.scheduler.budget, GoodputBudget))
        self._cond = threading.Condition()
        self._queues: dict[int, ResultQueue] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._arriving = 0  # requests received, not yet submitted (read, tokenized): a burst's first step waits
        self.error: str | None = None  # set when the engine failed; the server then reports unhealthy
        self.failed_at_close = 0
        self._stopped = threading.Event()

    def run(self) -> None:
        """The decode loop, until `close()`. Run it on the thread that loaded the backend (the main
        thread): on another thread torch's OpenMP team made each santacoder-1b step ~10 % slower here."""
        try:
            self._loop()
        finally:
            self._stopped.set()

    def new_id(self) -> int:
        return next(self._ids)

    def arrival(self) -> "Arrival":
        """A request received and not yet submitted (being read, tokenized): while nothing runs, the next
        step waits for it (Scheduler.gather) until `submit(..., arrival=)` queues it or `Arrival.done()`."""
        with self._cond:
            self._arriving += 1
        return Arrival(self)

    def _arrived(self) -> None:
        with self._cond:
            self._arriving -= 1
            self._cond.notify()

    def submit(self, *queues: ResultQueue, arrival: "Arrival | None" = None) -> None:
        """Queue requests together (all or none): n choices of one prompt are admitted in one step where
        the slots allow, so they share its prefill. RequestRefused names what no retry can fix.
        `arrival`: theirs, done once they are queued (in the same hold of the lock) or refused."""
        try:
            self._submit(queues, arrival)
        finally:
            if arrival is not None:
                arrival.done()

    def _submit(self, queues: tuple[ResultQueue, ...], arrival: "Arrival | None") -> None:
        for q in queues:
            q.request.check(self.capacity)
        if len(queues) > self.slots + self.max_waiting:
            raise RequestRefused("n", f"{len(queues)} generations (prompts x n) in one request can never be "
                                      f"queued together: this server runs {self.slots} and queues "
                                      f"{self.max_waiting} (--max-waiting) at most")
        with self._cond:
            if self._closing or self.error:
                raise ServerClosing("the server is shutting down" if self._closing else f"engine failed: {self.error}")
            waiting = len(self.scheduler.waiting)
            without_slot = waiting + len(queues) - 1 - (self.slots - self.scheduler.held)
            if without_slot >= self.max_waiting:
                raise QueueFull(f"server busy: {max(without_slot, 0)} requests already wait for a KV slot "
                                f"(--max-waiting {self.max_waiting}); retry later")
            for q in queues:
                self._queues[q.request.id] = q
                q.request.arrival = q.arrived
                self.scheduler.add(q.request)
            if arrival is not None:
                arrival.done()  # queued: it counts as waiting now, no longer as arriving
            self.metrics.waiting.set(len(self.scheduler.waiting))
            self._cond.notify()

    def cancel(self, request_id: int) -> None:
        """Drop a request (client gone, stop string): a waiting one ends now, a running one at the next step."""
        with self._cond:
            if self.scheduler.abort(request_id):
                q = self._queues.pop(request_id)
                self.metrics.waiting.set(len(self.scheduler.waiting))
                self.metrics.finished.labels("cancelled").inc()
                q.put(("done", "cancelled"))  # whoever awaits its events ends now
            elif request_id in self._queues:
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self.scheduler.has_work() or self._closing or self.error):
                    self._cond.wait()
                if self.error or (self._closing and not self.scheduler.has_work()):
                    return
                wait = 0.0 if self._closing else self.scheduler.gather(time.monotonic(), self._arriving)
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                step = self.scheduler.schedule()
                for rid in step.release:
                    q = self._queues.pop(rid, None)
                    if q is not None:
                        self.metrics.finished.labels("cancelled").inc()
                        q.put(("done", "cancelled"))
                self.metrics.waiting.set(len(self.scheduler.waiting))
            try:
                result = self.runner.execute(step)
            except Exception as exc:  # the engine's state is unknown: fail every request, refuse new ones
                self._fail(failure_message(exc), traceback.format_exc())
                return
            if self.error:  # the watcher found a dead worker while this step ran
                return
            with self._cond:
                self.scheduler.update(step, result)
            self._deliver(result, [a.request for a in step.admit])

    def _deliver(self, result: StepResult, admitted: list[Request]) -> None:
        now = time.monotonic()
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            new = 0
            for request in admitted:
                self.metrics.prompt_tokens.inc(len(request.prompt))
            for rid, entries in result.prompt_logprobs.items():
                q = self._queues.get(rid)
                if q is not None:
                    outbox.setdefault(q.loop, []).append((q.queue, ("prompt", entries)))
            for rid, tokens in result.tokens.items():
                q = self._queues.get(rid)
                if q is None:
                    continue  # dropped while this step ran
                if q.first_token is None:
                    q.first_token = now
                    self.metrics.ttft.observe(now - q.arrived)
                new += len(tokens)
                reason = result.finished.get(rid)
                if reason is not None:  # its last tokens carry the finish reason
                    del self._queues[rid]
                    self.metrics.finished.labels(reason).inc()
                outbox.setdefault(q.loop, []).append((q.queue, ("tokens", tokens, result.logprobs.get(rid), reason)))
            for rid, message in result.failed.items():
                q = self._queues.pop(rid, None)
                if q is not None:
                    print(f"request {rid} failed alone: {message}", flush=True)
                    self.metrics.finished.labels("error").inc()
                    outbox.setdefault(q.loop, []).append((q.queue, ("error", f"this request failed: {message}")))
            self.metrics.step(now, new, result)
            budget = self.scheduler.budget
            if self.metrics.step_budget is not None and isinstance(budget, GoodputBudget):
                self.metrics.step_budget.set(budget.tokens)
            self.metrics.kv(self.kv)
            self.metrics.running.set(self.scheduler.held)
            self.metrics.slots_used.set(self.scheduler.held)
            self.metrics.usage.set(self.scheduler.held / self.slots)
        # One wake-up of the event loop per step, not one per request: on a 2-core machine every
        # switch away from the decode threads shows in the step time.
        for loop, items in outbox.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _fail(self, message: str, details: str) -> None:
        with self._cond:
            if self.error:
                return
            self.error = message
            for q in self._queues.values():
                q.put(("error", f"engine failed: {message}"))
                self.metrics.finished.labels("error").inc()
            self._queues.clear()
            self.scheduler.waiting.clear()
            self._cond.notify()
        print(f"engine failed ({message}); failing every request:\n{details}", flush=True)

    def watch(self, interval: float = 0.2) -> None:
        """Fail the engine as soon as the backend reports a dead worker (`Backend.dead_worker()`, e.g.
        a tensor-parallel rank killed), not at the next request. Runs on its own daemon thread."""
        def run():
            while not self._stopped.wait(interval):
                dead = None if self._closing else self.backend.dead_worker()
                if dead and not self._closing:
                    self._fail(dead, "")
                    return

        threading.Thread(target=run, name="engine-watch", daemon=True).start()

    def close(self, timeout: float = 30.0) -> int:
        """Stop taking requests, let the running ones finish (up to `timeout` s), fail the rest with
        an error; returns how many were failed (counted once over repeated calls)."""
        with self._cond:
            self._closing = True
            failed = [self._queues.pop(r.id) for r in self.scheduler.waiting if r.id in self._queues]
            self.scheduler.waiting.clear()
            self._cond.notify()
        if not self._stopped.wait(timeout):
            with self._cond:
                failed += self._queues.values()
                self._queues.clear()
                for rid in list(self.scheduler.running) + [r for f in self.scheduler.fills.values()
                                                           for r in f.requests]:
                    self.scheduler.abort(rid)
                self._cond.notify()
            self._stopped.wait(10)
        for q in failed:
            q.put(("error", "the server is shutting down: this request was cut at the graceful timeout"))
            self.metrics.finished.labels("error").inc()
        self.failed_at_close += len(failed)
        return len(failed)

    def state(self) -> dict:
        with self._cond:
            return {**self.scheduler.state(), "kv_pool_bytes": self.kv.info.pool_bytes + self.kv.info.draft_bytes,
                    "kv_bytes": self.kv.bytes_in_use(), "kv_budget_bytes": self.kv.budget_bytes(),
                    "prefix_cache_bytes": self.prefix_cache_bytes, "max_batched_tokens": self.max_batched_tokens,
                    "error": self.error}


class Arrival:
    """A request on its way to `ServingEngine.submit` (`ServingEngine.arrival()`); `done()` once."""

    def __init__(self, engine: ServingEngine):
        self.engine, self.finished = engine, False

    def done(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._arrived()
