"""Iteration-level scheduling: one loop drives the engine one decode step at a time.

Before every step it hands the engine the requests that wait (as many as there are free slots)
and the ones to drop (finished by a stop string, cancelled, client gone); the engine prefills
prompts within the step's token budget (chunks of long ones), places the complete ones in the
running batch and decodes every row once (`ContinuousBatch.step`, one call, also across TP ranks). New tokens go to each request's asyncio queue (the last ones with the finish reason); detokenization and
HTTP happen in the event loop, so this loop never waits on them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from plugins.core.config import ConfigError
from plugins.serving.batching import open_batch
from plugins.serving.request import BatchRequest, check_request
from plugins.serving.step_budget import AdaptiveTokenBudget


class QueueFull(RuntimeError):
    pass


def engine_error(exc: BaseException) -> str:
    """The first line of an engine failure, short (a worker's log stays in the server's log)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class ServerClosing(RuntimeError):
    pass


@dataclass
class Request:
    params: BatchRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    generated: int = 0

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _dispatch(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class Metrics:
    def __init__(self, slots: int, pool_bytes: int, adaptive: bool = False):
        disable_created_metrics()  # no *_created series: they only say when the server started
        self.registry = r = CollectorRegistry()
        self.running = Gauge("mqa_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("mqa_requests_waiting", "Requests waiting for a KV slot", registry=r)
        self.slots_used = Gauge("mqa_kv_pool_slots_used", "KV pool slots holding a request", registry=r)
        Gauge("mqa_kv_pool_slots", "KV pool slots", registry=r).set(slots)
        Gauge("mqa_kv_pool_bytes", "Bytes of the preallocated KV pool (per rank)", registry=r).set(pool_bytes)
        self.usage = Gauge("mqa_kv_pool_usage_ratio", "Fraction of KV pool slots in use", registry=r)
        self.tokens_per_s = Gauge("mqa_generation_tokens_per_second", "Generated tokens/s over the last 10 s",
                                  registry=r)
        self.tokens = Counter("mqa_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("mqa_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prefill_tokens = Counter("mqa_prefill_tokens", "Prompt tokens computed by prefills (one per shared "
                                      "prompt of n choices, cached prefixes not counted)", registry=r)
        self._prefill_seen = 0
        self.finished = Counter("mqa_requests_finished", "Finished requests", ["reason"], registry=r)
        self.ttft = Histogram("mqa_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.steps = Counter("mqa_decode_steps", "Engine steps", registry=r)
        self.step_chunk = Histogram("mqa_step_prefill_tokens", "Prompt tokens computed per engine step "
                                    "(chunked prefill)", registry=r, buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096))
        self.step_budget = Gauge("mqa_step_token_budget", "Prompt tokens the last engine step could compute "
                                 "(--max-num-batched-tokens auto)", registry=r) if adaptive else None
        self.step_seconds = Histogram("mqa_step_seconds", "Engine step time by phase: prefill (prompt chunks "
                                      "alone), decode (every running row), mixed (both in one forward)",
                                      ["phase"], registry=r,
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.prefix_lookups = Counter("mqa_prefix_cache_lookups", "Prompts looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("mqa_prefix_cache_hits", "Prompts that reused a cached prefix", registry=r)
        self.prefix_reused = Counter("mqa_prefix_cache_reused_tokens", "Prompt tokens not recomputed", registry=r)
        self.prefix_bytes = Gauge("mqa_prefix_cache_bytes", "Bytes of cached prefix KV (per rank)", registry=r)
        self.prefix_hit_rate = Gauge("mqa_prefix_cache_hit_rate", "Hits / lookups since start", registry=r)
        self.spec_steps = Counter("mqa_spec_decode_steps", "Engine steps that verified proposals", registry=r)
        self.spec_drafted = Counter("mqa_spec_decode_draft_tokens", "Tokens proposed (prompt lookup)", registry=r)
        self.spec_accepted = Counter("mqa_spec_decode_accepted_tokens", "Proposed tokens the model confirmed",
                                     registry=r)
        self.spec_rate = Gauge("mqa_spec_decode_acceptance_ratio", "Accepted / proposed since start", registry=r)
        self._spec_seen = {"steps": 0, "drafted": 0, "accepted": 0}
        self._window: deque[tuple[float, int]] = deque()
        self._prefix_seen = {"lookups": 0, "hits": 0, "reused_tokens": 0}

    def prefix_cache(self, stats: dict) -> None:
        """The engine's cumulative prefix-cache figures -> counters and gauges."""
        for key, counter in (("lookups", self.prefix_lookups), ("hits", self.prefix_hits),
                             ("reused_tokens", self.prefix_reused)):
            counter.inc(stats[key] - self._prefix_seen[key])
            self._prefix_seen[key] = stats[key]
        self.prefix_bytes.set(stats["cached_bytes"])
        self.prefix_hit_rate.set(stats["hits"] / stats["lookups"] if stats["lookups"] else 0.0)

    def speculative(self, stats: dict) -> None:
        """The engine's cumulative speculation counts -> counters and the acceptance gauge."""
        for key, counter in (("steps", self.spec_steps), ("drafted", self.spec_drafted),
                             ("accepted", self.spec_accepted)):
            counter.inc(stats[key] - self._spec_seen[key])
            self._spec_seen[key] = stats[key]
        self.spec_rate.set(stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0)

    def prefill(self, total: int) -> None:
        """The engine's running count of computed prompt tokens -> the counter."""
        self.prefill_tokens.inc(max(total - self._prefill_seen, 0))
        self._prefill_seen = max(total, self._prefill_seen)

    def step(self, now: float, new_tokens: int, result: dict) -> None:
        self.steps.inc()
        self.step_chunk.observe(result.get("chunk_tokens", 0))
        for phase, seconds in result.get("step_s", {}).items():
            self.step_seconds.labels(phase).observe(seconds)
        self.tokens.inc(new_tokens)
        self._window.append((now, new_tokens))
        while self._window and now - self._window[0][0] > 10.0:
            self._window.popleft()
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        self.tokens_per_s.set(sum(n for _, n in list(self._window)[1:]) / span if span > 0 else 0.0)


class Scheduler:
    """FIFO admission into `slots` KV slots; a request waits only when every slot is taken, and at
    most `max_waiting` requests wait (the requests queued for the next step that a free slot will take
    do not count).

    A failure of one request (its sampling raised) ends that request alone. A failure of the engine
    (its step raised, or a worker process died: `watch`) fails every request with one short message,
    turns /health to 503 and ends the loop; the details go to the server's log only."""

    def __init__(self, backend, slots: int, capacity: int, max_waiting: int = 256, prefix_cache_bytes: int = 0,
                 max_batched_tokens: int | str | None = None):
        """`max_batched_tokens`: the token budget of a step (None: whole prompts), or "auto": prompt
        tokens per step from measured step times (plugins.serving.step_budget)."""
        self.backend, self.slots, self.capacity, self.max_waiting = backend, slots, capacity, max_waiting
        self.budget = AdaptiveTokenBudget() if max_batched_tokens == "auto" else None
        self.batch = open_batch(backend, slots, capacity, prefix_cache_bytes,
                                None if self.budget else max_batched_tokens)
        self.max_batched_tokens = max_batched_tokens
        state = self.batch.state()
        self.prefix_cache_bytes = prefix_cache_bytes
        self.metrics = Metrics(slots, state["kv_pool_bytes"], adaptive=self.budget is not None)
        self.pool_bytes = state["kv_pool_bytes"]
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._drop: set[int] = set()
        self._ids = itertools.count(1)
        self._closing = False
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

    def submit(self, *requests: Request) -> None:
        """Queue requests together (all or none): n choices of one prompt are admitted in one step where
        the slots allow, so they share its prefill."""
        for request in requests:
            check_request(request.params, self.capacity)  # ConfigError: the caller's 400, before any queueing
        if len(requests) > self.slots + self.max_waiting:  # would never be queued: retrying cannot help
            raise ConfigError(f"{len(requests)} generations (prompts x n) in one request can never be queued "
                              f"together: this server runs {self.slots} and queues {self.max_waiting} "
                              f"(--max-waiting) at most")
        with self._cond:
            if self._closing or self.error:
                raise ServerClosing("the server is shutting down" if self._closing else f"engine failed: {self.error}")
            without_slot = len(self._waiting) + len(requests) - 1 - (self.slots - len(self._running))
            if without_slot >= self.max_waiting:
                raise QueueFull(f"server busy: {max(without_slot, 0)} requests already wait for a KV slot "
                                f"(--max-waiting {self.max_waiting}); retry later")
            self._waiting.extend(requests)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request_id: int) -> None:
        """Drop a request (client gone, stop string): its slot is freed at the next step."""
        with self._cond:
            for req in self._waiting:
                if req.params.id == request_id:
                    self._waiting.remove(req)
                    self.metrics.waiting.set(len(self._waiting))
                    self.metrics.finished.labels("cancelled").inc()
                    req.put(("done", "cancelled"))  # whoever awaits its events ends now
                    return
            if request_id in self._running:
                self._drop.add(request_id)
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._closing or self.error):
                    self._cond.wait()
                if self.error or (self._closing and not self._running and not self._waiting):
                    return
                release = sorted(self._drop)
                for rid in release:
                    req = self._running.pop(rid, None)
                    if req is not None:
                        self.metrics.finished.labels("cancelled").inc()
                        req.put(("done", "cancelled"))
                self._drop.clear()
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.slots:
                    admit.append(self._waiting.popleft())
                for req in admit:
                    self._running[req.params.id] = req
                self.metrics.waiting.set(len(self._waiting))
            try:
                result = self.batch.step([r.params for r in admit], release,
                                         self.budget.next(len(admit)) if self.budget else None)
                if self.budget:
                    self.budget.observe(result)
            except Exception as exc:  # the engine's state is unknown: fail every request, refuse new ones
                self._fail(engine_error(exc), traceback.format_exc())
                return
            if self.error:  # the watcher found a dead worker while this step ran
                return
            self._deliver(result, admit)

    def _deliver(self, result: dict, admit: list[Request]) -> None:
        now = time.monotonic()
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            new = 0
            for req in admit:
                self.metrics.prompt_tokens.inc(len(req.params.prompt))
            logprobs, finished = result.get("logprobs", {}), result["finished"]
            for rid, entries in result.get("prompt_logprobs", {}).items():
                req = self._running.get(rid)
                if req is not None:
                    outbox.setdefault(req.loop, []).append((req.queue, ("prompt", entries)))
            for rid, tokens in result["tokens"].items():
                req = self._running.get(rid)
                if req is None:
                    continue  # dropped while this step ran
                if req.first_token is None:
                    req.first_token = now
                    self.metrics.ttft.observe(now - req.arrived)
                req.generated += len(tokens)
                new += len(tokens)
                reason = finished.get(rid)
                if reason is not None:  # its last tokens carry the finish reason
                    self._running.pop(rid)
                    self.metrics.finished.labels(reason).inc()
                outbox.setdefault(req.loop, []).append((req.queue, ("tokens", tokens, logprobs.get(rid), reason)))
            for rid, reason in finished.items():
                req = self._running.pop(rid, None)
                if req is not None:
                    self.metrics.finished.labels(reason).inc()
                    outbox.setdefault(req.loop, []).append((req.queue, ("done", reason)))
            for rid, message in result.get("failed", {}).items():
                req = self._running.pop(rid, None)
                if req is not None:
                    print(f"request {rid} failed alone: {message}", flush=True)
                    self.metrics.finished.labels("error").inc()
                    outbox.setdefault(req.loop, []).append((req.queue, ("error", f"this request failed: {message}")))
            self.metrics.step(now, new, result)
            if self.budget:
                self.metrics.step_budget.set(self.budget.tokens)
            self.metrics.prefill(result.get("prefill_tokens", 0))
            if "prefix_cache" in result:
                self.metrics.prefix_cache(result["prefix_cache"])
            if "speculative" in result:
                self.metrics.speculative(result["speculative"])
            self.metrics.running.set(len(self._running))
            self.metrics.slots_used.set(len(self._running))
            self.metrics.usage.set(len(self._running) / self.slots)
        # One wake-up of the event loop per step, not one per request: on a 2-core machine every
        # switch away from the decode threads shows in the step time.
        for loop, items in outbox.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _fail(self, message: str, details: str) -> None:
        with self._cond:
            if self.error:
                return
            self.error = message
            for req in list(self._running.values()) + list(self._waiting):
                req.put(("error", f"engine failed: {message}"))
                self.metrics.finished.labels("error").inc()
            self._running.clear()
            self._waiting.clear()
            self._cond.notify()
        print(f"engine failed ({message}); failing every request:\n{details}", flush=True)

    def watch(self, interval: float = 0.2) -> None:
        """Fail the engine as soon as the backend reports a dead worker (`Backend.dead_worker()`, e.g.
        a tensor-parallel rank killed), not at the next request. Runs on its own daemon thread."""
        probe = getattr(self.backend, "dead_worker", None)
        if probe is None:
            return

        def run():
            while not self._stopped.wait(interval):
                dead = None if self._closing else probe()
                if dead and not self._closing:
                    self._fail(dead, "")
                    return

        threading.Thread(target=run, name="engine-watch", daemon=True).start()

    def close(self, timeout: float = 30.0) -> int:
        """Stop taking requests, let the running ones finish (up to `timeout` s), fail the rest with
        an error; returns how many were failed (counted once over repeated calls)."""
        with self._cond:
            self._closing = True
            failed = list(self._waiting)
            self._waiting.clear()
            self._cond.notify()
        if not self._stopped.wait(timeout):
            with self._cond:
                failed += self._running.values()
                self._running.clear()
                self._cond.notify()
            self._stopped.wait(10)
        for req in failed:
            req.put(("error", "the server is shutting down: this request was cut at the graceful timeout"))
            self.metrics.finished.labels("error").inc()
        self.failed_at_close += len(failed)
        return len(failed)

    def state(self) -> dict:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting), "slots": self.slots,
                    "capacity": self.capacity, "kv_pool_bytes": self.pool_bytes,
                    "prefix_cache_bytes": self.prefix_cache_bytes, "max_batched_tokens": self.max_batched_tokens,
                    "error": self.error}
