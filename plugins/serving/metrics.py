"""The serving engine's Prometheus metrics (`mqa_*`), updated once per engine step."""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from plugins.serving.kv_manager import KVManager
from plugins.serving.step import StepResult


class Metrics:
    def __init__(self, slots: int, kv: KVManager, adaptive: bool = False):
        disable_created_metrics()  # no *_created series: they only say when the server started
        self.registry = r = CollectorRegistry()
        self.running = Gauge("mqa_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("mqa_requests_waiting", "Requests waiting for a KV slot", registry=r)
        self.slots_used = Gauge("mqa_kv_pool_slots_used", "KV pool slots holding a request", registry=r)
        Gauge("mqa_kv_pool_slots", "KV pool slots", registry=r).set(slots)
        Gauge("mqa_kv_pool_bytes", "Bytes of the preallocated KV pool, a draft model's included (per rank)",
              registry=r).set(kv.info.pool_bytes + kv.info.draft_bytes)
        Gauge("mqa_kv_budget_bytes", "Bytes of KV the engine may hold (per rank): pool, draft, prefix cache "
              "and prompts being prefilled", registry=r).set(kv.budget_bytes())
        self.kv_bytes = Gauge("mqa_kv_bytes", "Bytes of KV held (per rank), by holder", ["holder"], registry=r)
        self.usage = Gauge("mqa_kv_pool_usage_ratio", "Fraction of KV pool slots in use", registry=r)
        self.tokens_per_s = Gauge("mqa_generation_tokens_per_second", "Generated tokens/s over the last 10 s",
                                  registry=r)
        self.tokens = Counter("mqa_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("mqa_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prefill_tokens = Counter("mqa_prefill_tokens", "Prompt tokens computed by prefills (one per shared "
                                      "prompt of n choices, cached prefixes not counted)", registry=r)
        self.finished = Counter("mqa_requests_finished", "Finished requests", ["reason"], registry=r)
        self.ttft = Histogram("mqa_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.steps = Counter("mqa_decode_steps", "Engine steps", registry=r)
        self.step_chunk = Histogram("mqa_step_prefill_tokens", "Prompt tokens computed per engine step "
                                    "(chunked prefill)", registry=r,
                                    buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096))
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
        self._seen = {"lookups": 0, "hits": 0, "reused_tokens": 0, "steps": 0, "drafted": 0, "accepted": 0}
        self._window: deque[tuple[float, int]] = deque()
        self.kv(kv)

    def _counted(self, stats: dict, counters) -> None:
        """Cumulative figures -> counter increments."""
        for key, counter in counters:
            counter.inc(stats[key] - self._seen[key])
            self._seen[key] = stats[key]

    def kv(self, kv: KVManager) -> None:
        for holder, nbytes in kv.usage().items():
            self.kv_bytes.labels(holder).set(nbytes)
        stats = kv.prefix_stats()
        self._counted(stats, (("lookups", self.prefix_lookups), ("hits", self.prefix_hits),
                              ("reused_tokens", self.prefix_reused)))
        self.prefix_bytes.set(stats["cached_bytes"])
        self.prefix_hit_rate.set(stats["hits"] / stats["lookups"] if stats["lookups"] else 0.0)

    def step(self, now: float, new_tokens: int, result: StepResult) -> None:
        self.steps.inc()
        self.step_chunk.observe(result.prompt_tokens)
        self.prefill_tokens.inc(result.prompt_tokens)
        for phase, seconds in result.seconds.items():
            self.step_seconds.labels(phase).observe(seconds)
        if result.speculation is not None:
            stats = result.speculation
            self._counted(stats, (("steps", self.spec_steps), ("drafted", self.spec_drafted),
                                  ("accepted", self.spec_accepted)))
            self.spec_rate.set(stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0)
        self.tokens.inc(new_tokens)
        self._window.append((now, new_tokens))
        while self._window and now - self._window[0][0] > 10.0:
            self._window.popleft()
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        self.tokens_per_s.set(sum(n for _, n in list(self._window)[1:]) / span if span > 0 else 0.0)
