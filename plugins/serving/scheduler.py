"""The scheduler: each step it decides which requests run and how many tokens each gets, and emits a
`SchedulerOutput` for the model runner; it then applies the runner's `StepResult` (vLLM v1's and
nano-vllm's split: the scheduler decides, the runner executes).

- Admission, first come first served: a request takes a slot when one is free (n choices of one prompt
  join its prefill) and when the KV manager finds room for its prompt's K and V until they are placed
  in the pool (plugins.serving.kv_manager: it may evict prefix-cache entries; otherwise the request waits).
- Prompt tokens per step: the token-budget strategy (plugins.serving.token_budget) sizes the step,
  and prompts being prefilled take it first come first served: a long prompt spreads over several
  steps (each chunk attends to the K and V of the chunks before it), several short ones share a step,
  and the running rows decode every step. A prompt's first chunk starts after its longest cached
  prefix (looked up then, so a prompt admitted behind one that shares its prefix finds it cached). A
  prompt sharing half of itself with one being prefilled ahead of it never computes that prefix again:
  where the engine runs a step's chunks in one forward and the one ahead computes the shared columns
  in this step, its first chunk starts from them in the same forward (vLLM's prefix caching of blocks
  being computed); otherwise it waits for that prompt to be cached.
- Decode: every running row, one token, or (`SpeculationPolicy`: when measured to pay) up to k + 1.
- The prefix cache keeps a completed prompt's whole blocks, within the KV budget.

- A burst gathers: while nothing runs, the first step waits for the requests that have arrived but are
  still being read or tokenized (at most GATHER_MAX_S after the first waiting one was queued), so it
  computes them all (their shared prefixes once) rather than the first one or two, the rest waiting a
  whole prefill behind them. A lone request does not wait.

It holds no tensors and runs in one process, so tensor-parallel ranks all execute the same steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from plugins.serving.kv_manager import KVManager
from plugins.serving.request import Request
from plugins.serving.speculation import SpeculationPolicy
from plugins.serving.step import Admission, SchedulerOutput, StepResult
from plugins.serving.token_budget import TokenBudget, WholePrompts

# A burst reaches the engine over tens of ms (8 requests of 1056 tokens sharing a prefix, sent within
# 10 ms: queued over 40-50 ms, each 15-95 ms after it arrived, read and tokenized on a busy 2-core
# machine), while a step of prompts alone takes 0.3-3 s on these CPUs: one that starts before the rest
# of its burst is queued costs them a whole step.
GATHER_MAX_S = 0.1


@dataclass(eq=False)
class _Fill:
    """A prompt being prefilled, for the requests that share it."""

    id: int
    prompt: list[int]
    requests: list[int] = field(default_factory=list)
    done: int = 0          # prompt columns computed (or copied from the prefix cache)
    started: bool = False  # its first chunk was planned (the prefix cache was asked)
    kept: int | None = None  # the prefix-cache entry planned from it


class Scheduler:
    def __init__(self, slots: int, capacity: int, kv: KVManager, budget: TokenBudget | None = None,
                 speculation: SpeculationPolicy | None = None):
        self.slots, self.capacity, self.kv = slots, capacity, kv
        self.budget = budget or WholePrompts()
        self.speculation = speculation
        self.waiting: deque[Request] = deque()
        self.fills: dict[int, _Fill] = {}      # FIFO: admitted, prompt not all computed
        self.running: set[int] = set()         # rows decoding
        self.arrival: dict[int, float] = {}    # request -> when it arrived (waiting or prefilling)
        self.queued: dict[int, float] = {}     # waiting request -> when it was queued here
        self._release: set[int] = set()

    # ---- what callers change between steps
    def add(self, request: Request) -> None:
        """Queue a request (checked by the caller: `Request.check`)."""
        self.waiting.append(request)
        self.queued[request.id] = time.monotonic()
        self.arrival[request.id] = request.arrival or self.queued[request.id]

    def abort(self, request_id: int) -> bool:
        """Drop a request; True if it was still waiting (it never ran). Running and prefilling ones leave
        at the next step."""
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                self.arrival.pop(request_id, None)
                self.queued.pop(request_id, None)
                return True
        if request_id in self.running or any(request_id in f.requests for f in self.fills.values()):
            self._release.add(request_id)
        return False

    @property
    def held(self) -> int:
        """Slots taken: running rows and requests whose prompt is being prefilled."""
        return len(self.running) + sum(len(f.requests) for f in self.fills.values())

    @property
    def prefilling(self) -> int:
        return sum(len(f.requests) for f in self.fills.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.fills or self._release)

    def gather(self, now: float, arriving: int) -> float:
        """Seconds the next step should wait for the `arriving` requests (received, not yet queued): while
        nothing runs, at most until GATHER_MAX_S after the first waiting request was queued; else 0."""
        if not arriving or self.running or self.fills or self._release or not self.waiting:
            return 0.0
        return max(0.0, min(self.queued[r.id] for r in self.waiting) + GATHER_MAX_S - now)

    # ---- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(release=sorted(self._release))
        self._release.clear()
        for rid in out.release:
            self._leave(rid)
        self._admit(out)
        rows = len(self.running)
        pending = [(min(self.arrival[r] for r in f.requests), len(f.prompt) - f.done) for f in self.fills.values()]
        budget = self.budget.next(rows, pending, time.monotonic())
        pinned: set[int] = set()
        started: list[_Fill] = []  # prompts in progress ahead of the fill being planned
        for fill in self.fills.values():
            if budget <= 0:
                break
            if not fill.started:
                ahead = self._sharing(fill, started)
                if ahead is not None:
                    columns = self._shared_columns(fill, ahead, out)
                    if not columns:
                        continue  # its prefix is being computed: it waits to find it cached
                    out.share[fill.id] = (ahead.id, columns)
                    fill.started, fill.done = True, columns
            started.append(fill)
            if not fill.started:
                fill.started = True
                entry, tokens = self.kv.lookup(fill.prompt)
                if entry is not None:
                    out.reuse[fill.id] = (entry, tokens)
                    pinned.add(entry)
                    fill.done = tokens
            end = int(min(len(fill.prompt), fill.done + budget))
            out.chunks[fill.id] = end
            budget -= end - fill.done
        for key, end in out.chunks.items():
            fill = self.fills[key]
            if end == len(fill.prompt):  # its rows go to the pool at the end of this step
                self.kv.placed(key)
                kept = self.kv.keep(fill.prompt, pinned)
                if kept is not None:
                    out.keep[key] = kept
                    fill.kept = kept[0]
                    pinned.add(kept[0])
        out.evict = self.kv.take_evicted()
        out.speculate = bool(self.speculation and rows and self.speculation.wanted(rows))
        return out

    def _sharing(self, fill: _Fill, ahead: list[_Fill]) -> _Fill | None:
        """A prompt being prefilled ahead of `fill` that shares at least half of `fill`'s prompt (and a
        block) with it that the prefix cache does not hold yet, so that computing `fill` on its own now
        would compute that prefix twice; None if there is none."""
        if not self.kv.prefix_enabled:
            return None
        need = self._need(fill)
        if len(fill.prompt) <= need or self.kv.cached(fill.prompt) >= need:
            return None
        return next((f for f in ahead if fill.prompt[:need] == f.prompt[:need]), None)

    def _need(self, fill: _Fill) -> int:
        return max(self.kv.block, len(fill.prompt) // 2)

    def _shared_columns(self, fill: _Fill, ahead: _Fill, out: SchedulerOutput) -> int:
        """How many first columns `fill` takes from `ahead`'s chunk in this step's forward (where the
        engine runs every chunk in one forward and `ahead`'s reaches past the shared prefix); 0: none, it
        waits for the prefix cache instead (costing it the steps the one ahead still takes)."""
        if not self.kv.info.fuses_chunks or ahead.id not in out.chunks:
            return 0
        common = next((i for i, (a, b) in enumerate(zip(fill.prompt, ahead.prompt)) if a != b),
                      min(len(fill.prompt), len(ahead.prompt)))
        columns = min(common, out.chunks[ahead.id], len(fill.prompt) - 1)  # a token of its own left
        return columns if columns >= self._need(fill) else 0

    def _admit(self, out: SchedulerOutput) -> None:
        held = self.held
        while self.waiting and held < self.slots:
            request = self.waiting[0]
            fill = next((f for f in self.fills.values() if f.prompt == request.prompt), None)
            if fill is None:
                if not self.kv.reserve(request.id, len(request.prompt)):
                    break  # no room for its prompt's K and V yet: it waits, and those behind it
                fill = self.fills[request.id] = _Fill(request.id, request.prompt)
            fill.requests.append(request.id)
            out.admit.append(Admission(self.waiting.popleft(), fill.id))
            self.queued.pop(request.id, None)
            held += 1

    def _leave(self, rid: int) -> None:
        self.running.discard(rid)
        self.arrival.pop(rid, None)
        for key, fill in list(self.fills.items()):
            if rid in fill.requests:
                fill.requests.remove(rid)
                if not fill.requests:
                    del self.fills[key]
                    self.kv.placed(key)

    def update(self, out: SchedulerOutput, result: StepResult) -> None:
        """Apply what the step did: prompts advanced or placed, rows finished or failed."""
        for key in result.failed_fills:  # its prefill raised: it left no rows and no prefix-cache entry
            fill = self.fills.pop(key, None)
            if fill is not None:
                self.kv.placed(key)
                if fill.kept is not None:
                    self.kv.discard(fill.kept)
        for key, end in out.chunks.items():
            fill = self.fills.get(key)
            if fill is None:
                continue
            if end < len(fill.prompt):
                fill.done = end
                self.kv.prefilled(key, end)
                continue
            del self.fills[key]
            self.running.update(fill.requests)
            for rid in fill.requests:
                self.arrival.pop(rid, None)
        for rid in list(result.failed) + list(result.finished):
            self._leave(rid)
        if self.speculation and result.decode is not None:
            self.speculation.observe(result.decode)
        self.budget.observe(result)

    def state(self) -> dict:
        """`running`: requests holding a slot (vLLM's count), of which `decoding` have their first token."""
        return {"running": self.held, "decoding": len(self.running), "prefilling": self.prefilling,
                "waiting": len(self.waiting), "slots": self.slots, "capacity": self.capacity}
