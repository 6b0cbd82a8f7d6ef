"""Continuous batching on a preallocated KV pool: requests join and leave a running batch at any step.

Active requests hold rows [0, n) of the pool, on one shared time axis (plugins.serving.kv_pool).

- Admission: the prompt is prefilled alone (batch 1, its own scratch cache: the numerics of
  `generate` on that request alone), its first token sampled, and its KV copied into a new row.
  Requests admitted with the same prompt (n choices) share one prefill.
- Chunked prefill: with a token budget (`max_batched_tokens`, vLLM's `max_num_batched_tokens`), a
  step computes at most budget - (rows decoding) prompt tokens, first come first served: a long
  prompt spreads over several steps (each chunk attends to the KV of the chunks before it, as a
  prefix-cache hit does), several short ones share a step, and the running rows decode every step.
  A request holds its slot from admission; its first token comes with its last chunk. Where the
  engine can (`BatchDecoder.mixed`: DeepSpeed's injected layers at TP 1), the chunks and the decode
  step are one forward: the linears run once over all their tokens, attention runs per sequence.
  Elsewhere each chunk is its own forward before the decode step.
- Sampling: each row's own rules (penalties, bias, min tokens: LogitRules) and sampler; a batch of
  plain greedy rows is one argmax.
- Speculative decoding (an engine loaded with `speculative={"draft": ...}`): greedy rows propose by
  prompt lookup or a draft model and a step keeps 1 to k + 1 tokens per row
  (plugins.serving.speculation; a draft model's K and V live in the pool beside the target's:
  plugins.serving.draft).
- Failure of one request: an error raised while admitting or sampling for one request (not by the
  engine's forward over the batch) ends that request alone, reported in the step's "failed"; the
  other rows go on.

Slots rather than blocks: every engine here attends over a dense cache tensor (SDPA, megatron's
static context); blocks would need a gather of the whole cache each step or a paged CPU kernel.
With MQA a slot of 2048 tokens of SantaCoder-1B is 25 MB, so dense slots cost little.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from plugins.core.config import ConfigError
from plugins.engine.backend import LocalBackend
from plugins.engine.contract import BatchDecoder
from plugins.engine.sampling import Sampler, top_logprobs
from plugins.serving.draft import DraftedDecoder
from plugins.serving.kv_pool import RowPool
from plugins.serving.prefix_cache import PrefixCache
from plugins.serving.request import BatchRequest, Row, check_request, failure_message
from plugins.serving.speculation import RowSpeculation


@dataclass(eq=False)
class _Prefill:
    """A prompt on its way into the pool, chunk by chunk, for the requests that share it."""

    requests: list[BatchRequest]
    done: int = 0                      # prompt columns computed or taken from the prefix cache
    kv: list[torch.Tensor] | None = None  # their K and V (pool layout, `done` columns; None while done == 0)
    logits: torch.Tensor | None = None    # of the last computed position
    started: bool = False
    scores: torch.Tensor | None = None  # logits of every prompt position, scored once for all its requests
    scored: dict = field(default_factory=dict)  # top-k -> the prompt's log-probabilities

    @property
    def prompt(self) -> list[int]:
        return self.requests[0].prompt


class ContinuousBatch:
    """`prefix_cache_bytes` > 0 keeps the KV of prompt prefixes for later prompts that share them
    (plugins.serving.prefix_cache); 0 turns that off. `max_batched_tokens` (None: no limit) bounds the
    tokens of one step, decode rows included: prompts beyond it are prefilled in chunks over steps."""

    def __init__(self, decoder: BatchDecoder, slots: int, capacity: int, device="cpu", prefix_cache_bytes: int = 0,
                 score=None, max_batched_tokens: int | None = None, speculation: RowSpeculation | None = None):
        """`score(input_ids, attention_mask)` -> logits of every position: prompt log-probabilities.
        `speculation`: greedy rows speculate (the decoder's `verify` checks their proposals)."""
        if slots < 1 or capacity < 2:
            raise ConfigError(f"a KV pool needs >= 1 slot and >= 2 columns, got {slots} x {capacity}")
        self.decoder, self.slots, self.capacity, self.score = decoder, slots, capacity, score
        self.max_batched_tokens = max_batched_tokens
        self.filling: list[_Prefill] = []  # admitted, prompt not all computed yet (FIFO)
        self.prefix = PrefixCache(prefix_cache_bytes, decoder.time_dim) if prefix_cache_bytes > 0 else None
        self.pool = RowPool(decoder, slots, capacity, device)
        self.speculation = speculation
        self.rows: list[Row] = []  # row r of the pool serves rows[r]
        self.prefill_tokens = 0  # prompt tokens computed so far (not those of shared prefills or cache hits)

    @property
    def n(self) -> int:
        return len(self.rows)

    def check(self, request: BatchRequest) -> None:
        check_request(request, self.capacity)

    @property
    def held(self) -> int:
        """Slots taken: running rows and requests whose prompt is being prefilled."""
        return self.n + sum(len(fill.requests) for fill in self.filling)

    @torch.inference_mode()
    def step(self, admit: list[BatchRequest] = (), release: list[int] = (), chunk_tokens: int | None = None) -> dict:
        """Drop `release` (ids), take `admit`, prefill what the token budget allows (whole prompts
        without one; `chunk_tokens`: this step's prompt tokens, in place of the batch's budget; 0: none), place
        the prompts now complete, then one decode step for every active row.
        Returns {"tokens": {id: [new token ids]}, "finished": {id: "stop" (EOS) or "length"},
        "failed": {id: message}} (requests that raised alone, now released), and where asked
        "logprobs": {id: [(logprob, [(token, logprob) x k]) per new token]}, "prompt_logprobs": {id: the
        same per prompt token after the first}; "prefill_tokens": prompt tokens computed since the
        start; this step's "chunk_tokens" (prompt tokens computed) and "step_s" (seconds by phase:
        "prefill" and "decode", or "mixed" where the engine ran both in one forward); "running": rows
        that decode in the next step; "prefilling": requests whose prompt is not complete yet."""
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                         or chunk_tokens < 0):
            raise ConfigError(f"chunk_tokens must be an integer >= 0, got {chunk_tokens!r}")
        for request in admit:
            self.check(request)
        if self.held + len(admit) > self.slots:
            raise ConfigError(f"{self.held + len(admit)} requests for {self.slots} slots")
        for rid in release:
            self._release(rid)
        for request in admit:  # n choices of one prompt join one prefill
            fill = next((f for f in self.filling if f.prompt == request.prompt), None)
            if fill is None:
                self.filling.append(_Prefill([request]))
            else:
                fill.requests.append(request)
        out: dict[int, list[int]] = {}
        finished: dict[int, str] = {}
        failed: dict[int, str] = {}
        logprobs: dict[int, list] = {}
        prompt_logprobs: dict[int, list] = {}
        start = time.perf_counter()
        if chunk_tokens is not None:
            budget = chunk_tokens
        else:
            budget = float("inf") if self.max_batched_tokens is None else max(self.max_batched_tokens - self.n, 1)
        plan = self._plan(budget)
        computed = sum(end - fill.done for fill, end in plan)
        phases = {}
        if plan and self.rows and getattr(self.decoder, "fuses_chunks", False):
            # one forward: every row's decode step and the chunks (weights read once)
            chunks = [(self._ids(fill.prompt[:end]), fill.kv) for fill, end in plan]
            for (fill, end), (logits, kv) in zip(plan, self._decode(out, finished, failed, logprobs, chunks)):
                self._advance(fill, end, logits, kv)
            phases["mixed"] = time.perf_counter() - start
            self._place_complete(out, finished, failed, logprobs, prompt_logprobs)
        else:
            for fill, end in plan:
                try:
                    logits, kv = self.decoder.prefill_alone(self._ids(fill.prompt[:end]), fill.kv)
                except Exception as exc:  # these requests alone
                    self.filling.remove(fill)
                    for request in fill.requests:
                        failed[request.id] = failure_message(exc)
                    continue
                self._advance(fill, end, logits, kv)
            self._place_complete(out, finished, failed, logprobs, prompt_logprobs)
            decode_start = time.perf_counter()
            if plan:
                phases["prefill"] = decode_start - start
            if self.rows:
                self._decode(out, finished, failed, logprobs)
                phases["decode"] = time.perf_counter() - decode_start
        result = {"tokens": out, "finished": finished, "failed": failed, "prefill_tokens": self.prefill_tokens,
                  "chunk_tokens": computed, "step_s": phases, "running": self.n,
                  "prefilling": self.held - self.n}
        if logprobs:
            result["logprobs"] = logprobs
        if prompt_logprobs:
            result["prompt_logprobs"] = prompt_logprobs
        if self.prefix:
            result["prefix_cache"] = self.prefix.stats()
        if self.speculation:
            result["speculative"] = self.speculation.stats()
        return result

    def _release(self, rid: int) -> None:
        for r, row in enumerate(self.rows):
            if row.request.id == rid:
                self._remove(r)
                return
        for fill in self.filling:
            fill.requests = [r for r in fill.requests if r.id != rid]
        self.filling = [fill for fill in self.filling if fill.requests]

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.pool.mask.device)

    def _plan(self, budget: float) -> list[tuple[_Prefill, int]]:
        """The prompt chunks of this step, first come first served: (prefill, end column) within `budget`
        tokens. A prompt's first chunk starts after its longest cached prefix."""
        plan = []
        for fill in self.filling:
            if budget <= 0:
                break
            if not fill.started:
                fill.started = True
                fill.done, fill.kv = self.prefix.lookup(fill.prompt) if self.prefix else (0, None)
            end = int(min(len(fill.prompt), fill.done + budget))
            plan.append((fill, end))
            budget -= end - fill.done
        return plan

    def _advance(self, fill: _Prefill, end: int, logits: torch.Tensor, kv: list[torch.Tensor]) -> None:
        self.prefill_tokens += end - fill.done
        fill.done, fill.logits, fill.kv = end, logits, kv
        if end == len(fill.prompt) and self.prefix:
            self.prefix.insert(fill.prompt, kv)

    def _place_complete(self, out: dict, finished: dict, failed: dict, logprobs: dict, prompt_logprobs: dict) -> None:
        for fill in [f for f in self.filling if f.done == len(f.prompt)]:
            self.filling.remove(fill)
            for request in fill.requests:
                n = self.n
                try:
                    self._place(request, fill, out, finished, logprobs, prompt_logprobs)
                except Exception as exc:  # this request alone (a row is placed only at the end of _place)
                    del self.rows[n:]
                    for part in (out, finished, logprobs, prompt_logprobs):
                        part.pop(request.id, None)
                    failed[request.id] = failure_message(exc)

    def _emit(self, row: Row, token: int, out: dict, finished: dict) -> bool:
        out.setdefault(row.request.id, []).append(token)
        row.output.append(token)
        if token == row.request.eos_token_id or token in row.request.stop_token_ids:
            finished[row.request.id] = "stop"
        elif len(row.output) >= row.request.max_new_tokens:
            finished[row.request.id] = "length"
        return row.request.id in finished

    def _place(self, request: BatchRequest, fill: _Prefill, out: dict, finished: dict, logprobs: dict,
               prompt_logprobs: dict) -> None:
        """Sample the first token from the complete prompt's logits, then copy its KV into a new row."""
        r = request
        row = Row(r, Sampler(r.do_sample, r.temperature, r.top_k, r.top_p, r.seed, r.min_p), r.rules(), [])
        if r.prompt_logprobs is not None:
            prompt_logprobs[r.id] = self._prompt_logprobs(fill, r.prompt_logprobs)
        token = row.choose(fill.logits, logprobs)
        if self._emit(row, token, out, finished):
            return
        self.pool.add(fill.kv, token, request.prompt)
        self.rows.append(row)

    def _prompt_logprobs(self, fill: _Prefill, k: int) -> list:
        """The prompt's log-probabilities with top `k`: one scoring forward per prompt, shared by every
        request (n choices) that asks."""
        if self.score is None:
            raise ConfigError("this engine cannot score prompts (no prompt log-probabilities)")
        if fill.scores is None:
            ids = self._ids(fill.prompt)
            fill.scores = self.score(ids, torch.ones_like(ids))[0]
        if k not in fill.scored:
            fill.scored[k] = [top_logprobs(fill.scores[i - 1], token, k) for i, token in enumerate(fill.prompt) if i > 0]
        return fill.scored[k]

    def _decode(self, out: dict, finished: dict, failed: dict, logprobs: dict, chunks=None) -> list | None:
        """One decode step of every row; with `chunks`, in one forward with those prompt chunks
        (`BatchDecoder.mixed`), whose (logits, KV) it returns."""
        pool, n, start = self.pool, self.n, time.perf_counter()
        proposals = None
        if self.speculation and not chunks and self.speculation.wanted(n):
            fits = pool.room(self.speculation.k + 1) - 1
            if fits >= 1:
                proposals = self.speculation.proposals(self.rows, pool, fits)
        if proposals is not None:
            made = self._speculate(proposals, out, finished, failed, logprobs)
            self.speculation.observe(n, True, made, time.perf_counter() - start)
            return None
        pool.room(1)
        t = pool.t
        pool.mask[:n, t] = 1
        pool.ids[:n, t] = pool.last[:n, 0]
        if chunks:
            logits, chunked = self.decoder.mixed(pool.last[:n], pool.mask[:n, :t + 1], pool.pos[:n], chunks)
        else:
            logits, chunked = self.decoder.decode(pool.last[:n], pool.mask[:n, :t + 1], pool.pos[:n]), None
        pool.t += 1
        pool.pos[:n] += 1
        if all(row.plain for row in self.rows):
            tokens = logits.float().argmax(-1).tolist()
        else:
            tokens = [self._choose(row, logits[r:r + 1], failed, logprobs) for r, row in enumerate(self.rows)]
        self._keep([[token] for token in tokens], out, finished)
        if self.speculation and not chunks:
            self.speculation.observe(n, False, n, time.perf_counter() - start)
        return chunked

    def _speculate(self, proposals: list[list[int]], out: dict, finished: dict, failed: dict, logprobs: dict) -> int:
        """One verify forward of every row's next token and its proposals (padded to the longest); each
        row keeps what the model confirms, the other columns stay masked. Returns the tokens kept."""
        pool, n, t = self.pool, self.n, self.pool.t
        width = max(map(len, proposals)) + 1
        tokens = pool.last[:n].repeat(1, width)
        pool.mask[:n, t:t + width] = 0
        for r, proposal in enumerate(proposals):
            tokens[r, 1:1 + len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            pool.mask[r, t:t + 1 + len(proposal)] = 1
        pool.ids[:n, t:t + width] = tokens
        positions = pool.pos[:n] + torch.arange(width, device=tokens.device)
        logits = self.decoder.verify(tokens, pool.mask[:n, :t + width], positions)  # [n, width, V]
        greedy = logits.float().argmax(-1).tolist()
        kept = []
        for r, (row, proposal) in enumerate(zip(self.rows, proposals)):
            if row.greedy:
                tokens = self.speculation.accept(proposal, greedy[r])
                ends = [j for j, token in enumerate(tokens) if token in row.rules.stop_ids]
                kept.append(tokens[:ends[0] + 1] if ends else tokens)  # nothing after a stop token
                if row.request.logprobs is not None:
                    logprobs.setdefault(row.request.id, []).extend(
                        top_logprobs(logits[r, j], token, row.request.logprobs) for j, token in enumerate(kept[-1]))
            else:
                token = self._choose(row, logits[r, :1], failed, logprobs)
                kept.append(None if token is None else [token])
            # this row's columns: its last token and the accepted proposals; the rest masked
            accepted = 0 if kept[-1] is None else len(kept[-1]) - 1
            pool.mask[r, t + 1 + accepted:t + width] = 0
            pool.pos[r] += accepted + 1
        pool.t += width
        pool.holes = True
        self.speculation.steps += 1
        self._keep(kept, out, finished)
        return sum(len(k) for k in kept if k)

    def _keep(self, kept: list[list[int] | None], out: dict, finished: dict) -> None:
        """Each row's new tokens (None: its sampling raised, it is in `failed`), in order until it
        finishes; finished rows leave."""
        done = []
        for r, (row, tokens) in enumerate(zip(self.rows, kept)):
            if tokens is None:
                done.append(r)
                continue
            self.pool.last[r, 0] = tokens[-1]
            if any(self._emit(row, token, out, finished) for token in tokens):
                done.append(r)
        for r in reversed(done):
            self._remove(r)
        self.pool.tidy()

    @staticmethod
    def _choose(row: Row, logits: torch.Tensor, failed: dict, logprobs: dict) -> int | None:
        try:
            return row.choose(logits, logprobs)
        except Exception as exc:
            failed[row.request.id] = failure_message(exc)
            return None

    def _remove(self, r: int) -> None:
        self.pool.remove(r)
        self.rows[r] = self.rows[-1]
        self.rows.pop()

    def kv_pool_bytes(self) -> int:
        return self.pool.nbytes()

    def state(self) -> dict:
        return {"running": self.n, "prefilling": self.held - self.n, "slots": self.slots, "capacity": self.capacity,
                "columns": self.pool.t,
                "kv_pool_bytes": self.kv_pool_bytes(),
                "prefix_cache": self.prefix.stats() if self.prefix else None}


def check_batchable(cls) -> None:
    """Refuse, before loading, an engine class that has no continuous batching (no `batch_decoder`
    of its own)."""
    if getattr(cls, "batch_decoder", LocalBackend.batch_decoder) is LocalBackend.batch_decoder:
        raise ConfigError(f"backend {cls.name!r} has no continuous batching")


def open_batch(backend, slots: int, capacity: int | None = None, prefix_cache_bytes: int = 0,
               max_batched_tokens: int | None = None):
    """A continuous batch of `slots` rows on `backend`, its KV pool allocated now: an object with
    `step(admit, release)` and `state()`. `capacity` (prompt + new tokens per request) defaults to
    n_positions; `prefix_cache_bytes` > 0 keeps prompt prefixes' KV for reuse, up to that many bytes
    (per rank); `max_batched_tokens` (None: no limit) is the token budget of a step, over which
    prompts are prefilled in chunks. A backend whose ranks run elsewhere (plugins.dist) opens the
    batch on its ranks."""
    capacity = backend.config.n_positions if capacity is None else capacity
    for name, value, least in (("slots", slots, 1), ("capacity", capacity, 1),
                               ("prefix_cache_bytes", prefix_cache_bytes, 0),
                               ("max_batched_tokens", 1 if max_batched_tokens is None else max_batched_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    if capacity > backend.config.n_positions:
        raise ConfigError(f"capacity {capacity} exceeds the model's n_positions {backend.config.n_positions}")
    remote = getattr(type(backend), "open_batch", None)
    if remote is not None:
        return remote(backend, slots, capacity, prefix_cache_bytes, max_batched_tokens)
    decoder = backend.batch_decoder(slots, capacity)  # refuses what it cannot batch
    spec, speculation = getattr(backend, "speculative", None), None
    if spec:
        draft = getattr(backend, "draft", None)
        if draft is not None:
            if capacity > draft.config.n_positions:
                raise ConfigError(f"capacity {capacity} exceeds the draft model's n_positions {draft.config.n_positions}")
            draft = draft.batch_decoder(slots, capacity)
            decoder = DraftedDecoder(decoder, draft)
        speculation = RowSpeculation(spec["k"], spec.get("ngram", 2), draft=draft)
    return ContinuousBatch(decoder, slots, capacity, backend.device,
                           prefix_cache_bytes, score=backend.logits, max_batched_tokens=max_batched_tokens,
                           speculation=speculation)
